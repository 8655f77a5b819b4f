"""Tiny GGUF models (llama.cpp's layout, written with the gguf package) served from their
blocks: greedy outputs follow a float32 Engine on the same dequantized weights wherever that
Engine's top-2 log-probabilities are not within the quantization's error, the first token's
log-probabilities are close to it, and the quantized model keeps the exact-outputs invariant
(a request's bits whatever the batch)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from server_harness import Server

from radixrt import Engine
from radixrt.quant.formats import QuantTensor
from radixrt.quant.gguf_model import GGUFFile, gguf_model_folder
from radixrt.quant.gguf_writer import write_gguf
from radixrt.quant.quant_linear import held_tensors
from radixrt.sampling import SamplingParams
from radixrt.testing import make_tiny_model, tiny_model_path
from radixrt_kernels.cpu import quant as cpu_quant

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello there, how are", "def f(x):\n    return", "import os\nimport", "The quick brown"]
MARGIN = 0.3  # top-2 log-probability gap the int8 activations cannot close on these models
FIRST_LOGPROB = 0.15  # |difference| of the first token's log-probability


def _dequantized_folder(gguf: str, out: Path) -> str:
    """The GGUF model's folder with its weights dequantized to float32 safetensors."""
    shutil.copytree(gguf_model_folder(gguf), out)
    (out / "radixrt-gguf.json").unlink()
    tensors = {
        name: (t.dequantize() if isinstance(t, QuantTensor) else t.float()).contiguous()
        for name, t in GGUFFile(gguf).tensors()
    }
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def _follows(ref, got) -> None:
    """got's greedy tokens equal ref's up to the first step where ref's top-2 gap < MARGIN."""
    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        lps = ref.top_logprobs[i][1]
        if float(lps[0] - lps[1]) < MARGIN:
            return
        assert a == b, f"token {i}: {b} where the float32 model's {a} leads by {lps[0] - lps[1]}"


def random_blocks(w: torch.Tensor, qtype: str) -> np.ndarray:
    """Random blocks of ``qtype`` for a weight of ``w``'s shape, their fp16 scales small (the
    types no quantizer here writes: what the model computes from them is what is checked)."""
    from radixrt.quant.formats import BLOCK_TYPES

    t = BLOCK_TYPES[qtype]
    n, blocks = w.shape[0], w.shape[1] // t.block
    g = torch.Generator().manual_seed(n * 7919 + w.shape[1])
    raw = torch.randint(0, 256, (n, blocks, t.type_size), generator=g, dtype=torch.uint8)
    # |w| around 0.03, as the other tiny models
    scale = (torch.rand(n, blocks, generator=g) * 4e-5 + 1e-5).half().view(torch.uint8)
    where = {"Q5_K": [0, 2], "Q6_K": [t.type_size - 2]}[qtype]  # d (and dmin) offsets
    for at in where:
        raw[..., at : at + 2] = scale.view(n, blocks, 2)
    return raw.reshape(n, -1).numpy()


@pytest.mark.parametrize(
    "arch,qtype",
    [
        ("llama", "Q8_0"),
        ("llama", "Q4_1"),
        ("qwen2", "Q4_K"),
        ("qwen3", "Q5_0"),
        ("llama", "Q4_0"),
        ("qwen2", "Q5_1"),
        ("llama", "Q5_K"),
        ("qwen2", "Q6_K"),
    ],
)
def test_a_gguf_model_follows_float32_on_its_dequantized_weights(tmp_path, arch, qtype) -> None:
    blocks = random_blocks if qtype in ("Q5_K", "Q6_K") else None
    gguf = write_gguf(tiny_model_path(arch), tmp_path / "m.gguf", qtype, blocks)
    ref_folder = _dequantized_folder(gguf, tmp_path / "ref")
    sp = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    with Engine(model=ref_folder, dtype="float32", max_total_tokens=1024) as eng:
        ref = eng.generate(PROMPTS, sp)
    with Engine(model=gguf, dtype="float32", max_total_tokens=1024) as eng:
        got = eng.generate(PROMPTS, sp)
        kinds = eng.runner.kernels.describe()["linear"]
    assert any(qtype in k for k in kinds)
    for r, g in zip(ref, got):
        _follows(r, g)
        assert (
            abs(r.logprobs[0] - g.logprobs[0]) < FIRST_LOGPROB or r.token_ids[0] != g.token_ids[0]
        )


def test_a_gguf_model_keeps_a_requests_bits_whatever_the_batch(tmp_path, engine_factory) -> None:
    gguf = write_gguf(tiny_model_path("llama"), tmp_path / "m.gguf", "Q4_1")
    sp = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True)
    eng = engine_factory(gguf, dtype="auto", max_total_tokens=1024)  # its KV checked at the end
    alone = [eng.generate([p], sp)[0] for p in PROMPTS]
    eng.flush_cache()
    together = eng.generate(PROMPTS, sp)
    warm = eng.generate(PROMPTS, sp)
    for a, b, c in zip(alone, together, warm):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(c.logprobs))


def test_a_gguf_model_is_described_and_counted(tmp_path) -> None:
    tied = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    gguf = write_gguf(tied, tmp_path / "m.gguf", "Q4_1")
    with Engine(model=gguf, max_total_tokens=256) as eng:
        info = eng.runner.weights_info
        held = held_tensors(eng.runner.model)  # each storage the model holds, once
    assert info["quantization"] == "gguf"
    paths = "|".join(cpu_quant.PATHS)  # each role's type and the kernel paths it runs
    runs = rf"Q4_1: ({paths})( up to \d+ rows, ({paths}) above)?"
    assert re.fullmatch(runs, info["weights"]["model.layers.self_attn.qkv_proj"])
    assert re.fullmatch(runs, info["weights"]["lm_head"])  # tied: the embedding's blocks
    assert info["weight_file_bytes"] == Path(gguf).stat().st_size
    assert info["weight_bytes"] == sum(nbytes for _, nbytes in held)
    rope = sum(nbytes for (_, nbytes), name in held.items() if ".rotary." in name)
    assert info["weight_bytes"] - rope <= 1.1 * info["weight_file_bytes"]  # the blocks, once


def test_a_server_on_a_gguf_file_names_it_and_its_quantization(tmp_path) -> None:
    gguf = write_gguf(tiny_model_path("llama"), tmp_path / "tiny-q4.gguf", "Q4_1")
    server = Server("--model", gguf, "--dtype", "bfloat16")
    try:
        card = httpx.get(f"{server.http}/v1/models").json()["data"][0]
        assert card["id"] == "tiny-q4" and card["quantization"] == "gguf"
        info = httpx.get(f"{server.http}/get_server_info").json()["internal_states"][0]
        assert info["weights"]["model.layers.mlp.gate_up_proj"].startswith("Q4_1: ")
        chat = httpx.post(
            f"{server.http}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        ).json()
        assert chat["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
    log = server.proc.stderr.read()  # the launch log: each weight's type and paths, the bytes
    assert re.search(r"radixrt: weights: gguf, [\d.]+ MiB held \(files [\d.]+ MiB\); ", log)
    assert "model.layers.mlp.gate_up_proj: Q4_1: " in log


@pytest.mark.parametrize("quantization", ["q4_0", "q4_k"])
def test_quantizing_at_load_runs_the_same_blocks_as_its_gguf_file(tmp_path, quantization) -> None:
    folder = tiny_model_path("qwen2")
    gguf = write_gguf(folder, tmp_path / "m.gguf", quantization.upper())
    sp = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True)
    with Engine(model=folder, quantization=quantization, max_total_tokens=512) as eng:
        loaded = eng.generate(PROMPTS, sp)
        assert eng.runner.weights_info["quantization"] == quantization
    with Engine(model=gguf, max_total_tokens=512) as eng:
        from_file = eng.generate(PROMPTS, sp)
    for a, b in zip(loaded, from_file):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_a_gguf_file_missing_a_tensor_is_refused_naming_it(tmp_path) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "src"
    shutil.copytree(tiny_model_path("llama"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    gguf = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    with pytest.raises(ValueError, match=r"missing parameters: \['model.layers.1.mlp.down_proj"):
        Engine(model=gguf, max_total_tokens=256)
