"""rope_scaling: radixrt's rotary tables and greedy ids against transformers', in float32.

The table tests read a config.json dict through ``ModelConfig.from_dict``, as the loader
does, and compare cos·a and sin·a (a: the attention factor) with the rotary embedding
transformers builds from the same dict, at every position below max_position_embeddings,
which lie well past the original context.  The end-to-end tests run tiny llama models with
such a rope_scaling through the Engine on prompts longer than the original context.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.model.hf_config import ModelConfig
from radixrt.model.rope import cos_sin_tables
from radixrt.testing import make_tiny_model

MAX_POS = 96
ORIGINAL = 16  # the original context (original_max_position_embeddings) of most configs below

# name -> (rope_scaling, other top-level config.json fields)
SCALINGS: dict[str, tuple[dict, dict]] = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, {}),
    "yarn": (
        {"rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": ORIGINAL},
        {},
    ),
    "yarn, mscale": (
        {
            "rope_type": "yarn",
            "factor": 6.0,
            "original_max_position_embeddings": ORIGINAL,
            "mscale": 0.9,
            "mscale_all_dim": 0.5,
            "beta_fast": 8,
            "beta_slow": 0.5,
            "truncate": False,
        },
        {},
    ),
    "yarn, attention_factor": (
        {
            "type": "yarn",
            "factor": 4.0,
            "attention_factor": 0.8,
            "original_max_position_embeddings": ORIGINAL,
        },
        {},
    ),
    # transformers takes a top-level original_max_position_embeddings over the rope dict's
    "yarn, top-level original context": (
        {"type": "yarn", "factor": 5.0, "original_max_position_embeddings": 48},
        {"original_max_position_embeddings": ORIGINAL},
    ),
    # and max_position_embeddings where neither names one
    "yarn, no original context": ({"rope_type": "yarn", "factor": 2.0, "beta_slow": 0.25}, {}),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 6.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        {},
    ),
}
_HF_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def _config(arch: str, rope_scaling: dict | None, **extra) -> dict:
    return copy.deepcopy(
        {
            "model_type": arch,
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": MAX_POS,
            "rope_theta": 10000.0,
            "rope_scaling": rope_scaling,
            **extra,
        }
    )


def _hf_cos_sin(config: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers' (cos [MAX_POS, D], sin [MAX_POS, D], attention_scaling) for ``config``."""
    from transformers import CONFIG_MAPPING

    arch = config["model_type"]
    hf_config = CONFIG_MAPPING[arch].from_dict(copy.deepcopy(config))  # it updates the rope dict
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    rotary = getattr(module, f"{_HF_PREFIX[arch]}RotaryEmbedding")(hf_config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(MAX_POS)[None])
    return cos[0], sin[0], rotary.attention_scaling


def _radixrt_cos_sin(config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """radixrt's tables for ``config``, sin± turned back into sin."""
    cfg = ModelConfig.from_dict(config)
    cos, sin_signed = cos_sin_tables(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )
    half = cfg.head_dim // 2
    return cos, torch.cat([-sin_signed[:, :half], sin_signed[:, half:]], dim=-1)


@pytest.mark.parametrize("name", SCALINGS)
def test_tables_match_transformers(name):
    rope_scaling, extra = SCALINGS[name]
    config = _config("llama", rope_scaling, **extra)
    want_cos, want_sin, attention_scaling = _hf_cos_sin(config)
    cos, sin = _radixrt_cos_sin(config)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (MAX_POS, 32)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)
    assert cos[0, 0].item() == pytest.approx(attention_scaling)  # cos·a at position 0 is a
    if name.startswith("yarn"):
        assert abs(attention_scaling - 1) > 0.05
    plain_cos, _ = _radixrt_cos_sin(_config("llama", None))
    if name == "dynamic":  # transformers rescales only past max_position_embeddings
        torch.testing.assert_close(want_cos, plain_cos, rtol=0, atol=1e-6)
    else:
        assert (cos[ORIGINAL:] - plain_cos[ORIGINAL:]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("name", ["yarn, mscale", "llama3"])
def test_tables_match_transformers_for_every_architecture(arch, name):
    rope_scaling, extra = SCALINGS[name]
    config = _config(arch, rope_scaling, **extra)
    want_cos, want_sin, _ = _hf_cos_sin(config)
    cos, sin = _radixrt_cos_sin(config)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)


def test_dynamic_is_exact_only_below_max_position_embeddings():
    """transformers' dynamic NTK recomputes its frequencies once a forward reaches past
    max_position_embeddings; the tables (and the Engine's context) end before that."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config("llama", SCALINGS["dynamic"][0])
    rotary = LlamaRotaryEmbedding(LlamaConfig.from_dict(copy.deepcopy(config)))
    cos, _ = _radixrt_cos_sin(config)
    inside, _ = rotary(torch.zeros(1), torch.arange(MAX_POS)[None])
    beyond, _ = rotary(torch.zeros(1), torch.arange(MAX_POS + 32)[None])
    torch.testing.assert_close(inside[0], cos, rtol=0, atol=1e-6)
    assert (beyond[0, 1:MAX_POS] - cos[1:]).abs().max() > 1e-3


# --------------------------------------------------------------------------- #
# End to end: the Engine's greedy ids and logprobs against transformers'
# --------------------------------------------------------------------------- #

E2E = ["linear", "dynamic", "yarn, mscale", "llama3"]
NEW = 24
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True)


def _prompts() -> list[list[int]]:
    """A shared 12-token prefix and tails to 20..60 tokens: all past the original context."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 2048, (12,), generator=gen).tolist()
    return [prefix + torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (8, 21, 35, 48)]


def _hf_greedy_and_logprobs(
    model, prompt: list[int], output: list[int]
) -> tuple[list[int], torch.Tensor]:
    """transformers' argmax after ``prompt + output[:i]`` for each i, and log p(output[i]) there:
    ``output`` is transformers' greedy continuation iff it equals the argmaxes."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return logprobs.argmax(-1).tolist(), logprobs[torch.arange(len(output)), torch.tensor(output)]


def _hf_model(path: str, rope_parameters: dict | None = None):
    """transformers' float32 model of ``path`` (with ``rope_parameters`` instead of its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(path: str) -> Engine:
        made.append(Engine(model=path, dtype="float32", max_total_tokens=2048))
        return made[-1]

    yield make
    for eng in made:
        eng.check_memory()
        eng.shutdown()


@pytest.mark.parametrize("name", E2E)
def test_engine_greedy_matches_transformers(name, engines, tmp_path):
    rope_scaling = SCALINGS[name][0]
    path = make_tiny_model(tmp_path, rope_scaling=rope_scaling, max_position_embeddings=MAX_POS)
    prompts = _prompts()
    eng = engines(path)
    assert eng.model_config.rope_scaling["rope_type"] == rope_scaling["rope_type"]
    assert eng.runner.max_context <= MAX_POS
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert len({t for o in outs for t in o.token_ids}) > 8, "continuation is degenerate"
    model = _hf_model(path)
    for prompt, out in zip(prompts, outs):
        greedy, logprobs = _hf_greedy_and_logprobs(model, prompt, out.token_ids)
        assert out.token_ids == greedy
        torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, rtol=0, atol=1e-4)
    again = eng.generate(input_ids=prompts, sampling_params=GREEDY)  # over the cached prefixes
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.cached_tokens >= o.prompt_tokens - 1 for o in again)
    if name != "dynamic":  # the scaling changes the continuation: a runtime ignoring it fails
        plain = _hf_model(path, {"rope_type": "default", "rope_theta": 10000.0})
        assert any(
            _hf_greedy_and_logprobs(plain, p, o.token_ids)[0] != o.token_ids
            for p, o in zip(prompts, outs)
        )
