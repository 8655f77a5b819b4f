"""The offline Engine against Hugging Face transformers, greedy, in float32."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from radixrt import SamplingParams
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library as cpu_library

SYSTEM = "You are a careful assistant. Answer the question about the standard library. "
QUESTIONS = [
    "What does os.path.join do?",
    "How is a dict ordered?",
    "Explain functools.partial.",
    "What is a generator?",
    "Why use pathlib?",
    "What does zip return?",
    "How does sorted handle keys?",
    "What is an iterator protocol?",
]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
NEW = 24
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


@functools.cache
def hf_greedy(path: str, prompts: tuple[str, ...], new: int) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never suppress
    outs = []
    for p in prompts:  # one at a time: no padding effects in the reference
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        outs.append(tuple(gen[0, ids.shape[1] :].tolist()))
    return tuple(outs)


def ids_of(outs) -> list[tuple[int, ...]]:
    return [tuple(o.token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_and_reuses_prefix(arch, engine_factory, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    want = list(hf_greedy(path, tuple(PROMPTS), NEW))
    assert len({t for o in want for t in o}) > 8, "reference continuation is degenerate"
    eng = engine_factory(path)
    if cpu_library.compiler():  # attention and elementwise ops run in C
        assert eng.runner.attn_backend.name == "cpu", cpu_library.why_unavailable()
    first = eng.generate(PROMPTS, GREEDY)
    assert ids_of(first) == want
    assert sum(o.cached_tokens for o in first) > 0, "shared system prompt was not reused in-batch"
    again = eng.generate(PROMPTS, GREEDY)
    assert ids_of(again) == want
    assert all(o.cached_tokens >= o.prompt_tokens - 1 for o in again)
    eng.check_memory()


def test_greedy_without_the_cpu_kernels(tiny_llama, engine_factory, monkeypatch):
    """PyTorch's ops (the fallback without a C compiler) give the same ids."""
    monkeypatch.setattr(cpu_library, "_tried", True)
    monkeypatch.setattr(cpu_library, "_lib", None)
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS), NEW))
    eng = engine_factory(tiny_llama)
    assert eng.runner.attn_backend.name == "torch" and eng.runner.kernels.norm.name == "torch"
    assert ids_of(eng.generate(PROMPTS, GREEDY)) == want
    assert ids_of(eng.generate(PROMPTS, GREEDY)) == want  # decode over cached prefixes


def _with_head_dim_64(path: str, folder) -> str:
    """The tiny model (hidden 256, 8 heads of 32) read as 4 heads of 64 and 2 KV heads: the same
    weight shapes, a head size the AMX kernel rotates in the qkv linear's own pass."""
    import json

    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_attention_heads=4, num_key_value_heads=2)
    if "head_dim" in cfg:
        cfg["head_dim"] = 64
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize("model", ["llama", "llama, head dim 64", "qwen2 (qkv bias), head dim 64"])
def test_bf16_amx_linears_give_pytorchs_ids(model, engine_factory, monkeypatch, request, tmp_path):
    """bf16 greedy through the AMX linear kernel (radixrt_kernels.cpu.linear: SiLU-and-mul fused
    into the MLP's gate/up pass, and with heads of 64 the rotary embedding into the qkv pass)
    equals bf16 greedy through PyTorch's own linears and the separate steps: one request at a
    time, so no forward has over 32 rows, where the kernel adds the products in oneDNN's order
    (bit-equal logits)."""
    from radixrt.model import runner
    from radixrt.model.kernel_set import CRMSNorm, CRotary, CSiluMul, Kernels
    from radixrt_kernels.cpu import linear as cpu_linear

    if not cpu_linear.available(cpu_library.load(cache_dir())):
        pytest.skip("no AMX linear kernel on this CPU")
    path = request.getfixturevalue(f"tiny_{model.split()[0].rstrip(',')}")
    if "head dim 64" in model:
        path = _with_head_dim_64(path, tmp_path / "hd64")
    requests = [[(7 * i + 13 * j) % 500 + 20 for j in range(20 + i)] for i in range(4)]
    eng = engine_factory(path, dtype="bfloat16", linear_kernel="amx")
    attn = eng.runner.model.model.layers[0].self_attn
    assert attn.o_proj.method.name == "amx"
    fused_rope = attn.qkv_proj.method.name == "amx + rotary"
    assert fused_rope == ("head dim 64" in model) and attn.head_dim == (64 if fused_rope else 32)
    assert eng.runner.model.model.layers[0].mlp.gate_up_proj.method.name == "amx + silu_mul"
    got = [eng.generate(input_ids=[ids], sampling_params=GREEDY)[0].token_ids for ids in requests]
    lib = cpu_library.load(cache_dir())  # PyTorch's linears, the C library's separate steps
    monkeypatch.setattr(
        runner,
        "choose_kernels",
        lambda *args, **kw: Kernels(norm=CRMSNorm(lib), rotary=CRotary(lib), act=CSiluMul(lib)),
    )
    plain = engine_factory(path, dtype="bfloat16")
    assert plain.runner.model.lm_head.method.name == "torch"
    want = [
        plain.generate(input_ids=[ids], sampling_params=GREEDY)[0].token_ids for ids in requests
    ]
    assert got == want
    assert len({tuple(ids) for ids in got}) == len(requests) and all(
        len(set(ids)) > 3 for ids in got
    )


@pytest.mark.parametrize("kernel", ["fma", "avx512_bf16", "torch_fp32"])
def test_bf16_linear_paths_agree(kernel, tiny_llama, engine_factory):
    """Every bf16 linear path computes float32 sums rounded once to bf16: through the whole model
    the first token and its logprob agree with PyTorch's bf16 linears (not bit for bit: the sums
    are added in other orders)."""
    from radixrt_kernels.cpu import linear as cpu_linear

    lib = cpu_library.load(cache_dir())
    if kernel in cpu_linear.KERNELS and not cpu_linear.kernel_available(lib, kernel):
        pytest.skip(f"the {kernel} linear kernel does not run here")
    sp = SamplingParams(max_new_tokens=1, temperature=0, logprobs=True, top_logprobs=2)
    requests = [[(7 * i + 13 * j) % 500 + 20 for j in range(20 + 9 * i)] for i in range(4)]
    outs = {}
    for path in (kernel, "torch"):
        eng = engine_factory(
            tiny_llama, dtype="bfloat16", linear_kernel=path, disable_deterministic_inference=True
        )
        assert eng.runner.model.model.layers[0].self_attn.o_proj.method.name == path
        outs[path] = eng.generate(input_ids=requests, sampling_params=sp)
    for got, want in zip(outs[kernel], outs["torch"]):
        assert abs(got.logprobs[0] - want.logprobs[0]) < 0.25  # bf16 activations, layer by layer
        if got.token_ids != want.token_ids:  # only a near tie may go the other way
            (ids, logprobs) = want.top_logprobs[0]
            assert set(got.top_logprobs[0][0]) == set(ids), (got.top_logprobs, want.top_logprobs)
            assert logprobs[0] - logprobs[1] < 0.1, want.top_logprobs


def test_disable_radix_cache_same_ids(tiny_llama, engine_factory):
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS), NEW))
    eng = engine_factory(tiny_llama, disable_radix_cache=True)
    outs = eng.generate(PROMPTS, GREEDY)
    assert ids_of(outs) == want
    assert all(o.cached_tokens == 0 for o in outs)
    assert eng.stats()["prefill_tokens"] == sum(o.prompt_tokens for o in outs)


def test_retraction_under_tiny_pool(tiny_llama, engine_factory):
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS), NEW))
    demand = sum(len(w) for w in want) + sum(
        o.prompt_tokens for o in engine_factory(tiny_llama).generate(PROMPTS, GREEDY)
    )
    eng = engine_factory(tiny_llama, max_total_tokens=demand // 4)
    outs = eng.generate(PROMPTS, GREEDY)
    assert ids_of(outs) == want
    stats = eng.stats()
    assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0
    eng.check_memory()


def test_chunked_prefill_same_ids(tiny_llama, engine_factory):
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS), NEW))
    eng = engine_factory(tiny_llama, chunked_prefill_size=8)
    assert ids_of(eng.generate(PROMPTS, GREEDY)) == want
    stats = eng.stats()
    assert stats["prefill_chunks"] > 0
    assert stats["prefill_steps"] >= stats["prefill_tokens"] / 8


def test_page_size_16_same_ids(tiny_llama, engine_factory):
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS), NEW))
    eng = engine_factory(tiny_llama, page_size=16)
    assert ids_of(eng.generate(PROMPTS, GREEDY)) == want
    again = eng.generate(PROMPTS, GREEDY)
    assert ids_of(again) == want
    assert all(o.cached_tokens > 0 and o.cached_tokens % 16 == 0 for o in again)


@pytest.mark.parametrize("policy", ["fcfs", "dfs-weight"])
def test_policies_same_ids(policy, tiny_llama, engine_factory):
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS), NEW))
    eng = engine_factory(tiny_llama, schedule_policy=policy)
    assert ids_of(eng.generate(PROMPTS, GREEDY)) == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run(dtype, tiny_llama, engine_factory):
    # The tiny model's random weights leave near-ties that half precision flips,
    # so equality is checked in float32 (above) and on SmolLM2; here: it runs and caches.
    eng = engine_factory(tiny_llama, dtype=dtype)
    assert eng.runner.dtype == getattr(torch, dtype)
    assert eng.runner.pool.k_buffers[0].dtype == getattr(torch, dtype)
    outs = eng.generate(PROMPTS[:4], GREEDY)
    assert all(len(o.token_ids) == NEW for o in outs)
    again = eng.generate(PROMPTS[:4], GREEDY)
    assert all(o.cached_tokens >= o.prompt_tokens - 1 for o in again)


def test_mistral_folder_loads_as_llama(tiny_llama, tmp_path, engine_factory):
    import json
    import shutil

    folder = tmp_path / "mistral"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=128)
    (folder / "config.json").write_text(json.dumps(cfg))
    eng = engine_factory(str(folder))
    assert eng.model_config.architecture == "mistral" and eng.runner.max_context == 2048
    assert eng.model_config.layer_windows == (128,) * 4  # the prompts fit in the window
    want = list(hf_greedy(tiny_llama, tuple(PROMPTS[:2]), NEW))
    assert ids_of(eng.generate(PROMPTS[:2], GREEDY)) == want


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_compile_same_ids(arch, engine_factory, request):
    # One graph from embedding to logits; attention runs as the radixrt::attention op over the
    # step's batch: extend with in-batch sharing, extend over a cached prefix, and decode.
    path = request.getfixturevalue(f"tiny_{arch}")
    want = list(hf_greedy(path, tuple(PROMPTS), NEW))
    from torch._dynamo.utils import counters

    eng = engine_factory(path, enable_torch_compile=True, disable_deterministic_inference=True)
    assert eng.runner.model.compiled is not None
    graphs = counters["stats"]["unique_graphs"]  # compiled at start-up, none while serving
    assert ids_of(eng.generate(PROMPTS, GREEDY)) == want
    again = eng.generate(PROMPTS, GREEDY)
    assert ids_of(again) == want
    assert all(o.cached_tokens >= o.prompt_tokens - 1 for o in again)
    assert ids_of(eng.generate(PROMPTS[:1], GREEDY)) == want[:1]  # a batch of one
    assert counters["stats"]["unique_graphs"] == graphs
    eng.check_memory()
