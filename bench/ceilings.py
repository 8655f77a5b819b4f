"""This CPU's ceilings, for the benchmarks: what its vectors and its memory can do at best.

``load(cache_dir)`` builds ``ceilings.c`` as the CPU kernels' library is built (the same
compiler, flags and headers: ``radixrt_kernels.cpu.library.compile_library``), into
``cache_dir/kernels``. Then:

- ``peak_gflops(lib, kind, threads)``: the register-only throughput of ``kind`` ("fma":
  float32 FMA on the build's vectors; "avx512_bf16": vdpbf16ps), in GFLOP/s;
- ``stream_gbps(lib, threads, nbytes)``: a read-only pass over ``nbytes``, in GB/s;
- ``stream_read(lib, buf, threads)``: one such pass over a tensor (to time beside a kernel).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from radixrt_kernels.cpu import library

SOURCE = Path(__file__).with_name("ceilings.c")
FLOPS_PER_OP = {"fma": (0, 32), "avx512_bf16": (1, 64)}  # kind: (code, flops per instruction)


def load(cache_dir: str) -> ctypes.CDLL:
    """The ceilings' library (built once per source, flags, compiler and CPU). Raises
    RuntimeError where it cannot be built."""
    path = library.compile_library([SOURCE], Path(cache_dir) / "kernels", "ceilings")
    lib = ctypes.CDLL(str(path))
    lib.radixrt_peak.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.radixrt_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.radixrt_peak.restype = lib.radixrt_stream_read.restype = ctypes.c_double
    return lib


def peak_gflops(
    lib: ctypes.CDLL, kind: str, threads: int, seconds: float = 0.1, repeats: int = 5
) -> float:
    """The register-only throughput of ``kind`` on ``threads`` threads, in GFLOP/s: the best of
    ``repeats`` runs of about ``seconds`` each (a slow spell of a shared machine lowers one
    run, not the ceiling); 0 where this build lacks it."""
    code, flops_per_op = FLOPS_PER_OP[kind]
    iters, best = 1 << 16, 0.0
    while True:  # size a run
        t0 = time.perf_counter()
        if lib.radixrt_peak(code, iters, threads) == -1:
            return 0.0
        if time.perf_counter() - t0 >= seconds / 4:
            break
        iters *= 2
    iters = int(iters * seconds / max(time.perf_counter() - t0, 1e-9)) + 1
    for _ in range(repeats):
        t0 = time.perf_counter()
        lib.radixrt_peak(code, iters, threads)
        best = max(best, iters * 12 * flops_per_op * threads / (time.perf_counter() - t0) / 1e9)
    return best


def stream_read(lib: ctypes.CDLL, buf: torch.Tensor, threads: int) -> None:
    """Read every byte of ``buf`` (contiguous, on the CPU) once, on ``threads`` threads."""
    lib.radixrt_stream_read(buf.data_ptr(), buf.numel() * buf.element_size(), threads)


def stream_gbps(lib: ctypes.CDLL, threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """The best of ``repeats`` read-only passes over ``nbytes`` (far past the caches), in GB/s."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        stream_read(lib, buf, threads)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9
