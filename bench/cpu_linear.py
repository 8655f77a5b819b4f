"""Every bf16 CPU linear path on the default model's linear shapes, against this CPU's ceilings.

Paths: the three kernels of ``radixrt_kernels.cpu.linear`` (``amx``,
``avx512_bf16``, ``fma``: one packed weight, shared), oneDNN's linear on a
weight reordered once (``OneDNNLinear``), PyTorch's bf16 ``F.linear`` and its
float32 ``F.linear`` (x widened inside the clock, the float32 weight made once
outside it; its weight bytes count as float32). A path this build or CPU lacks
is left out, and the header says so.

Shapes (N, K) come from the model's config (``--model``, default the default
model): qkv, o, gate_up, down and the LM head, each at every ``--rows`` (M).
The LM head runs only up to ``--lm-head-rows`` (64) rows: a prefill computes
logits for its sampled rows only, so the head never sees a prefill's M.

Each cell (shape × rows × path) gets a warm-up call, whose result is checked
against F.linear in float64 (max error within 2^-7 of the output's largest
magnitude, bf16 rounding; a wrong path stops the run), then one call to size
the run, then enough timed calls for ``--seconds`` (at least ``--min-repeats``);
a cell's time is reported as GFLOP/s (2·M·N·K / t) and weight GB/s (the
weight's bytes / t). Decode-sized cells (rows < 64) read their weight
from memory, as a decode step does: each call takes the next of enough
distinct copies of the weight (together over 2× the last-level cache, from
``lscpu -C``) that a call finds its weight cold, and the median call is
reported (the cache keeps some copies now and then: the fastest call would
be one that found its weight there). Larger cells report the fastest call
(noise only adds time) and reuse one
copy: they are bound by arithmetic, not by the weight's stream.

The ceilings (``bench/ceilings.py``) are measured in the same run, on the same threads: a
register-only float32 FMA loop, a vdpbf16ps loop (0 where the build lacks it)
and a read-only stream over 2× the last-level cache. Compute-bound cells
(rows >= 64) are given as a fraction of the FMA peak (and of the vdpbf16ps
peak beside it), memory-bound cells (rows <= 8) as a fraction of the stream
bandwidth; the fastest path of each cell is starred. Everything runs in one
process: each cell makes its own weights and inputs, and the paths share no
state but the thread pool.

Per-shape cells of few rows run in tens of microseconds, and a machine's stream bandwidth
drifts between runs; so the run also times a whole decode step's linears ("decode step"):
every layer's qkv, o, gate_up and down (distinct weights, as many layers as the model has)
and the LM head, called back to back at each ``--rows`` up to 8, for each packed kernel and
oneDNN, each step followed by a read-only stream over as many bytes; ``--step-rounds`` rounds,
the paths taking turns, and the medians of the step's weight GB/s and of its ratio to the
stream measured right after it. It runs as the engine runs a model on the CPU: glibc keeps
freed activation memory (``radixrt.memory.keep_freed_memory``) and the step's weights are
collapsed into huge pages (the stream's buffer too). This is the memory-bound regime as a
decode step meets it: each call's weight is cold, and each call pays its own fixed costs
(the Python wrapper, the ctypes call, the OpenMP team). The kernels a decode chain runs
(``radixrt_kernels.cpu.chain``) are timed that way too ("<kernel> chain"): all the layers'
linears as one chain, as the engine's decode chain runs them (with the norms and attentions
between), then the LM head's call.

``--offline`` also runs ``bench/offline_shared_prefix.py --skip-compile
--repeats 2`` in bf16 and in float32, each in a subprocess (with its
transformers row), and adds its rows; each run's JSON is kept as
``results/cpu_linear_offline_<dtype>.json``, and that script's own
results/offline_shared_prefix.{json,png} are put back as they were.

Writes results/cpu_linear.json and, with matplotlib, results/cpu_linear.png.

    python bench/cpu_linear.py [--threads 2 --rows 1 8 32 64 512 2176 --shapes o down --offline]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear

sys.path.insert(0, str(Path(__file__).parent))
import ceilings  # noqa: E402  (this CPU's ceilings: bench/ceilings.c)

BENCH = Path(__file__).parent
RESULTS = BENCH / "results"
FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512_fp16", "avx2", "fma")
SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")
DEFAULT_LLC = 64 << 20
COLD_BELOW = 64  # cells with fewer rows read every call's weight from memory
MEMORY_BOUND_MAX = 8  # rows: such a cell is bound by the weight's stream
COMPUTE_BOUND_MIN = 64  # rows: such a cell is bound by arithmetic
RTOL = 2.0**-7  # bf16 rounding, relative to the output's largest magnitude
MAX_REPEATS = 20_000
LAYOUT_BYTES = {"packed": 2, "onednn": 2, "plain": 2, "fp32": 4}  # per weight element

# ---- this CPU ---------------------------------------------------------------------------


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """lscpu's "Model name" and its flags (/proc/cpuinfo's where lscpu has none)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "")
    if not flags:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line.split(":", 1)[1] for line in cpuinfo if line.startswith("flags")), "")
    return fields.get("Model name", "unknown").strip(), set(flags.split())


def llc_bytes() -> int:
    """The last-level cache's size: ``lscpu -C``'s last level, else sysfs index3, else 64 MiB."""
    out = subprocess.run(
        ["lscpu", "-C=NAME,ONE-SIZE", "--bytes"], capture_output=True, text=True
    ).stdout
    sizes = [line.split() for line in out.splitlines()[1:]]
    sizes = [int(s[1]) for s in sizes if len(s) == 2 and s[1].isdigit() and s[0] != "L1i"]
    if sizes:
        return sizes[-1]
    sysfs = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if sysfs.exists():
        text = sysfs.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * scale
    return DEFAULT_LLC


class Ceilings(NamedTuple):
    fma_gflops: float  # register-only float32 FMA
    bf16_gflops: float  # register-only vdpbf16ps; 0 where the build lacks it
    stream_gbps: float  # read-only stream over 2x the LLC


def measure_ceilings(clib: Any, threads: int, llc: int) -> Ceilings:
    """The ceilings, by ``clib`` (``ceilings.load``; None: none measured, all 0)."""
    if clib is None:
        return Ceilings(0.0, 0.0, 0.0)
    return Ceilings(
        ceilings.peak_gflops(clib, "fma", threads),
        ceilings.peak_gflops(clib, "avx512_bf16", threads),
        ceilings.stream_gbps(clib, threads, nbytes=2 * llc),
    )


# ---- shapes and paths ---------------------------------------------------------------------


class Shape(NamedTuple):
    name: str
    n: int  # out_features
    k: int  # in_features


def model_shapes(model: str | None) -> list[Shape]:
    """The (N, K) of the model's linears, in ``SHAPES`` order."""
    from radixrt.model.default_model import default_model_path
    from radixrt.model.hf_config import ModelConfig

    c = ModelConfig.from_pretrained(model or default_model_path())
    h, q = c.hidden_size, c.num_heads * c.head_dim
    return [
        Shape("qkv", (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, h),
        Shape("o", h, q),
        Shape("gate_up", 2 * c.intermediate_size, h),
        Shape("down", h, c.intermediate_size),
        Shape("lm_head", c.vocab_size, h),
    ]


class LinearPath(NamedTuple):
    name: str
    layout: str  # which prepared weight it reads (a key of LAYOUT_BYTES)
    call: Callable[[torch.Tensor, Any, int], torch.Tensor]  # (x [M, K], weight, N) -> [M, N]


def _packed_call(lib: Any, kernel: str, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    return cpu_linear.linear(lib, x, w, n, kernel=kernel)


def available_paths(lib: Any) -> tuple[list[LinearPath], dict[str, Callable], list[str]]:
    """The paths that run here, the weight layouts they read (w [N, K] bf16 -> a fresh copy in
    that layout), and a note for each path left out."""
    from radixrt.model.linear_methods import OneDNNLinear, onednn_works

    paths, missing = [], []
    layouts: dict[str, Callable] = {
        "plain": torch.Tensor.clone,
        "fp32": torch.Tensor.float,
    }
    if lib is None:
        missing.append(f"the packed kernels (no library: {cpu_library.why_unavailable()})")
    for kernel in cpu_linear.KERNELS if lib is not None else ():
        if cpu_linear.kernel_available(lib, kernel):
            paths.append(LinearPath(kernel, "packed", functools.partial(_packed_call, lib, kernel)))
            layouts["packed"] = functools.partial(cpu_linear.pack, lib)
        else:
            missing.append(f"{kernel} (not on this CPU or build)")
    if onednn_works():
        onednn = OneDNNLinear()
        layouts["onednn"] = onednn.prepare
        paths.append(LinearPath("onednn", "onednn", lambda x, w, n: onednn.apply(x, w, None, n)))
    else:
        missing.append("onednn (this PyTorch lacks oneDNN's packed linear)")
    paths.append(LinearPath("torch bf16", "plain", lambda x, w, n: F.linear(x, w)))
    paths.append(LinearPath("torch fp32", "fp32", lambda x, w, n: F.linear(x.float(), w)))
    return paths, layouts, missing


# ---- one cell -----------------------------------------------------------------------------


def weight_copies(prepare: Callable, w: torch.Tensor, nbytes: int, cold: int) -> list:
    """``prepare(w)`` once, or, with ``cold`` > 0, as many times as it takes for the copies to
    exceed ``cold`` bytes together (so cycling through them reads each from memory)."""
    count = cold // nbytes + 1 if cold else 1
    return [prepare(w) for _ in range(count)]


def check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Fail unless y is ref [M, N] (float64) within bf16 rounding of the output's scale."""
    if y.shape != ref.shape:
        raise AssertionError(f"{what}: output {tuple(y.shape)}, expected {tuple(ref.shape)}")
    err = (y.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    if not err <= RTOL * scale:  # also catches NaN
        raise AssertionError(f"{what}: max error {err:.4g} > 2^-7 x output scale {scale:.4g}")


def best_time(
    run: Callable[[int], object], seconds: float, min_repeats: int, median: bool = False
) -> tuple[float, int]:
    """The fastest (``median``: the median) of ``run(i)`` over enough calls for ``seconds``
    (one call sizes the count)."""
    t0 = time.perf_counter()
    run(1)
    estimate = time.perf_counter() - t0
    repeats = max(min_repeats, min(MAX_REPEATS, math.ceil(seconds / max(estimate, 1e-9))))
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        run(i + 2)
        times.append(time.perf_counter() - t0)
    return (statistics.median(times) if median else min(times)), repeats


def cell_record(
    shape: Shape, rows: int, path: LinearPath, seconds: float, repeats: int, ceil: Ceilings
) -> dict:
    gflops = 2 * rows * shape.n * shape.k / seconds / 1e9
    gbps = LAYOUT_BYTES[path.layout] * shape.n * shape.k / seconds / 1e9

    def frac(value: float, peak: float) -> float | None:
        return value / peak if peak > 0 else None

    return {
        "shape": shape.name,
        "n": shape.n,
        "k": shape.k,
        "rows": rows,
        "path": path.name,
        "seconds": seconds,
        "repeats": repeats,
        "cold_weights": rows < COLD_BELOW,
        "timing": "median call" if rows < COLD_BELOW else "fastest call",
        "gflops": gflops,
        "weight_gbps": gbps,
        "frac_fma": frac(gflops, ceil.fma_gflops),
        "frac_bf16": frac(gflops, ceil.bf16_gflops),
        "frac_stream": frac(gbps, ceil.stream_gbps),
    }


# ---- one shape ----------------------------------------------------------------------------


def measure_shape(
    shape: Shape,
    rows: list[int],
    paths: list[LinearPath],
    layouts: dict[str, Callable],
    ceil: Ceilings,
    args: argparse.Namespace,
) -> list[dict]:
    """Every path at every row count of one shape; layout by layout, so each layout's cold
    copies are made once and freed before the next layout's."""
    w = (torch.randn(shape.n, shape.k) * shape.k**-0.5).bfloat16()
    x = torch.randn(max(rows), shape.k).bfloat16()
    ref = x.double() @ w.double().T  # [max rows, N]
    cells = []
    for layout in dict.fromkeys(p.layout for p in paths):
        nbytes = LAYOUT_BYTES[layout] * shape.n * shape.k
        cold_bytes = 2 * args.llc if min(rows) < COLD_BELOW else 0
        copies = weight_copies(layouts[layout], w, nbytes, cold_bytes)
        for path in (p for p in paths if p.layout == layout):
            for m in rows:
                ws = copies if m < COLD_BELOW else copies[:1]
                xm = x[:m]

                def run(i: int, path: LinearPath = path, xm: torch.Tensor = xm, ws: list = ws):
                    return path.call(xm, ws[i % len(ws)], shape.n)

                check(
                    run(0),
                    ref[:m],
                    f"{path.name} on {shape.name} [{shape.n}, {shape.k}] at {m} rows",
                )
                seconds, repeats = best_time(
                    run, args.seconds, args.min_repeats, median=m < COLD_BELOW
                )
                cells.append(cell_record(shape, m, path, seconds, repeats, ceil))
        del copies
    for m in rows:  # star the fastest path of each cell
        same = [c for c in cells if c["rows"] == m]
        fastest = min(same, key=lambda c: c["seconds"])
        for c in same:
            c["fastest"] = c is fastest
    return sorted(cells, key=lambda c: c["rows"])


# ---- a whole decode step's linears ----------------------------------------------------------


def decode_step_shapes(model: str | None) -> list[Shape]:
    """The linears of one decode step, in the order the model calls them."""
    from radixrt.model.default_model import default_model_path
    from radixrt.model.hf_config import ModelConfig

    layers = ModelConfig.from_pretrained(model or default_model_path()).num_layers
    shapes = model_shapes(model)
    return [s for s in shapes if s.name != "lm_head"] * layers + [shapes[-1]]


def chained_steps(
    steps: list[Shape], ws: list, lib: Any, kernel: str, m: int, xs: dict
) -> Callable[[], None]:
    """The decode step's linears as the engine's decode chain runs them: every layer's qkv, o,
    gate_up and down as one chain (``radixrt_kernels.cpu.chain``), then the LM head's call."""
    from radixrt_kernels.cpu import chain as cpu_chain

    chain = cpu_chain.Chain(lib)
    for shape, w in zip(steps[:-1], ws[:-1]):
        chain.linear(kernel, xs[shape.k][:m], w, shape.n, torch.empty(m, shape.n).bfloat16())
    head, w_head, x_head = steps[-1], ws[-1], xs[steps[-1].k][:m]

    def run() -> None:
        chain.run()
        cpu_linear.linear(lib, x_head, w_head, head.n, kernel=kernel)

    return run


def measure_decode_step(
    steps: list[Shape],
    paths: list[LinearPath],
    layouts: dict[str, Callable],
    lib: Any,
    clib: Any,
    args: argparse.Namespace,
) -> list[dict]:
    """Per path and row count (up to MEMORY_BOUND_MAX): the decode step's linears back to back
    (call by call, and for the kernels a chain runs, as chains: "<kernel> chain"), each step
    followed by a stream over as many bytes; medians over ``args.step_rounds`` rounds."""
    from radixrt.memory import anonymous_regions, collapse_anonymous_memory
    from radixrt_kernels.cpu import chain as cpu_chain

    paths = [p for p in paths if p.layout in ("packed", "onednn")]
    rows = sorted({m for m in args.rows if m <= MEMORY_BOUND_MAX})
    if lib is None or not paths or not rows:
        return []
    nbytes = sum(2 * s.n * s.k for s in steps)
    xs = {k: torch.randn(max(rows), k).bfloat16() for k in {s.k for s in steps}}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        before, weights = anonymous_regions(heap=False), {}
        stream = torch.ones(nbytes // 4, dtype=torch.float32)  # in huge pages too
        for layout in dict.fromkeys(p.layout for p in paths):
            weights[layout] = [
                layouts[layout]((torch.randn(s.n, s.k) * s.k**-0.5).bfloat16()) for s in steps
            ]
        collapse_anonymous_memory(since=before)
        runs: dict[str, dict[int, Callable[[], None]]] = {}
        for path in paths:
            ws = weights[path.layout]

            def call_by_call(m: int, path: LinearPath = path, ws: list = ws) -> None:
                for shape, w in zip(steps, ws):
                    path.call(xs[shape.k][:m], w, shape.n)

            runs[path.name] = {m: functools.partial(call_by_call, m) for m in rows}
            if path.name in cpu_chain.KERNELS:
                runs[f"{path.name} chain"] = {
                    m: chained_steps(steps, ws, lib, path.name, m, xs) for m in rows
                }
        names = list(runs)
        for r in range(args.step_rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                for m in rows:
                    run = runs[name][m]
                    t0 = time.perf_counter()
                    run()
                    t1 = time.perf_counter()
                    ceilings.stream_read(clib, stream, args.threads)
                    t2 = time.perf_counter()
                    times.setdefault((name, m), []).append((t1 - t0, t2 - t1))
    out = []
    for (name, m), runs_ in times.items():
        out.append(
            {
                "path": name,
                "rows": m,
                "calls": 2 if name.endswith(" chain") else len(steps),
                "weight_bytes": nbytes,
                "step_s": statistics.median(t for t, _ in runs_),
                "weight_gbps": statistics.median(nbytes / t / 1e9 for t, _ in runs_),
                "stream_gbps": statistics.median(nbytes / s / 1e9 for _, s in runs_),
                "frac_stream": statistics.median(s / t for t, s in runs_),
                "rounds": len(runs_),
            }
        )
    return sorted(out, key=lambda c: (c["rows"], c["path"]))


def print_decode_step(steps: list[Shape], cells: list[dict]) -> None:
    if not cells:
        return
    layers = (len(steps) - 1) // 4
    print(
        f"\ndecode step: {layers} layers' qkv, o, gate_up, down and the LM head, "
        f"{cells[0]['weight_bytes'] / 1e6:.0f} MB of bf16 weights "
        f"(medians of {cells[0]['rounds']} rounds)"
    )
    print(f"{'rows':>6} {'path':18} {'calls':>5} {'ms':>8} {'GB/s':>7} {'stream':>7}  of stream")
    for c in cells:
        print(
            f"{c['rows']:6d} {c['path']:18} {c['calls']:5d} {1e3 * c['step_s']:8.2f} "
            f"{c['weight_gbps']:7.1f} {c['stream_gbps']:7.1f}  {c['frac_stream']:.0%}"
        )


# ---- output -------------------------------------------------------------------------------


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def ceiling_note(cell: dict) -> str:
    """The cell's fraction of the ceiling that bounds it ('' between the two regimes)."""
    if cell["rows"] >= COMPUTE_BOUND_MIN:
        return f"{_pct(cell['frac_fma'])} fma, {_pct(cell['frac_bf16'])} vdpbf16ps"
    if cell["rows"] <= MEMORY_BOUND_MAX:
        return f"{_pct(cell['frac_stream'])} stream"
    return ""


def print_header(model: str, flags: set[str], args: argparse.Namespace, ceil: Ceilings) -> None:
    present = [f for f in FLAGS if f in flags]
    absent = [f for f in FLAGS if f not in flags]
    print(f"CPU: {model}; flags: {' '.join(present) or '-'}; absent: {' '.join(absent) or '-'}")
    print(
        f"threads: {args.threads}; last-level cache {args.llc / 2**20:.0f} MiB: cells under "
        f"{COLD_BELOW} rows cycle through weight copies over {2 * args.llc / 2**20:.0f} MiB"
    )
    print(
        f"ceilings: float32 FMA {ceil.fma_gflops:.1f} GFLOP/s, vdpbf16ps "
        f"{ceil.bf16_gflops:.1f} GFLOP/s, read stream {ceil.stream_gbps:.1f} GB/s"
    )


def print_cells(shapes: list[Shape], cells: list[dict]) -> None:
    for shape in shapes:
        mine = [c for c in cells if c["shape"] == shape.name]
        if not mine:
            continue
        print(
            f"\n{shape.name}: N {shape.n}, K {shape.k} ({2 * shape.n * shape.k / 1e6:.2f} MB bf16)"
        )
        print(f"{'rows':>6} {'path':12} {'us':>10} {'GFLOP/s':>9} {'GB/s':>7}  of ceiling")
        for c in mine:
            star = "*" if c["fastest"] else " "
            print(
                f"{c['rows']:6d} {c['path']:12} {1e6 * c['seconds']:10.1f} {c['gflops']:9.1f} "
                f"{c['weight_gbps']:7.1f} {star} {ceiling_note(c)}"
            )


def print_offline(offline: dict[str, list[dict]]) -> None:
    print("\noffline shared-prefix workload (bench/offline_shared_prefix.py --skip-compile)")
    print(f"{'dtype':9} {'row':36} {'wall s':>8} {'out tok/s':>10}")
    for dtype, rows in offline.items():
        for r in rows:
            print(f"{dtype:9} {r['row']:36} {r['wall_s']:8.2f} {r['output_tok_s']:10.1f}")


def plot(shapes: list[Shape], cells: list[dict], ceil: Ceilings, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install matplotlib)")
        return
    shapes = [s for s in shapes if any(c["shape"] == s.name for c in cells)]
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [c for c in cells if c["shape"] == shape.name]
        rows = sorted({c["rows"] for c in mine})
        for name in dict.fromkeys(c["path"] for c in mine):
            pts = [(c["rows"], c["gflops"]) for c in mine if c["path"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.plot(
            rows, [m * ceil.stream_gbps for m in rows], "k:", label="rows x stream (bf16 weights)"
        )
        ax.axhline(ceil.fma_gflops, color="k", ls="--", lw=0.8, label="fp32 FMA peak")
        if ceil.bf16_gflops:
            ax.axhline(ceil.bf16_gflops, color="grey", ls="--", lw=0.8, label="vdpbf16ps peak")
        ax.set(
            xscale="log", yscale="log", xlabel="rows", title=f"{shape.name} [{shape.n}, {shape.k}]"
        )
        ax.set_xticks(rows, [str(m) for m in rows], fontsize=7)
        ax.minorticks_off()
    axes[0][0].set_ylabel("GFLOP/s")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- offline workload ---------------------------------------------------------------------


def run_offline(threads: int) -> dict[str, list[dict]]:
    """bench/offline_shared_prefix.py's rows in bf16 and float32, each run in a subprocess; its
    own result files are restored afterwards."""
    own = [RESULTS / "offline_shared_prefix.json", RESULTS / "offline_shared_prefix.png"]
    saved = {p: p.read_bytes() for p in own if p.exists()}
    offline = {}
    try:
        for dtype in ("bfloat16", "float32"):
            cmd = [sys.executable, str(BENCH / "offline_shared_prefix.py"), "--dtype", dtype]
            cmd += ["--skip-compile", "--repeats", "2", "--threads", str(threads)]
            subprocess.run(cmd, check=True)
            aside = RESULTS / f"cpu_linear_offline_{dtype}.json"
            aside.write_bytes(own[0].read_bytes())
            offline[dtype] = json.loads(aside.read_text())["rows"]
    finally:
        for p in own:
            if p in saved:
                p.write_bytes(saved[p])
            else:
                p.unlink(missing_ok=True)
    return offline


# ---- main ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512, 2176])
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    ap.add_argument(
        "--lm-head-rows", type=int, default=64, help="the LM head runs only up to this many rows"
    )
    ap.add_argument("--seconds", type=float, default=0.2, help="timed calls per cell, in seconds")
    ap.add_argument("--min-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--step-rounds", type=int, default=9, help="rounds of the decode-step timing (0: none)"
    )
    ap.add_argument(
        "--offline", action="store_true", help="also run the offline shared-prefix workload"
    )
    args = ap.parse_args()
    if min(args.rows) < 1 or args.min_repeats < 1:
        ap.error("--rows and --min-repeats must be positive")
    return args


def measure_all(
    shapes: list[Shape],
    paths: list[LinearPath],
    layouts: dict[str, Callable],
    ceil: Ceilings,
    args: argparse.Namespace,
) -> list[dict]:
    cells = []
    with torch.inference_mode():
        for shape in shapes:
            limit = args.lm_head_rows if shape.name == "lm_head" else max(args.rows)
            rows = sorted({m for m in args.rows if m <= limit})
            usable = [
                p for p in paths if p.layout != "packed" or shape.k % cpu_linear.K_MULTIPLE == 0
            ]
            if len(usable) < len(paths):
                print(f"({shape.name}: K {shape.k} is not a multiple of 32: no packed kernels)")
            if rows:
                cells += measure_shape(shape, rows, usable, layouts, ceil, args)
    return cells


def main() -> None:
    args = parse_args()
    from radixrt.memory import keep_freed_memory

    keep_freed_memory()  # as the engine runs
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from radixrt.model.weights import cache_dir

    lib = cpu_library.load(cache_dir())
    args.llc = llc_bytes()
    model, flags = cpu_model_and_flags()
    paths, layouts, missing = available_paths(lib)
    clib = ceilings.load(cache_dir()) if lib is not None else None
    ceil = measure_ceilings(clib, args.threads, args.llc)
    print_header(model, flags, args, ceil)
    print(f"paths: {', '.join(p.name for p in paths)}; left out: {', '.join(missing) or '-'}")
    shapes = [s for s in model_shapes(args.model) if s.name in args.shapes]
    cells = measure_all(shapes, paths, layouts, ceil, args)
    print_cells(shapes, cells)
    steps = decode_step_shapes(args.model)
    decode_step = measure_decode_step(steps, paths, layouts, lib, clib, args)
    print_decode_step(steps, decode_step)
    offline = run_offline(args.threads) if args.offline else {}
    if offline:
        print_offline(offline)
    RESULTS.mkdir(exist_ok=True)
    result = {
        "args": vars(args),
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "missing_paths": missing,
        "ceilings": ceil._asdict(),
        "cells": cells,
        "decode_step": decode_step,
        "offline": offline,
    }
    (RESULTS / "cpu_linear.json").write_text(json.dumps(result, indent=2))
    plot(shapes, cells, ceil, RESULTS / "cpu_linear.png")


if __name__ == "__main__":
    main()
