"""A row's linear results do not depend on the rows beside it: the same bits whether the row is
computed alone or among 1..700 others. Per kernel (each packed bf16 kernel, the float32 kernel,
also as built for narrower CPUs) and, in exact mode, per layer as ``choose_kernels`` builds it:
every row count runs one path, whatever the calibration picked (the per-linear half of exact
outputs)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from radixrt.model import calibrate
from radixrt.model.calibrate import Choice
from radixrt.model.kernel_set import Kernels, NotExact, choose_kernels
from radixrt.model.layers import (
    GateUpLinear,
    Linear,
    LMHead,
    RotaryEmbedding,
    RotaryQKVLinear,
    prepare_weights,
)
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library
from radixrt_kernels.cpu import linear as cpu_linear

CPU = torch.device("cpu")
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 31, 32, 33, 47, 48, 49, 64, 65, 100, 128, 257, 700]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_rows_invariant(run: Callable[[slice], torch.Tensor], rows: list[int] = ROWS) -> None:
    """``run(rows)`` (the results of the rows a slice picks) gives each row the bits it has
    alone, for the first r rows, every r in ``rows``."""
    alone = torch.cat([run(slice(i, i + 1)) for i in range(max(rows))])
    for r in rows:
        assert torch.equal(bits(run(slice(0, r))), bits(alone[:r])), r


def loaded():
    lib = library.load(cache_dir())
    if lib is None:
        pytest.skip(f"no CPU kernels' library: {library.why_unavailable()}")
    return lib


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16", "fma"])
@pytest.mark.parametrize("gated", [False, True])
def test_a_rows_bits_do_not_depend_on_its_batch(kernel: str, gated: bool) -> None:
    lib = library.load(cache_dir())
    if not cpu_linear.kernel_available(lib, kernel):
        pytest.skip(f"the {kernel} linear kernel does not run here")
    check_rows(lib, kernel, gated)


@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx"]])
def test_the_fma_kernel_of_narrow_builds_too(flags: list[str], monkeypatch, tmp_path) -> None:
    """As built for CPUs without AVX-512 (8 lanes) or without AVX (4 lanes)."""
    lib = narrow_build(flags, monkeypatch, tmp_path)
    if not cpu_linear.kernel_available(lib, "fma"):
        pytest.skip("this CPU does not run that build's fma kernel")
    for gated in (False, True):
        check_rows(lib, "fma", gated)


def narrow_build(flags: list[str], monkeypatch, tmp_path):
    monkeypatch.setattr(library, "CFLAGS", [*library.CFLAGS, *flags])
    try:
        return library._build_and_load(tmp_path)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"this compiler does not build the library with {flags}: {e}")


def check_rows(lib, kernel: str, gated: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 192, 160
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(max(ROWS), k, generator=gen).bfloat16()
    packed = cpu_linear.pack(lib, w, gated=gated)
    assert_rows_invariant(
        lambda rows: cpu_linear.linear(lib, x[rows], packed, n, gated=gated, kernel=kernel)
    )


# ---- the fma kernel is the float32 kernel on bf16 weights ---------------------------------

FMA_ROWS = [*range(1, 9), 13, 31, 32, 33, 63, 64, 65, 66, 67, 68, 69, 70, 71, 97, 130, 257, 512,
            700, 2048]  # fmt: skip


def f32_linear(lib, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """x · wᵀ (+ bias) by the float32 kernel on the bf16 values as float32, rounded to bf16."""
    b = None if bias is None else bias.float()
    out = cpu_linear.linear_f32(lib, x.float(), cpu_linear.pack_f32(w.float()), w.shape[0], b)
    return out.bfloat16()


def fma_cases(lib, x: torch.Tensor, positions: torch.Tensor, gen: torch.Generator) -> dict:
    """name: (run(rows) -> the fma kernel's output for x[rows], the same by the float32 kernel
    and the separate epilogue calls for all of x). 520 features with a bias: 17 blocks, the
    last one short; [gate; up] of 160 + 160; qkv of 5 heads of 128, 4 of them rotated."""
    from radixrt_kernels.cpu import elementwise

    half = x.shape[1] // 2

    def weight(n: int) -> torch.Tensor:  # w[:, half + i] nearly -w[:, i] (see x)
        h = torch.randn(n, half, generator=gen) * 0.05
        return torch.cat([h, 0.002 * torch.randn(n, half, generator=gen) - h], 1).bfloat16()

    w = {n: weight(n) for n in (520, 320, 640)}
    bias = {n: torch.randn(n, generator=gen).bfloat16() for n in (520, 640)}
    packed = {n: cpu_linear.pack(lib, w[n], gated=n == 320) for n in w}
    rotary = RotaryEmbedding(128, 4096, 10000.0)

    def rope(rows: slice) -> cpu_linear.Rope:
        return cpu_linear.Rope(positions[rows], rotary.cos, rotary.sin_signed, 128, 512)

    rotated = f32_linear(lib, x, w[640], bias[640])
    heads = rotated[:, :512].view(len(x), 4, 128)
    elementwise.rope_(lib, heads, positions, rotary.cos, rotary.sin_signed)
    fma = dict(kernel="fma")
    return {
        "plain": (
            lambda r: cpu_linear.linear(lib, x[r], packed[520], 520, bias[520], **fma),
            f32_linear(lib, x, w[520], bias[520]),
        ),
        "gated": (
            lambda r: cpu_linear.linear(lib, x[r], packed[320], 320, gated=True, **fma),
            elementwise.silu_mul(lib, f32_linear(lib, x, w[320])),
        ),
        "rotary": (
            lambda r: cpu_linear.linear(
                lib, x[r], packed[640], 640, bias[640], rope=rope(r), **fma
            ),
            rotated,
        ),
    }


@pytest.mark.parametrize(
    "flags", [[], ["-mno-avx512f"], ["-mno-avx"]], ids=["native", "no-avx512f", "no-avx"]
)
def test_the_fma_kernel_gives_the_float32_kernels_bits(flags: list[str], monkeypatch, tmp_path):
    """Each output of the fma kernel is one chain over the input features in order from 0, then
    the bias and one rounding to bf16: the float32 kernel's bits on the same weights, then the
    separate SiLU-and-mul and rotary calls, for every row count (its decode-sized and its
    prefill-sized paths: the native build, and as built without AVX-512 or without AVX)."""
    lib = narrow_build(flags, monkeypatch, tmp_path) if flags else loaded()
    if not cpu_linear.kernel_available(lib, "fma"):
        pytest.skip("this CPU does not run that build's fma kernel")
    gen = torch.Generator().manual_seed(7)
    # 544 input features (17 chunks: the widened path's segments of 256 and a short last one),
    # x[:, 272 + i] = x[:, i]: with fma_cases' weights each sum cancels to a small part of its
    # terms, so an error of a float32 rounding in the chain moves its bf16 result often
    half = torch.randn(max(FMA_ROWS), 272, generator=gen).bfloat16()
    x = torch.cat([half, half], 1)
    positions = torch.randint(0, 4096, (len(x),), generator=gen)
    for name, (run, want) in fma_cases(lib, x, positions, gen).items():
        for rows in FMA_ROWS:
            got = run(slice(0, rows))
            assert torch.equal(bits(got), bits(want[:rows])), (name, rows)


# ---- the float32 kernel --------------------------------------------------------------------

F32_SHAPES = [(192, 160), (100, 77), (576, 576), (70, 1)]  # (n, k): K any width, N any height


def check_f32_rows(lib, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(max(ROWS), k, generator=gen)
    packed = cpu_linear.pack_f32(w)
    for b in (None, bias):
        assert_rows_invariant(lambda rows, b=b: cpu_linear.linear_f32(lib, x[rows], packed, n, b))
    got = cpu_linear.linear_f32(lib, x[:65], packed, n, bias)  # and it is the linear
    want = torch.nn.functional.linear(x[:65].double(), w.double(), bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * k)  # float32 sums


@pytest.mark.parametrize("n,k", F32_SHAPES)
def test_the_float32_kernel_gives_a_row_its_own_bits(n: int, k: int) -> None:
    check_f32_rows(loaded(), n, k)


@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx"]])
def test_the_float32_kernel_of_narrow_builds_too(flags: list[str], monkeypatch, tmp_path) -> None:
    """Row-invariant as built without AVX-512 or without AVX; without AVX-512 (FMA still
    there) the same chains as the native build, bit for bit."""
    native = loaded()
    lib = narrow_build(flags, monkeypatch, tmp_path)
    for n, k in F32_SHAPES[:2]:
        check_f32_rows(lib, n, k)
    if flags == ["-mno-avx512f"]:
        w, x = torch.randn(100, 77), torch.randn(30, 77)
        packed = cpu_linear.pack_f32(w)
        got, want = (cpu_linear.linear_f32(L, x, packed, 100) for L in (lib, native))
        assert torch.equal(bits(got), bits(want))


def test_the_float32_kernel_adds_one_fma_chain_per_output_in_feature_order() -> None:
    """Each output is fma(x[K-1], w[K-1], ... fma(x[0], w[0], 0)), then + bias: the same
    chain for every row, whatever the register block or thread it lands in."""
    with open("/proc/cpuinfo") as f:
        if " fma" not in f.read():
            pytest.skip("a CPU without FMA: the kernel multiplies and adds")
    lib = loaded()
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 200
    w, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(9, k)
    got = cpu_linear.linear_f32(lib, x, cpu_linear.pack_f32(w), n, bias)
    xd, wd = x.double().numpy(), w.double().numpy()
    acc = np.zeros((9, n), dtype=np.float32)
    for i in range(k):  # x·w is exact in float64, so one rounding to float32 per step
        acc = (xd[:, i : i + 1] * wd[None, :, i] + acc.astype(np.float64)).astype(np.float32)
    want = torch.from_numpy(acc) + bias
    assert torch.equal(bits(got), bits(want))


def test_the_float32_kernel_refuses_what_it_does_not_take() -> None:
    lib = loaded()
    packed = cpu_linear.pack_f32(torch.randn(64, 32))
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.linear_f32(lib, torch.randn(2, 32).bfloat16(), packed, 64)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear_f32(lib, torch.randn(2, 48), packed, 64)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.pack_f32(torch.randn(64, 32).bfloat16())


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16", "fma", "f32"])
def test_a_rows_bits_do_not_depend_on_the_thread_count(kernel: str) -> None:
    """Threads split the output features, each output computed whole by one thread: replicas
    with other thread counts (the exact calibration's file leaves the count out) agree."""
    lib = loaded()
    if kernel != "f32" and not cpu_linear.kernel_available(lib, kernel):
        pytest.skip(f"the {kernel} linear kernel does not run here")
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(320, 192, generator=gen), torch.randn(130, 192, generator=gen)
    if kernel == "f32":
        packed = cpu_linear.pack_f32(w)
        run = lambda rows: cpu_linear.linear_f32(lib, x[:rows], packed, 320)  # noqa: E731
    else:
        packed, x = cpu_linear.pack(lib, w.bfloat16()), x.bfloat16()
        run = lambda rows: cpu_linear.linear(lib, x[:rows], packed, 320, kernel=kernel)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        got = {}
        for t in (1, 2, 3, 5):
            torch.set_num_threads(t)
            got[t] = [run(rows) for rows in (1, 13, 130)]
    finally:
        torch.set_num_threads(threads)
    for t in (2, 3, 5):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[1], got[t])), t


# ---- exact mode: the layers as choose_kernels builds them --------------------------------------

EXACT_ROWS = [1, 2, 13, 64, 65, 300]  # both sides of the decode-sized threshold (64)


class ExactBlock(nn.Module):
    """A plain linear with a bias, the MLP's [gate; up] (fused and not), qkv with rotary q and k
    (heads of 64: fused; of 32: rotated after) and the LM head's logits, side by side: each
    layer's results for x [T, hidden] at positions [T] as float32 columns of one [T, *]."""

    def __init__(self, kernels, dtype: torch.dtype, hidden: int) -> None:
        super().__init__()
        rope = {d: RotaryEmbedding(d, 4096, 10000.0, kernels=kernels) for d in (32, 64)}
        self.layers = nn.ModuleDict(
            {
                "linear": Linear(hidden, 96, bias=True, kernels=kernels),
                "gated": GateUpLinear(hidden, 64, kernels),
                "gated_then_act": GateUpLinear(hidden, 48, kernels),
                "qkv": RotaryQKVLinear(hidden, 64, 2, 1, rope[64], kernels=kernels),
                "qkv_then_rotary": RotaryQKVLinear(hidden, 32, 4, 2, rope[32], True, kernels),
                "logits": LMHead(100, hidden, kernels),
            }
        )
        gen = torch.Generator().manual_seed(hidden)
        for p in self.layers.parameters():
            p.data = (torch.randn(p.shape, generator=gen) * 0.3).to(dtype)
        prepare_weights(self)
        self.x = torch.randn(max(ROWS), hidden, generator=gen).to(dtype)
        self.positions = torch.randint(0, 4096, (max(ROWS),), generator=gen)

    def run(self, name: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        layer = self.layers[name]
        out = layer(x, positions) if "qkv" in name else (layer(x),)
        return torch.cat([t.flatten(1).float() for t in out], 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.run(name, x, positions) for name in self.layers], 1)


def check_exact_layers(
    kernels, dtype: torch.dtype, hidden: int, rows: list[int] = EXACT_ROWS
) -> None:
    assert kernels.describe()["exact"] is True
    block = ExactBlock(kernels, dtype, hidden)
    with torch.inference_mode():
        for name, layer in block.layers.items():
            try:
                assert_rows_invariant(
                    lambda r, n=name: block.run(n, block.x[r], block.positions[r]), rows
                )
            except AssertionError as e:
                raise AssertionError(f"{name} ({layer.method.name}): rows {e}") from None


@pytest.mark.parametrize("linear", ["auto", "amx", "avx512_bf16", "fma"])
@pytest.mark.parametrize("hidden", [96, 80])  # 80: not whole chunks of 32, padded
def test_exact_bf16_layers_give_a_row_its_own_bits(linear, hidden, monkeypatch, tmp_path) -> None:
    lib = loaded()
    if linear != "auto" and not cpu_linear.kernel_available(lib, linear):
        pytest.skip(f"the {linear} linear kernel does not run here")
    monkeypatch.setattr(calibrate, "COLD_BYTES", 1 << 20)  # a quick calibration
    monkeypatch.setattr(calibrate, "LARGE_ROWS", 96)
    kernels = choose_kernels(
        CPU, torch.bfloat16, lib, linear=linear, cache_dir=str(tmp_path), exact=True
    )
    check_exact_layers(kernels, torch.bfloat16, hidden)
    paths = set(kernels.describe()["linear"].values())
    assert len(paths) >= 1 and paths <= set(cpu_linear.KERNELS)  # one packed kernel per shape


@pytest.mark.parametrize("hidden", [96, 77])
def test_exact_float32_layers_give_a_row_its_own_bits(hidden: int) -> None:
    kernels = choose_kernels(CPU, torch.float32, loaded(), exact=True)
    check_exact_layers(kernels, torch.float32, hidden, ROWS)  # 1..700 rows
    assert set(kernels.describe()["linear"].values()) == {"f32"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_layers_under_torch_compile_too(dtype: torch.dtype) -> None:
    """Compiled, the linears run as the opaque ops of the kernels eager runs
    (radixrt::packed_linear, radixrt::f32_linear), the steps after them as Inductor writes
    them: a row's bits still its own, graph for graph (1 row, then dynamic row counts)."""
    lib = loaded()
    linear = "fma" if dtype == torch.bfloat16 else "auto"
    kernels = choose_kernels(CPU, dtype, lib, compiled=True, linear=linear, exact=True)
    block = ExactBlock(kernels, dtype, 96)
    compiled = torch.compile(block, dynamic=True)
    with torch.inference_mode():
        assert_rows_invariant(lambda r: compiled(block.x[r], block.positions[r]), EXACT_ROWS)


def test_exact_mode_refuses_what_is_not_exact() -> None:
    lib = loaded()
    for path in ("onednn", "torch", "torch_fp32"):
        with pytest.raises(NotExact, match=f"the '{path}' linear path gives a row results that"):
            choose_kernels(CPU, torch.bfloat16, lib, linear=path, exact=True)
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(NotExact, match="needs the CPU kernels' library"):
            choose_kernels(CPU, dtype, None, exact=True)
    with pytest.raises(NotExact, match="no row-invariant linear for torch.float16"):
        choose_kernels(CPU, torch.float16, lib, exact=True)
    with pytest.raises(NotExact, match="the linears on meta"):
        choose_kernels(torch.device("meta"), torch.bfloat16, lib, exact=True)
    two = Kernels(lambda n, k, large=True: Choice("fma", "amx"), lib, exact=True)
    with pytest.raises(NotExact, match="64x32 linear was given .* not one row-invariant path"):
        two.linear_for(64, 32)
    assert choose_kernels(CPU, torch.float32, lib).describe()["exact"] is False
