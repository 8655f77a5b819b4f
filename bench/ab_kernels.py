"""A/B of two builds of the CPU kernels' library in one process, the two taking turns.

A host whose speed drifts by tens of percent over seconds hides a kernel change of 10 %
between processes run one after the other; two builds loaded side by side and timed in
alternation see it. Each side is a folder of the kernels' sources (``--a-src``, ``--b-src``:
``radixrt_kernels/cpu`` of any checkout; default this tree's) built with extra compiler flags
(``--flags`` for both, ``--a-flags``, ``--b-flags``: as ``RADIXRT_KERNEL_CFLAGS``). Both
load into this process with this tree's C signatures, so the two sides must share the C API.
Cases (``--cases``), each on the same inputs for both sides:

- ``linear``: one decode chain per side over 30 layers of SmolLM2-135M's qkv, o, gate_up and
  down (random bf16 weights, packed once by side A and shared), at each of ``--rows``, on
  the packed kernel ``--path`` (default: ``avx512_bf16`` where the build has it, else
  ``fma``);
- ``attention``: one layer's bf16 attention in exact mode: a decode batch of ``--requests``
  requests of ``--keys`` keys (contiguous slots); the same batch in groups of 8 requests that
  share their first ``--keys`` − 32 slots (W1's decode); an extend of ``--requests`` / 2
  requests of 32 new tokens after ``--keys`` − 32 cached ones; and a causal prefill of
  ``--requests`` / 16 prompts of ``--keys`` tokens; on AVX512-BF16 dot products where the
  build has them, else widened to float32 (``--attention``).

Per case: the median seconds of each side over ``--runs`` turns, B/A, and whether the two
sides' outputs are equal. Writes ``bench/results/ab_kernels.json``.

    python bench/ab_kernels.py --b-flags=-DPREFETCH_AHEAD=16384
    python bench/ab_kernels.py --a-src /old/checkout/radixrt_kernels/cpu --cases attention \\
        --flags="-mno-avx512f -mno-amx-tile -mno-amx-bf16 -mno-amx-int8 -mno-avx512bf16"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixrt.attention.cpu_backend import extend_segments
from radixrt.model import calibrate
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import library
from radixrt_kernels.cpu import linear as cpu_linear

RESULTS = Path(__file__).parent / "results"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
LAYERS = 30
KH, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M's attention
NEW = 32  # the attention extend's new tokens per request
GROUP_OF = 8  # requests per shared prefix in the grouped decode case


def build(src: Path, flags: str):
    """The library from the sources in ``src`` with ``flags`` added, loaded."""
    sources = [src / s.name for s in library.SOURCES]
    missing = [str(s) for s in sources if not s.exists()]
    if missing:
        raise SystemExit(f"not the kernels' source folder (missing {missing})")
    before = os.environ.get("RADIXRT_KERNEL_CFLAGS")
    os.environ["RADIXRT_KERNEL_CFLAGS"] = flags
    try:  # a folder per source tree: the build key hashes this tree's headers, not src's
        tree = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:12]
        folder = Path(cache_dir()) / ("kernels" if src == library.FOLDER else f"ab-{tree}")
        return library.load_file(library.compile_library(sources, folder, "radixrt-cpu"))
    finally:
        if before is None:
            os.environ.pop("RADIXRT_KERNEL_CFLAGS")
        else:
            os.environ["RADIXRT_KERNEL_CFLAGS"] = before


def turns(runs: list[Callable[[], object]], n: int) -> list[float]:
    """Median seconds of each run over n turns, the order alternating."""
    times: list[list[float]] = [[] for _ in runs]
    for t in range(n):
        for i in range(len(runs)) if t % 2 == 0 else reversed(range(len(runs))):
            t0 = time.perf_counter()
            runs[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(x) for x in times]


def linear_cases(libs, path: str, rows_list: list[int], n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    method_a = calibrate.make_method(path, libs[0])
    packed = [
        method_a.prepare((torch.randn(nn, k, generator=gen) * 0.05).bfloat16())
        for _ in range(LAYERS)
        for nn, k in SHAPES
    ]
    kernel = calibrate._chain_kernel(method_a)
    out = []
    for rows in rows_list:
        x = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}
        chains, outs = [], []
        for lib in libs:
            chain, ys = cpu_chain.Chain(lib), []
            for i, w in enumerate(packed):
                nn, k = SHAPES[i % len(SHAPES)]
                ys.append(torch.empty(rows, nn, dtype=torch.bfloat16))
                chain.linear(kernel, x[k], w, nn, ys[-1])
            chains.append(chain)
            outs.append(ys)
        a, b = turns([c.run for c in chains], n)
        same = all(torch.equal(p, q) for p, q in zip(*outs))
        out.append(record(f"linear {path}, {rows} rows", a, b, same))
    return out


def attention_cases(libs, requests: int, keys: int, dots: bool, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    slots = requests * keys + 1
    k_buf, v_buf = (torch.randn(slots, KH, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
    table = torch.arange(1, slots, dtype=torch.int64).view(requests, keys)
    shared = table.clone()  # groups of GROUP_OF requests on one prefix of keys - NEW slots
    for g in range(0, requests, GROUP_OF):
        shared[g : g + GROUP_OF, : keys - NEW] = table[g, : keys - NEW]
    scaling = HEAD_DIM**-0.5
    half = max(1, requests // 2)
    prompts = max(1, requests // 16)
    cases = {
        f"decode, {requests} x {keys} keys": cpu_attention.decode_segments(
            libs[0], table, torch.arange(requests), [keys] * requests, 64, 2, exact=True
        ),
        f"decode, {requests} x {keys} keys in groups of {GROUP_OF} on "
        f"{keys - NEW}": cpu_attention.decode_segments(
            libs[0], shared, torch.arange(requests), [keys] * requests, 64, 2, exact=True
        ),
        f"extend, {half} x {NEW} new after {keys - NEW}": extend_segments(
            table[:half], torch.arange(half), [keys] * half, [NEW] * half, exact=True
        ),
        f"prefill, {prompts} x {keys} new": extend_segments(
            table[:prompts], torch.arange(prompts), [keys] * prompts, [keys] * prompts, exact=True
        ),
    }
    path = "dots" if dots else "widened"
    out = []
    for label, seg in cases.items():
        q = torch.randn(int(seg.num_parts.shape[0]), KH * GROUP, HEAD_DIM, generator=gen).bfloat16()
        outs = [torch.empty_like(q) for _ in libs]

        def run(i: int, q=q, seg=seg, outs=outs) -> None:
            cpu_attention.attention(
                libs[i], q, k_buf, v_buf, seg, scaling, bf16_dots=dots, out=outs[i]
            )

        a, b = turns([lambda: run(0), lambda: run(1)], n)
        out.append(record(f"attention {path} {label}", a, b, torch.equal(outs[0], outs[1])))
    return out


def record(case: str, a: float, b: float, same: bool) -> dict:
    return {"case": case, "a_ms": a * 1e3, "b_ms": b * 1e3, "b_over_a": b / a, "same": same}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--a-src", type=Path, default=library.FOLDER, help="side A's kernel sources")
    add("--b-src", type=Path, default=library.FOLDER, help="side B's kernel sources")
    add("--flags", default="", help="compiler flags added to both builds")
    add("--a-flags", default="", help="more flags for side A")
    add("--b-flags", default="", help="more flags for side B")
    add("--cases", nargs="+", default=["linear", "attention"], choices=["linear", "attention"])
    add("--path", default=None, help="the packed linear kernel (avx512_bf16, fma, amx)")
    add("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    add(
        "--attention",
        choices=["dots", "widened"],
        default=None,
        help="bf16 attention on AVX512-BF16 dot products or widened to float32 (default: dots "
        "where the build has them)",
    )
    add("--requests", type=int, default=32)
    add("--keys", type=int, default=544, help="keys per request (at least 64)")
    add("--runs", type=int, default=40)
    add("--out", type=Path, default=RESULTS / "ab_kernels.json")
    args = ap.parse_args(argv)
    if args.keys < 64 or args.requests < 1 or args.runs < 1:
        ap.error("--keys must be at least 64, --requests and --runs at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    libs = [
        build(args.a_src, f"{args.flags} {args.a_flags}".strip()),
        build(args.b_src, f"{args.flags} {args.b_flags}".strip()),
    ]
    path = args.path or next(
        p for p in ("avx512_bf16", "fma") if cpu_linear.kernel_available(libs[0], p)
    )
    rows: list[dict] = []
    with torch.inference_mode():
        if "linear" in args.cases:
            rows += linear_cases(libs, path, args.rows, args.runs)
        if "attention" in args.cases:
            dots = args.attention == "dots" or (
                args.attention is None and cpu_attention.dots_available(libs[0])
            )
            rows += attention_cases(libs, args.requests, args.keys, dots, args.runs)
    print(f"A: {args.a_src} {args.flags} {args.a_flags}".rstrip())
    print(f"B: {args.b_src} {args.flags} {args.b_flags}".rstrip())
    print("| case | A ms | B ms | B/A | same outputs |\n|---|---|---|---|---|")
    for r in rows:
        cells = (r["case"], f"{r['a_ms']:.3f}", f"{r['b_ms']:.3f}", f"{r['b_over_a']:.3f}")
        print("| " + " | ".join((*cells, str(r["same"]))) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "cases": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
