"""The quantized CPU linear (radixrt_kernels.cpu.quant) on SmolLM2-135M's shapes, per type.

Per type and shape (N x K): decode-sized (M = 1) as GB/s of the packed weight streamed, each
call taking the next of enough copies of the weight (at least ``--copies-mib`` together) that
it is not in L1/L2; prefill-sized (M = 512) as GFLOP/s (2·M·N·K / t) on one copy. Each cell is
the fastest of ``--repeats`` calls after a warm-up. On a CPU shared with other busy processes,
``--threads 1``: a call whose second thread waits for its core takes a time slice. Every path
the library has runs (``--paths`` to choose); run with ``RADIXRT_KERNEL_CFLAGS`` (and another
``RADIXRT_CACHE_DIR``) to time the library as built for another CPU, e.g. AVX2-only:

    RADIXRT_KERNEL_CFLAGS="-mno-avx512f -mno-avx512vnni -mno-amx-tile -mno-amx-int8 ..." \\
        RADIXRT_CACHE_DIR=/tmp/rc_avx2 python bench/quant_linear.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from radixrt.quant import arithmetic
from radixrt.quant.formats import random_blocks
from radixrt_kernels.cpu import library, quant

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def time_calls(fn, repeats: int) -> float:
    fn(0)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - t0)
    return min(times)


def cell(lib, qtype: str, n: int, k: int, path: str, args) -> tuple[float, float]:
    raw = random_blocks(qtype, n, k)
    packed = quant.pack(lib, qtype, raw, k)
    copies = [packed] + [
        packed.clone() for _ in range(max(0, args.copies_mib * 2**20 // packed.numel() - 1))
    ]
    x1 = torch.randn(1, k).bfloat16()
    t1 = time_calls(
        lambda i: quant.linear(lib, qtype, x1, copies[i % len(copies)], n, k, force_path=path),
        args.repeats,
    )
    xm = torch.randn(args.rows, k).bfloat16()
    tm = time_calls(
        lambda i: quant.linear(lib, qtype, xm, packed, n, k, force_path=path),
        max(3, args.repeats // 20),
    )
    return packed.numel() / t1 / 1e9, 2 * args.rows * n * k / tm / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", default=list(quant.QTYPES))
    parser.add_argument("--paths", nargs="*", default=None)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--copies-mib", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = os.environ.get("RADIXRT_CACHE_DIR") or os.path.expanduser("~/.cache/radixrt")
    lib = library.load(cache)
    if lib is None:
        raise SystemExit(f"no kernels' library: {library.why_unavailable()}")
    flags = os.environ.get("RADIXRT_KERNEL_CFLAGS", "")
    print(f"threads {torch.get_num_threads()}, extra flags: {flags or 'none'}")
    print("type  path          shape        M=1 GB/s  M=" + f"{args.rows} GFLOP/s")
    for qtype in args.types:
        paths = [p for p in args.paths or quant.PATHS if quant.path_available(lib, qtype, p)]
        for path in paths:
            for n, k in SHAPES:
                if k % arithmetic.BLOCK[qtype]:
                    continue
                gbs, gflops = cell(lib, qtype, n, k, path, args)
                print(f"{qtype:5} {path:13} {n:5}x{k:<5} {gbs:9.1f} {gflops:14.1f}", flush=True)


if __name__ == "__main__":
    main()
