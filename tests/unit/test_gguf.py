"""GGUF files as model sources: tiny models written with the gguf package (llama.cpp's layout)
read back tensor for tensor, their config and tokenizer equal to the folder they came from,
and damaged or unserved files refused before anything loads."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from radixrt.model.hf_config import ModelConfig
from radixrt.model.weights import iter_weights, model_fingerprint
from radixrt.quant.formats import QuantTensor, dequantize, row_bytes, stack
from radixrt.quant.gguf_model import GGUFFile, gguf_model_folder, unpermute_rows
from radixrt.quant.gguf_writer import permute_rows, quantize, write_gguf
from radixrt.testing import tiny_model_path

LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(arch, type) -> a GGUF file of the tiny model of that arch."""
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch, qtype in [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0"), ("qwen3", "Q5_1")]:
        files[arch, qtype] = write_gguf(tiny_model_path(arch), out / f"{arch}-{qtype}.gguf", qtype)
    return files


@pytest.mark.parametrize("key", [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0")])
def test_a_gguf_reads_back_the_blocks_of_each_tensor_in_checkpoint_order(ggufs, key) -> None:
    arch, qtype = key
    dense = dict(iter_weights(tiny_model_path(arch)))
    seen = set()
    for name, t in GGUFFile(ggufs[key]).tensors():
        seen.add(name)
        if isinstance(t, QuantTensor):  # rows quantize alone: q/k unpermuted = quantized as is
            assert t.qtype == qtype and torch.equal(
                t.raw, torch.from_numpy(quantize(dense[name], qtype))
            )
        else:
            assert torch.equal(t, dense[name].float())
    assert seen == set(dense) - {"lm_head.weight"} or seen == set(dense)


def test_the_llama_permutation_is_undone() -> None:
    w = torch.arange(6 * 8 * 4, dtype=torch.float32).reshape(48, 4)
    for heads in (6, 3, 1):
        assert torch.equal(permute_rows(w, heads)[unpermute_rows(48, heads)], w)
        assert not torch.equal(permute_rows(w, heads), w)


@pytest.mark.parametrize("key", [("llama", "Q8_0"), ("qwen2", "Q4_0"), ("qwen3", "Q5_1")])
def test_a_gguf_folder_has_the_config_and_tokenizer_of_its_source(ggufs, key) -> None:
    from transformers import AutoTokenizer

    source = tiny_model_path(key[0])
    folder = gguf_model_folder(ggufs[key])
    ours, theirs = ModelConfig.from_pretrained(folder), ModelConfig.from_pretrained(source)
    assert ours.eos_token_ids == theirs.eos_token_ids[:1]  # a GGUF file names one eos token
    assert dataclasses.replace(ours, eos_token_ids=theirs.eos_token_ids) == theirs
    a, b = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(folder)
    for text in (
        "Hello world, this is a test.",
        "def f(x):\n    return x**2  # ünïcödé",
        " a  b\t",
    ):
        assert a(text)["input_ids"] == b(text)["input_ids"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        b.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    assert gguf_model_folder(ggufs[key]) == folder  # written once, then reused


def test_the_fingerprint_names_the_gguf_file(ggufs) -> None:
    a = model_fingerprint(gguf_model_folder(ggufs["llama", "Q8_0"]))
    b = model_fingerprint(gguf_model_folder(ggufs["llama", "Q4_1"]))
    assert a != b


def test_quantized_rows_stack_by_type() -> None:
    k = 64
    raw = lambda n, t: torch.zeros(n, row_bytes(t, k), dtype=torch.uint8)  # noqa: E731
    parts = [QuantTensor("Q4_0", raw(2, "Q4_0"), k), QuantTensor("Q4_0", raw(3, "Q4_0"), k)]
    parts.append(QuantTensor("Q8_0", raw(1, "Q8_0"), k))
    segments = stack(parts)
    assert [(s.qtype, s.shape) for s in segments] == [("Q4_0", (5, k)), ("Q8_0", (1, k))]


def test_a_quant_tensor_refuses_a_wrong_shape_and_an_unserved_type() -> None:
    with pytest.raises(
        ValueError, match=r"Q4_0 weight of 64 columns: raw must be uint8 \[rows, 36\]"
    ):
        QuantTensor("Q4_0", torch.zeros(2, 35, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q4_K", 576)
    with pytest.raises(ValueError, match="'IQ2_XS' is not served"):
        row_bytes("IQ2_XS", 256)


def test_dequantize_is_the_gguf_packages(ggufs) -> None:
    from gguf.quants import dequantize as gguf_dequantize

    for _, t in GGUFFile(ggufs["llama", "Q4_1"]).tensors():
        if isinstance(t, QuantTensor):
            want = gguf_dequantize(t.raw.numpy(), 3).reshape(t.shape)
            assert np.array_equal(dequantize(t.qtype, t.raw, t.k).numpy(), want)
            break


# ---- damaged and unserved files: refused before anything is written or loaded -------------


def _cache_entries() -> set[str]:
    root = Path(os.environ.get("RADIXRT_CACHE_DIR", "")) / "gguf"
    return set(os.listdir(root)) if root.is_dir() else set()


def _refused(path: Path, match: str) -> None:
    before = _cache_entries()
    with pytest.raises(ValueError, match=match):
        gguf_model_folder(path)
    assert _cache_entries() - before <= {e for e in _cache_entries() if e.startswith(".")}


def test_a_truncated_file_is_refused(ggufs, tmp_path) -> None:
    data = Path(ggufs["llama", "Q8_0"]).read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    _refused(bad, "not a readable GGUF file")


def test_a_wrong_magic_is_refused(ggufs, tmp_path) -> None:
    data = Path(ggufs["llama", "Q8_0"]).read_bytes()
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    _refused(bad, "not a readable GGUF file")


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, int | None]]) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_head_count(2)
    for name, (data, raw_type) in tensors.items():
        if raw_type is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(raw_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unknown_tensor_type_names_the_tensor(tmp_path) -> None:
    q2k = np.zeros((4, 84), dtype=np.uint8)  # Q2_K: 84 bytes per 256 weights
    bad = _write(tmp_path / "q2k.gguf", "llama", {"blk.0.attn_q.weight": (q2k, 10)})
    _refused(bad, r"tensor 'blk.0.attn_q.weight' has type Q2_K, which radixrt does not serve")


def test_an_unknown_architecture_is_named(tmp_path) -> None:
    bad = _write(
        tmp_path / "arch.gguf", "gemma3", {"output_norm.weight": (np.ones(8, np.float32), None)}
    )
    _refused(bad, r"GGUF architecture 'gemma3' is not served \(served: llama, qwen2, qwen3\)")


def test_an_unknown_tensor_name_is_named(tmp_path) -> None:
    bad = _write(
        tmp_path / "name.gguf",
        "llama",
        {"blk.0.ffn_gate_exps.weight": (np.ones((2, 8), np.float32), None)},
    )
    _refused(bad, r"tensor 'blk.0.ffn_gate_exps.weight' \(F32\) is not part of a llama model")


def test_a_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_model_folder(tmp_path / "nope.gguf")


def test_a_struct_sized_header_alone_is_refused(tmp_path) -> None:
    bad = tmp_path / "header.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 0))
    _refused(bad, "not a readable GGUF file")


def test_a_dense_linear_weight_the_model_would_round_is_refused() -> None:
    from radixrt.quant.gguf_model import exact_in

    f16 = torch.ones(4, 8, dtype=torch.float16)
    weights = [("model.embed_tokens.weight", f16), ("model.layers.0.mlp.up_proj.weight", f16)]
    assert len(list(exact_in(weights, torch.float32))) == 2  # widened exactly
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' is F16; a bfloat16"):
        list(exact_in(weights, torch.bfloat16))  # the embedding passes, the linear does not
    bf16 = [("lm_head.weight", f16.bfloat16()), ("model.norm.weight", torch.ones(8))]
    assert len(list(exact_in(bf16, torch.bfloat16))) == 2
