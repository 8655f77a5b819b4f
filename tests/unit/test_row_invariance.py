"""A row's result from each packed linear kernel does not depend on the rows beside it: the same
bits whether the row is computed alone or among 1..700 others (the per-kernel half of exact
outputs; which kernel a row count gets is the calibration's business)."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library
from radixrt_kernels.cpu import linear as cpu_linear

ROWS = [1, 2, 3, 4, 5, 7, 8, 12, 13, 16, 31, 32, 33, 64, 65, 100, 128, 257, 700]


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
    monkeypatch.setattr(library, "CFLAGS", [*library.CFLAGS, *flags])
    lib = library._build_and_load(tmp_path)
    if lib is None or not cpu_linear.kernel_available(lib, "fma"):
        pytest.skip("this compiler or CPU does not build or run that kernel")
    for gated in (False, True):
        check_rows(lib, "fma", gated)


def check_rows(lib, kernel: str, gated: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 192, 160
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(max(ROWS), k, generator=gen).bfloat16()
    packed = cpu_linear.pack(lib, w, gated=gated)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(lib, rows, packed, n, gated=gated, kernel=kernel)

    alone = torch.cat([run(x[i : i + 1]) for i in range(max(ROWS))])
    for r in ROWS:
        assert torch.equal(run(x[:r]).view(torch.int16), alone[:r].view(torch.int16)), r
