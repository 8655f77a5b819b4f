"""The families beyond Llama (gemma2, gemma3_text, phi3), sliding windows on some or all
layers (mistral, qwen2, qwen3, mixtral) and mixture-of-experts models (qwen3_moe, qwen2_moe with
its shared expert, mixtral, olmoe) through the Engine, against transformers in float32.

Each tiny model (``radixrt.testing``: windows of 12 positions, prompts of 23 to 50 tokens, a
shared prefix of 20) generates greedily; its tokens must be transformers' argmax after every
prefix of prompt + output and its logprobs transformers' within 1e-4, with the radix cache on
(the shared prefix reused in-batch, then whole prompts) and off. On the default backend,
whose outputs are exact, a prefix hit longer than the window, a chunked prefill and a run
without the cache give the same bits. Each family setting changes transformers' greedy
output on these prompts, so a runtime that ignored one would fail.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.testing import make_tiny_model, output_bits

S, F = "sliding_attention", "full_attention"
NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True)
_GEN = torch.Generator().manual_seed(7)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": (1 + torch.rand(12, generator=_GEN)).tolist(),  # phi3's 24 rotated dims
    "long_factor": (4 + 4 * torch.rand(12, generator=_GEN)).tolist(),
}

# name -> make_tiny_model's arguments; the family's own settings are testing.FAMILY_OPTIONS'
MODELS: dict[str, dict] = {
    "gemma2": {"arch": "gemma2"},
    "gemma3_text": {"arch": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # the LM head reads the unscaled embedding (its random continuation repeats a token)
    "gemma3_text tied": {"arch": "gemma3_text", "tie_word_embeddings": True},
    "phi3": {"arch": "phi3"},
    "phi3 longrope": {
        "arch": "phi3",
        "sliding_window": None,
        "rope_scaling": LONGROPE,
        "original_max_position_embeddings": 48,
        "max_position_embeddings": 192,
    },
    "mistral": {"arch": "mistral"},
    "qwen2 windows from max_window_layers": {
        "arch": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 12,
        "max_window_layers": 2,
    },
    "qwen3 windows on alternate layers": {
        "arch": "qwen3",
        "use_sliding_window": True,
        "sliding_window": 12,
        "layer_types": [S, F] * 2,
    },
    "qwen3_moe": {"arch": "qwen3_moe"},
    "qwen2_moe": {"arch": "qwen2_moe", "mlp_only_layers": [1]},  # a dense layer among them
    "mixtral": {"arch": "mixtral", "sliding_window": 12},
    "olmoe": {"arch": "olmoe"},
}

# name -> transformers config changes that each drop one of the model's settings
DROPPED: dict[str, list[dict]] = {
    "gemma2": [
        {"sliding_window": 4096},
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"query_pre_attn_scalar": 32},
    ],
    "gemma3_text": [
        {"layer_types": [F] * 4},
        {
            "rope_parameters": {
                F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                S: {"rope_type": "default", "rope_theta": 1e6},
            }
        },
        {
            "rope_parameters": {
                F: {"rope_type": "default", "rope_theta": 1e6},
                S: {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        {"query_pre_attn_scalar": 32},
    ],
    "gemma3_text tied": [{"query_pre_attn_scalar": 32}],
    "phi3": [
        {"sliding_window": None},
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 1.0,
            }
        },
    ],
    "phi3 longrope": [
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
            }
        }
    ],
    "mistral": [{"sliding_window": None}],
    "qwen2 windows from max_window_layers": [{"layer_types": [F] * 4}],
    "qwen3 windows on alternate layers": [{"layer_types": [F] * 4}],
    "qwen3_moe": [{"norm_topk_prob": False}, {"num_experts_per_tok": 1}],
    "qwen2_moe": [{"norm_topk_prob": False}, {"mlp_only_layers": []}],
    "mixtral": [{"sliding_window": None}, {"num_experts_per_tok": 1}],
    "olmoe": [{"norm_topk_prob": True}],
}


def _shared(name: str) -> int:
    """The length of the prompts' shared prefix (longer than the window)."""
    return 14 if name == "phi3 longrope" else 20


def _prompts(name: str) -> list[list[int]]:
    """A shared prefix and three tails (within the longrope model's original context of 48
    with the new tokens)."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 2048, (_shared(name),), generator=gen).tolist()
    tails = (2, 8, 16) if name == "phi3 longrope" else (3, 15, 30)
    return [prefix + torch.randint(3, 2048, (n,), generator=gen).tolist() for n in tails]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: make_tiny_model(root / name.replace(" ", "_"), **args)
        for name, args in MODELS.items()
    }


def _engine(path: str, backend: str, **kwargs) -> Engine:
    return Engine(
        model=path,
        dtype="float32",
        max_total_tokens=4096,
        attention_backend=backend,
        disable_deterministic_inference=backend == "torch",  # PyTorch's attention is not exact
        **kwargs,
    )


_HF_MODELS: dict[tuple[str, str], object] = {}


def _hf_model(path: str, change: dict | None = None):
    """transformers' float32 model of ``path``, its config changed by ``change`` (kept)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    key = (path, repr(change))
    if key not in _HF_MODELS:
        config = AutoConfig.from_pretrained(path)
        for name, value in (change or {}).items():
            setattr(config, name, copy.deepcopy(value))
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch.float32
        ).eval()
    return _HF_MODELS[key]


def _hf_greedy_and_logprobs(model, prompt: list[int], output: list[int]):
    """transformers' argmax after ``prompt + output[:i]`` for each i, and log p(output[i])."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return logprobs.argmax(-1).tolist(), logprobs[torch.arange(len(output)), torch.tensor(output)]


def _assert_transformers(name: str, path: str, prompts, outs) -> None:
    if not MODELS[name].get("tie_word_embeddings"):
        assert len({t for o in outs for t in o.token_ids}) > 8, "continuation is degenerate"
    for prompt, out in zip(prompts, outs):
        greedy, logprobs = _hf_greedy_and_logprobs(_hf_model(path), prompt, out.token_ids)
        assert out.token_ids == greedy
        torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_and_logprobs_match_transformers(name, backend, models):
    path, prompts = models[name], _prompts(name)
    with _engine(path, backend) as eng:
        first = eng.generate(input_ids=prompts[:1], sampling_params=GREEDY)
        first += eng.generate(input_ids=prompts[1:], sampling_params=GREEDY)
        assert all(o.cached_tokens >= _shared(name) for o in first[1:])  # past the window
        again = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        assert all(o.cached_tokens >= o.prompt_tokens - 1 for o in again)
        eng.check_memory()
    with _engine(path, backend, disable_radix_cache=True) as eng:
        uncached = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for outs in (first, again, uncached):
        _assert_transformers(name, path, prompts, outs)
    if backend == "auto":  # exact outputs: the cache changes no bit
        assert [output_bits(o) for o in again] == [output_bits(o) for o in first]
        assert [output_bits(o) for o in uncached] == [output_bits(o) for o in first]


@pytest.mark.parametrize("name", MODELS)
def test_prefix_hits_past_the_window_and_chunks_give_the_same_bits(name, models):
    """A prompt extending a cached sequence by a few tokens (the hit covers several windows),
    prefilled whole or in chunks of 5 across window boundaries, decodes to the bits a run
    without any cache gives."""
    path, prompts = models[name], _prompts(name)
    base = prompts[2][:-4]
    longer = [base + prompts[0][-4:], prompts[2]]
    with _engine(path, "auto") as eng:
        eng.generate(input_ids=[base], sampling_params=GREEDY)
        hits = eng.generate(input_ids=longer, sampling_params=GREEDY)
        assert all(o.cached_tokens >= len(base) - 1 for o in hits)
        assert min(o.cached_tokens for o in hits) > 12  # longer than the window
    with _engine(path, "auto", disable_radix_cache=True, chunked_prefill_size=5) as eng:
        chunked = eng.generate(input_ids=longer, sampling_params=GREEDY)
    assert [output_bits(o) for o in hits] == [output_bits(o) for o in chunked]
    _assert_transformers(name, path, longer, hits)


@pytest.mark.parametrize("name", MODELS)
def test_each_family_setting_changes_the_outputs(name, models):
    """transformers without one of the model's settings (a window, a soft-cap, the attention
    scale, a kind of layer's RoPE, the partial rotation, longrope) continues the prompts
    otherwise, or gives their tokens logprobs 1e-3 away (the final soft-cap keeps the argmax):
    the tests above would catch a runtime ignoring it."""
    path, prompts = models[name], _prompts(name)
    want = []
    for prompt in prompts:  # transformers' own greedy continuation
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW):
                ids.append(int(_hf_model(path)(torch.tensor([ids])).logits[0, -1].argmax()))
        want.append(ids[len(prompt) :])
    lps = [_hf_greedy_and_logprobs(_hf_model(path), p, o)[1] for p, o in zip(prompts, want)]
    for change in DROPPED[name]:
        without = [
            _hf_greedy_and_logprobs(_hf_model(path, change), p, o) for p, o in zip(prompts, want)
        ]
        moved = max((lp - w[1]).abs().max().item() for lp, w in zip(lps, without))
        assert [w[0] for w in without] != want or moved > 1e-3, f"{name} without {change}"


def test_longrope_serves_its_original_context_and_says_why(models, caplog):
    path = models["phi3 longrope"]
    with caplog.at_level(logging.INFO, logger="radixrt.model.runner"):
        eng = _engine(path, "auto")
    with eng:
        assert eng.runner.max_context == 48
        logged = [r.getMessage() for r in caplog.records]
        assert any("context: 48 tokens" in m and "long_factor" in m for m in logged), logged
        with pytest.raises(ValueError, match="the context is 48 tokens"):
            eng.generate(input_ids=[list(range(3, 51))], sampling_params=GREEDY)
        prompt = torch.randint(3, 2048, (40,), generator=torch.Generator().manual_seed(1)).tolist()
        out = eng.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
        assert len(prompt) + len(out.token_ids) == 48  # stopped at the context's end
        greedy, _ = _hf_greedy_and_logprobs(_hf_model(path), prompt, out.token_ids)
        assert out.token_ids == greedy
