"""ModelConfig for the families beyond Llama (gemma2, gemma3_text, phi3) and for per-layer
sliding windows: every field as transformers' config and attention classes read the same
config.json dict, and every setting radixrt does not compute refused by name."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from radixrt.model import rope
from radixrt.model.hf_config import ModelConfig

S, F = "sliding_attention", "full_attention"
ABSENT = object()  # a config.json key left out


def _config(model_type: str, **over) -> dict:
    """A config.json dict of ``model_type`` with small sizes, in transformers v4's layout."""
    d = {
        "model_type": model_type,
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    d.update(over)
    return {k: v for k, v in d.items() if v is not ABSENT}


def _hf(config: dict):
    """transformers' config and its attention module for each layer."""
    from transformers import CONFIG_MAPPING

    hf = CONFIG_MAPPING[config["model_type"]].from_dict(copy.deepcopy(config))
    family = config["model_type"].removesuffix("_text")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"gemma2": "Gemma2", "gemma3": "Gemma3", "phi3": "Phi3"}.get(family)
    prefix = prefix or {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    attention = getattr(module, f"{prefix}Attention")
    return hf, [attention(hf, layer_idx=i) for i in range(hf.num_hidden_layers)]


def _hf_window(hf, attn) -> int | None:
    """The window transformers' attention layer applies (phi3 and mistral: the config's, on
    every layer)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return hf.sliding_window


READ_AS_TRANSFORMERS = {
    "gemma2 defaults": _config("gemma2"),
    "gemma2 own settings": _config(
        "gemma2",
        head_dim=32,
        query_pre_attn_scalar=48,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=None,
        sliding_window=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        layer_types=[F, S, S, F, S, S],
    ),
    "gemma3_text defaults": _config("gemma3_text", num_hidden_layers=12),
    "gemma3_text v4 rope": _config(
        "gemma3_text",
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
        attn_logit_softcapping=30.0,
        sliding_window=512,
    ),
    "gemma3_text v5 rope": _config(
        "gemma3_text",
        rope_parameters={
            F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 300000.0},
            S: {"rope_type": "default", "rope_theta": 5000.0},
        },
        query_pre_attn_scalar=128,
    ),
    "phi3 plain": _config("phi3", num_key_value_heads=ABSENT),
    "phi3 window, partial rotation": _config(
        "phi3", sliding_window=2047, partial_rotary_factor=0.75, rms_norm_eps=ABSENT
    ),
    "qwen2 window from max_window_layers": _config(
        "qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=4
    ),
    "qwen3 window on alternate layers": _config(
        "qwen3", use_sliding_window=True, sliding_window=128, layer_types=[S, F] * 3
    ),
    "mistral window": _config("mistral", sliding_window=96),
}


@pytest.mark.parametrize("name", READ_AS_TRANSFORMERS)
def test_fields_are_read_as_transformers_reads_them(name):
    config = READ_AS_TRANSFORMERS[name]
    cfg = ModelConfig.from_dict(config)
    hf, attns = _hf(config)
    assert cfg.layer_windows == tuple(_hf_window(hf, a) for a in attns)
    assert (cfg.head_dim, cfg.num_kv_heads) == (attns[0].head_dim, hf.num_key_value_heads)
    assert cfg.attn_scaling == attns[0].scaling
    assert (cfg.rms_norm_eps, cfg.tie_word_embeddings) == (hf.rms_norm_eps, hf.tie_word_embeddings)
    assert cfg.attn_logit_softcapping == getattr(hf, "attn_logit_softcapping", None)
    assert cfg.final_logit_softcapping == getattr(hf, "final_logit_softcapping", None)
    assert cfg.hidden_act == getattr(hf, "hidden_activation", None) or hf.hidden_act
    assert cfg.qk_norm == hasattr(attns[0], "q_norm")
    rope_parameters = hf.rope_parameters
    if cfg.architecture == "gemma3_text":
        assert cfg.local_rope_theta == rope_parameters[S]["rope_theta"]
        rope_parameters = rope_parameters[F]
    assert cfg.rope_theta == rope_parameters["rope_theta"]
    want_type = rope_parameters.get("rope_type", "default")
    assert (cfg.rope_scaling or {"rope_type": "default"})["rope_type"] == want_type
    assert cfg.partial_rotary_factor == rope_parameters.get("partial_rotary_factor", 1.0)


def test_gemma3_v4_and_v5_layouts_agree():
    v4 = _config(
        "gemma3_text",
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    v5 = _config(
        "gemma3_text",
        rope_parameters={
            F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            S: {"rope_type": "default", "rope_theta": 1e4},
        },
        layer_types=[S] * 5 + [F],
    )
    assert ModelConfig.from_dict(v4) == ModelConfig.from_dict(v5)
    cfg = ModelConfig.from_dict(v4)
    assert cfg.layer_windows == (4096,) * 5 + (None,)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


def _longrope(n: int, **over) -> dict:
    short = [1.0 + 0.05 * i for i in range(n)]
    return {"type": "longrope", "short_factor": short, "long_factor": [4.0] * n, **over}


@pytest.mark.parametrize(
    "over",
    [
        {"rope_scaling": _longrope(16)},  # phi3.5: factor from the contexts, 4096 by default
        {"rope_scaling": _longrope(16, factor=2.0), "original_max_position_embeddings": 1024},
        {"rope_scaling": _longrope(16, type="su", original_max_position_embeddings=4096)},
        {
            "rope_scaling": _longrope(12, attention_factor=1.25),
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 2048,
            "max_position_embeddings": 32768,
        },
    ],
)
def test_phi3_longrope_tables_and_context_are_transformers_short_ones(over):
    """inv_freq and the attention factor are transformers' at a sequence within the original
    context, bit for bit; the context ends at that original context, named in the reason."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config("phi3", **over)
    cfg = ModelConfig.from_dict(config)
    hf = Phi3Config.from_dict(copy.deepcopy(config))
    original = hf.rope_parameters["original_max_position_embeddings"]
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=original)
    got, factor = rope.inv_freq_and_attention_factor(
        cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )
    assert torch.equal(got, want) and factor == want_factor
    assert cfg.max_context == original and f"({original} tokens)" in cfg.context_bound
    plain = ModelConfig.from_dict(_config("phi3"))
    assert plain.max_context == 4096 and plain.context_bound is None


@pytest.mark.parametrize(
    "model_type, over, field",
    [
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ("gemma3_text", {"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ("gemma2", {"attention_bias": True}, "attention_bias"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            "gemma3_text",
            {"rope_parameters": {F: {"rope_type": "default"}, S: {"rope_type": "linear"}}},
            r"rope_parameters\['sliding_attention'\] of type 'linear'",
        ),
        ("gemma3", {"text_config": {}, "vision_config": {}}, "vision-language"),
        ("gemma2", {"sliding_window": None}, "no sliding_window"),
        ("gemma2", {"layer_types": [S, F]}, "layer_types"),
        ("gemma2", {"attn_logit_softcapping": 0.0}, "attn_logit_softcapping"),
        ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ("phi3", {"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
        ("phi3", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "not supported for phi3"),
        ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16}}, "long_factor"),
        ("phi3", {"rope_scaling": _longrope(15)}, "short_factor"),
        ("phi3", {"partial_rotary_factor": 0.3}, "even"),
        ("phi3", {"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ("qwen2", {"layer_types": [S] * 6, "sliding_window": 64}, "no sliding_window"),
        ("mistral", {"sliding_window": 0}, "sliding_window"),
    ],
)
def test_what_radixrt_does_not_compute_is_refused_by_name(model_type, over, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(_config(model_type, **over))


def test_mistral_ignores_layer_types_as_transformers_does():
    cfg = ModelConfig.from_dict(_config("mistral", sliding_window=32, layer_types=[F] * 6))
    assert cfg.layer_windows == (32,) * 6


def test_a_window_on_no_layer_is_no_window():
    cfg = ModelConfig.from_dict(_config("gemma2", layer_types=[F] * 6))
    assert cfg.sliding_window is None and cfg.layer_windows == (None,) * 6
