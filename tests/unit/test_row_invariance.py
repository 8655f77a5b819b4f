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

from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library
from radixrt_kernels.cpu import linear as cpu_linear

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


# ---- the float32 kernel --------------------------------------------------------------------

F32_SHAPES = [(192, 160), (100, 77), (576, 576), (70, 1)]  # (n, k): K any width, N any height


def check_f32_rows(lib, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(max(ROWS), k, generator=gen)
    packed = cpu_linear.pack_f32(w)
    for b in (None, bias):
        assert_rows_invariant(lambda rows: cpu_linear.linear_f32(lib, x[rows], packed, n, b))
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
