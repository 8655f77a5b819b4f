"""The decode chain (``radixrt.model.decode_chain``): small decode batches run as one C call per
layer and give the layer-by-layer forward's logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear

PROMPTS = [
    "The same long system prompt for everyone. Then question one?",
    "The same long system prompt for everyone. Then another question?",
    "Something else entirely, and a little longer than the others.",
    "Short.",
]


def chain_kernels() -> list[str]:
    lib = cpu_library.load(cache_dir())
    return [k for k in cpu_chain.KERNELS if cpu_linear.kernel_available(lib, k)]


@pytest.fixture(params=["avx512_bf16", "fma"])
def kernel(request) -> str:
    if request.param not in chain_kernels():
        pytest.skip(f"the {request.param} linear kernel does not run here")
    return request.param


def run(path: str, kernel: str, chain: bool, prompts=PROMPTS, new: int = 12):
    """((each output's tokens, logprobs and top logprobs, two continuations' scores), the
    forwards the chain ran by mode)."""
    with Engine(
        model=path,
        dtype="bfloat16",
        max_total_tokens=1024,
        linear_kernel=kernel,
        disable_decode_chain=not chain,
    ) as eng:
        runner = eng.runner
        assert (runner.decode_chain is not None) == chain, runner.decode_chain_info
        calls = []
        if chain:  # count the forwards the chain ran
            logits = runner.decode_chain.logits
            runner.decode_chain.logits = lambda batch: (
                calls.append(batch.mode.value) or logits(batch)
            )
        sp = SamplingParams(
            max_new_tokens=new, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
        )
        outs = eng.generate(prompts, sp)
        # one request alone (rows 1 get chains of their own), its prompt cached
        outs += eng.generate(prompts[:1], sp)
        # continuations scored after a cached prefix: extends of a few tokens, logits at each
        scores = eng.score(outs[0].token_ids, [outs[1].token_ids[:5], outs[2].token_ids[:7]])
        eng.check_memory()
        got = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
        return (got, scores), {mode: calls.count(mode) for mode in ("extend", "decode")}


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_the_chain_gives_the_layer_by_layer_logits(model: str, kernel: str, request) -> None:
    """Greedy tokens and their logprobs (from the logits) equal, and the chain ran every decode
    step and the small extend (tiny llama: rotary as a step of its own; qwen2: with a qkv bias;
    qwen3: q and k normed per head, in place)."""
    path = request.getfixturevalue(model)
    chained, steps = run(path, kernel, True)
    plain, _ = run(path, kernel, False)
    assert chained == plain
    assert steps["decode"] == 2 * 11  # 11 decode steps after each of the two prefills
    assert steps["extend"] >= 2  # the scored continuations' extends, at least


def test_the_chain_stays_off_where_it_does_not_apply(tiny_llama: str) -> None:
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=256, linear_kernel="torch"
    ) as eng:
        assert eng.runner.decode_chain is None
        assert "do not all run packed weights" in eng.runner.decode_chain_info
    with Engine(model=tiny_llama, dtype="float32", max_total_tokens=256) as eng:
        assert eng.runner.decode_chain is None
        assert eng.runner.decode_chain_info.startswith("off: ")
    if "fma" in chain_kernels():
        with Engine(
            model=tiny_llama,
            dtype="bfloat16",
            max_total_tokens=256,
            attention_backend="torch",
            linear_kernel="fma",
        ) as eng:
            assert "CPU kernel's on a bf16 pool" in eng.runner.decode_chain_info


def test_batches_beyond_the_chains_rows_run_layer_by_layer(tiny_llama: str) -> None:
    if "fma" not in chain_kernels():
        pytest.skip("the fma linear kernel does not run here")
    prompts = [f"prompt number {i} says hello" for i in range(6)]
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=1024, linear_kernel="fma"
    ) as eng:
        chain = eng.runner.decode_chain
        chain.max_rows = 4  # smaller than the batch: these decode steps run layer by layer
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in eng.generate(prompts, sp)]
        assert not chain.plans
    with Engine(
        model=tiny_llama,
        dtype="bfloat16",
        max_total_tokens=1024,
        linear_kernel="fma",
        disable_decode_chain=True,
    ) as eng:
        assert got == [o.token_ids for o in eng.generate(prompts, sp)]
    assert torch.get_num_threads() >= 1
