"""The decode chain (``radixrt.model.decode_chain``): the model's decoder layers captured and
replayed as one C call give the layer-by-layer forward's logits bit for bit; a body it cannot
replay is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.model.calibrate import THRESHOLD
from radixrt.model.decode_chain import decode_chain_for
from radixrt.model.layers import RMSNorm
from radixrt.model.llama import LlamaDecoderLayer
from radixrt.model.weights import cache_dir
from radixrt.quant.gguf_writer import write_gguf
from radixrt.testing import tiny_model_path
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear
from radixrt_kernels.cpu.capture import small_side

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


def run(path: str, kernel: str, chain: bool, prompts=PROMPTS, new: int = 12, info=None):
    """((each output's tokens, logprobs and top logprobs, two continuations' scores), the
    forwards the chain ran by mode); ``info``: a list that receives the chain's description."""
    with Engine(
        model=path,
        dtype="bfloat16",
        max_total_tokens=1024,
        linear_kernel=kernel,
        disable_decode_chain=not chain,
    ) as eng:
        runner = eng.runner
        assert (runner.decode_chain is not None) == chain, runner.decode_chain_info
        if info is not None:
            info.append(runner.decode_chain_info)
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


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen2", "Q4_K")])
def test_a_gguf_model_s_chain_gives_the_layer_by_layer_logits(tmp_path, arch, qtype) -> None:
    """Quantized linears (every decode-sized path: the one this CPU runs) and SiLU-and-mul as
    steps of their own: tokens, logprobs and scores equal the layer-by-layer forward's bit for
    bit (qwen2: a bf16 qkv bias; Q4_K: the tiny model's 64-wide rows fall back to Q5_0, so a
    stacked weight may mix types)."""
    if not chain_kernels() and cpu_library.load(cache_dir()) is None:
        pytest.skip("no kernels' library")
    gguf = write_gguf(tiny_model_path(arch), tmp_path / "m.gguf", qtype)
    info: list[str] = []
    chained, steps = run(gguf, "auto", True, info=info)
    plain, _ = run(gguf, "auto", False)
    assert chained == plain
    assert qtype in info[0] or (qtype == "Q4_K" and "Q5_0" in info[0]), info
    assert steps["decode"] == 2 * 11 and steps["extend"] >= 2


def test_the_chain_stays_off_where_it_does_not_apply(tiny_llama: str) -> None:
    with Engine(
        model=tiny_llama,
        dtype="bfloat16",
        max_total_tokens=256,
        linear_kernel="torch",
        disable_deterministic_inference=True,
    ) as eng:
        assert eng.runner.decode_chain is None
        info = eng.runner.decode_chain_info  # PyTorch's linear: named, with where it ran
        assert info.startswith("off: linear at linear_methods.py"), info
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
            disable_deterministic_inference=True,
        ) as eng:
            assert "attention is not the CPU kernel's" in eng.runner.decode_chain_info


def test_batches_beyond_the_chains_rows_run_layer_by_layer(tiny_llama: str) -> None:
    if "fma" not in chain_kernels():
        pytest.skip("the fma linear kernel does not run here")
    prompts = [f"prompt number {i} says hello" for i in range(6)]
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=1024, linear_kernel="fma"
    ) as eng:
        chain = eng.runner.decode_chain
        chain.max_rows = 4  # smaller than the batch: these decode steps run layer by layer
        captured = set(chain.plans)
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in eng.generate(prompts, sp)]
        assert set(chain.plans) == captured
    with Engine(
        model=tiny_llama,
        dtype="bfloat16",
        max_total_tokens=1024,
        linear_kernel="fma",
        disable_decode_chain=True,
    ) as eng:
        assert got == [o.token_ids for o in eng.generate(prompts, sp)]
    assert torch.get_num_threads() >= 1


class ScaledResidual(LlamaDecoderLayer):
    """A decoder step written in PyTorch: a chain has no kernel for it."""

    def forward(self, positions, h, residual, batch):
        h, residual = super().forward(positions, h, residual, batch)
        return h * 0.5, residual


class PostNorm(LlamaDecoderLayer):
    """A decoder step on the model's own kernel objects (a norm of the MLP's output, as
    Gemma's post-feedforward norm): the chain runs it with no change of its own."""

    def forward(self, positions, h, residual, batch):
        h, residual = super().forward(positions, h, residual, batch)
        return self.post_norm(h), residual


def greedy(eng: Engine) -> list:
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    return [(o.token_ids, o.logprobs) for o in eng.generate(PROMPTS, sp)]


def test_a_new_decoder_step_runs_in_the_chain_or_is_refused_by_name(tiny_llama: str) -> None:
    kernels = chain_kernels()
    if not kernels:
        pytest.skip("no linear kernel a chain runs works here")
    lib = cpu_library.load(cache_dir())
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=1024, linear_kernel=kernels[0]
    ) as eng:
        runner = eng.runner
        model, layers = runner.model, runner.model.model.layers
        for layer in layers:
            layer.__class__ = ScaledResidual
        chain, info = decode_chain_for(model, runner.attn_backend, lib)
        assert chain is None
        assert info.startswith("off: ") and "mul at test_decode_chain.py" in info, info

        hidden, gen = model.config.hidden_size, torch.Generator().manual_seed(0)
        for layer in layers:
            layer.__class__ = PostNorm
            layer.post_norm = RMSNorm(hidden, 1e-6, runner.kernels)
            weight = 1 + 0.5 * torch.randn(hidden, generator=gen)
            layer.post_norm.weight.data = weight.bfloat16()
        runner.decode_chain, info = decode_chain_for(model, runner.attn_backend, lib)
        assert runner.decode_chain is not None, info
        steps = len(runner.decode_chain.plans[-1].chain.steps)
        ran, logits = [], runner.decode_chain.logits
        runner.decode_chain.logits = lambda batch: ran.append(batch.mode) or logits(batch)
        chained = greedy(eng)
        assert len(ran) >= 6  # the forwards ran as chains
        runner.decode_chain = None
        eng.flush_cache()
        assert greedy(eng) == chained
    # one more norm step per layer than the plain model's chain
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=1024, linear_kernel=kernels[0]
    ) as eng:
        plain = eng.runner.decode_chain.plans[-1]
        assert steps == len(plain.chain.steps) + len(layers)


LONG_PROMPTS = [
    " ".join(f"w{(i + 2) * j % 97}" for j in range(n)) for i, n in enumerate((40, 90, 150))
]


def test_prefill_steps_run_in_the_chain_one_capture_per_class(tiny_llama: str, kernel) -> None:
    """Extends above the decode-sized rows (a prompt alone, several together, a prefill beside
    decode rows) replay too, with the layer-by-layer logits; the row counts of one class share
    one capture."""
    chained_prefills_equal(tiny_llama, kernel, classes=2)


def test_a_gguf_model_s_prefill_steps_run_in_the_chain(tmp_path) -> None:
    """Quantized linears whose path changes with the row count: a class per path choice."""
    if cpu_library.load(cache_dir()) is None:
        pytest.skip("no kernels' library")
    gguf = write_gguf(tiny_model_path("llama"), tmp_path / "m.gguf", "Q4_1")
    chained_prefills_equal(str(gguf), "auto", classes=None)


def chained_prefills_equal(model: str, kernel: str, classes: int | None) -> None:
    """Greedy tokens and logprobs with the chain equal those without, prefill steps of more than
    THRESHOLD tokens ran in it, and (``classes``) it holds at most that many captures."""
    prompts = LONG_PROMPTS + [p + " and more" for p in LONG_PROMPTS]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)

    def outputs(eng: Engine) -> list:
        got = eng.generate(prompts[:1], sp)  # a prompt alone
        got += eng.generate(prompts[1:], sp)  # the rest together
        return [(o.token_ids, o.logprobs) for o in got]

    config = dict(
        model=model,
        dtype="bfloat16",
        max_total_tokens=2048,
        linear_kernel=kernel,
        chunked_prefill_size=160,
    )
    with Engine(**config) as eng:
        chain = eng.runner.decode_chain
        assert chain.describe().endswith(f"forwards of up to {chain.max_rows} tokens")
        rows, logits = [], chain.logits
        chain.logits = lambda batch: rows.append(batch.input_ids.shape[0]) or logits(batch)
        chained = outputs(eng)
        eng.check_memory()
        assert len({m for m in rows if m > THRESHOLD}) >= 2, str(rows)
        assert classes is None or len(chain.plans) <= classes
    with Engine(**config, disable_decode_chain=True) as eng:
        assert outputs(eng) == chained
        eng.check_memory()


class LargeInPyTorch(LlamaDecoderLayer):
    """A decoder step that, above THRESHOLD rows, computes on PyTorch's kernels (as a kernel
    without a chain step would, the AMX linear): that class is refused, the smaller one runs."""

    def forward(self, positions, h, residual, batch):
        h, residual = super().forward(positions, h, residual, batch)
        if not small_side(h.shape[0], THRESHOLD):
            h = h * 1.0
        return h, residual


def test_a_class_the_chain_refuses_runs_layer_by_layer(tiny_llama: str) -> None:
    kernels = chain_kernels()
    if not kernels:
        pytest.skip("no linear kernel a chain runs works here")
    lib = cpu_library.load(cache_dir())
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=2048, linear_kernel=kernels[0]
    ) as eng:
        runner = eng.runner
        for layer in runner.model.model.layers:
            layer.__class__ = LargeInPyTorch
        chain, info = decode_chain_for(runner.model, runner.attn_backend, lib)
        assert info.endswith(f"forwards of up to {THRESHOLD} tokens"), info
        refused = [why for low, _, why in chain.classes if low > THRESHOLD]
        assert refused and "mul at test_decode_chain.py" in refused[0], chain.classes
        runner.decode_chain = chain
        rows, logits = [], chain.logits
        chain.logits = lambda batch: rows.append(batch.input_ids.shape[0]) or logits(batch)
        chained = [(o.token_ids, o.logprobs) for o in eng.generate(LONG_PROMPTS, sp)]
        assert rows and max(rows) <= THRESHOLD  # the prefill ran layer by layer
        runner.decode_chain = None
        eng.flush_cache()
        assert [(o.token_ids, o.logprobs) for o in eng.generate(LONG_PROMPTS, sp)] == chained
