"""bench/ceilings.py: the benchmarks' ceilings build beside the kernels' library (its compiler,
flags and headers) and measure something; the product's library carries no benchmark code."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(
    cpu_library.compiler() is None,
    reason="no C compiler: the ceilings cannot be built here",
)


@pytest.fixture(scope="module")
def ceilings(bench_module):
    return bench_module("ceilings")


def test_ceilings_build_and_measure(ceilings) -> None:
    clib = ceilings.load(cache_dir())
    assert ceilings.peak_gflops(clib, "fma", 1, seconds=0.01, repeats=1) > 0
    assert ceilings.peak_gflops(clib, "avx512_bf16", 1, seconds=0.01, repeats=1) >= 0
    assert ceilings.stream_gbps(clib, 1, nbytes=1 << 20, repeats=1) > 0
    ceilings.stream_read(clib, torch.ones(1000), 1)


def test_the_kernels_library_has_no_benchmark_symbols() -> None:
    lib = cpu_library.load(cache_dir())
    assert lib is not None, cpu_library.why_unavailable()
    for name in ("radixrt_peak", "radixrt_stream_read"):
        assert not hasattr(lib, name), name
