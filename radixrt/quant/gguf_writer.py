"""A Hugging Face model folder written as a GGUF file, as llama.cpp's converter lays it out.

``write_gguf(folder, path, qtype)`` writes the folder's config as the architecture's GGUF
metadata, its byte-level BPE tokenizer (tokens, merges, special ids, chat template) and its
weights: every 2-D linear and embedding weight in block type ``qtype`` (quantized by
``quantize``), norms and biases in float32; a llama model's q and k rows permuted as the
converter permutes them. The tests build their GGUF models with it; the ``gguf`` package
does the writing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from radixrt.quant import rtn
from radixrt.quant.gguf_model import LAYER_NAMES, MODEL_NAMES, PERMUTED_QK

_GGUF_NAMES = {hf: gg for gg, hf in MODEL_NAMES.items()}
_GGUFLAYER_NAMES = {hf: gg for gg, hf in LAYER_NAMES.items()}


def gguf_tensor_name(hf: str) -> str:
    """The GGUF name of Hugging Face checkpoint tensor ``hf``."""
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    parts = hf.split(".")  # model.layers.N.<rest>
    if parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in _GGUFLAYER_NAMES:
        raise ValueError(f"no GGUF name for tensor {hf!r}")
    return f"blk.{parts[2]}.{_GGUFLAYER_NAMES['.'.join(parts[3:])]}"


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row permutation (``gguf_model.unpermute_rows`` undoes it)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def quantize(w: torch.Tensor, qtype: str) -> np.ndarray:
    """Round-to-nearest blocks of type ``qtype`` for float weight ``w`` [N, K]: uint8
    [N, row bytes] (``rtn.quantize``)."""
    return rtn.quantize(w, qtype).raw.numpy()


def write_gguf(
    folder: str | os.PathLike[str],
    path: str | os.PathLike[str],
    qtype: str,
    blocks: Callable[[torch.Tensor, str], np.ndarray] | None = None,
) -> str:
    """Write HF model ``folder`` to GGUF file ``path`` (module text); returns ``path``.
    ``blocks(w, qtype)`` gives a 2-D weight's blocks (default ``quantize``; the tests pass
    random blocks for the types nothing here quantizes to)."""
    import gguf

    from radixrt.model.weights import iter_weights

    cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    arch = cfg["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_config(writer, cfg)
    _write_tokenizer(writer, Path(folder))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, w in iter_weights(folder):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_rows(w, heads if "q_proj" in name else kv_heads)
        if w.dim() == 2:
            raw = (blocks or quantize)(w, qtype)
            writer.add_tensor(
                gguf_tensor_name(name), raw, raw_dtype=gguf.GGMLQuantizationType[qtype]
            )
        else:
            writer.add_tensor(gguf_tensor_name(name), w.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _write_config(writer, cfg: dict) -> None:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])


def _write_tokenizer(writer, folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    for kind in ("bos", "eos", "pad"):
        token = getattr(tok, f"{kind}_token")
        if token is not None:
            getattr(writer, f"add_{kind}_token_id")(tok.convert_tokens_to_ids(token))
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
