"""Where a prefill's time goes: the model runner's forward split by part, against this CPU's
ceilings measured in the same run.

Workloads (each one forward step of the model runner, built here as the scheduler builds its
``ForwardBatch``; a request is (cached tokens, new tokens), its cached K/V already in the pool):

- ``prefill``: 16 unrelated prompts of 544 tokens, no cache (issue 38's W2 prefill);
- ``w1_questions``: 16 requests of 32 new tokens after a cached 512-token prefix (a 512-token
  step of W1's questions);
- ``chunk256``: one request's second 256-token chunk after 256 cached tokens;
- ``mixed``: 32 decode rows of 1 token (544 cached each) and a 256-token chunk after 256 cached
  tokens, as one extend;
- ``decode``: the 32 decode rows alone (a W2 decode step).

Each step runs ``--warmup`` times untimed, then ``--repeats`` times with a timer around every
part of the forward (forward hooks on the model's modules, a wrapper around the attention
backend; where the runner has a decode chain, whose one C call the hooks cannot see, those
runs go layer by layer), then ``--repeats`` times without them (the forward's own wall time,
in the chain where it runs: up to 512 tokens). Parts:
``embedding``; the linears ``qkv`` (rotary embedding included where the kernel fuses it),
``o``, ``gate_up`` (SiLU-and-mul included where fused), ``down``; ``attention`` (the backend's
call: the K/V store and the kernel); ``metadata`` (the step's attention segments); ``norms``;
``rotary`` and ``silu_mul`` where they run as calls of their own; ``head`` (final norm and LM
head over the sampled rows); ``other``: the rest of the wall time (Python between kernels,
framework dispatch, the hooks' own cost). A part's time is its own, without the parts called
inside it.

The linear GFLOP/s are 2·T·(sum of N·K over the layers' linears) per second: end to end (over
the forward's wall time without hooks) and in the linears alone (over their parts' time),
given as fractions of the FMA and ``vdpbf16ps`` ceilings of ``bench/ceilings.py`` (its
register-only loops, timed here on the run's clock). On an AMX CPU the ``amx`` kernel can pass
both (no AMX ceiling is measured).

``--clock cpu`` times everything (parts, steps, ceilings) in the process's CPU seconds per
thread instead of wall seconds: on a machine shared with other work, the time this process
ran rather than the time others held its cores (threads that spin waiting count as running).

``--engine`` also times the ``prefill`` workload end to end through ``radixrt.Engine``
(``max_new_tokens=1``, a flushed cache each run): ``--repeats`` runs, the best reported.
``--torch-ops`` adds PyTorch's profile of one step of each workload (its top operators by
own time: copies, conversions, index ops).

Writes a table to stdout and JSON to bench/results/prefill_profile.json (``--out``).

    python bench/prefill_profile.py [--workloads prefill mixed] [--repeats 3] [--engine]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import ceilings  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WORKLOADS: dict[str, list[tuple[int, int]]] = {
    "prefill": [(0, 544)] * 16,
    "w1_questions": [(512, 32)] * 16,
    "chunk256": [(256, 256)],
    "mixed": [(544, 1)] * 32 + [(256, 256)],
    "decode": [(544, 1)] * 32,
}
LINEARS = ("qkv", "o", "gate_up", "down")
PARTS = ("embedding", *LINEARS, "attention", "metadata", "norms", "rotary", "silu_mul", "head")


# ---- the step ----------------------------------------------------------------------------------


def make_batch(runner, reqs: list[tuple[int, int]], seed: int):
    """A ForwardBatch for ``reqs`` [(cached, new)], each request on a row of its own with
    distinct slots (slot 0 is the pool's padding slot); random token ids."""
    from radixrt.attention.base import ForwardBatch, ForwardMode

    pool = runner.pool
    gen = torch.Generator().manual_seed(seed)
    rows, locs, positions, next_slot = [], [], [], pool.num_slots
    for cached, new in reqs:
        row = len(rows)
        next_slot -= cached + new  # from the top of the pool: clear of anything the engine uses
        slots = torch.arange(next_slot, next_slot + cached + new, dtype=torch.int64)
        pool.req_to_token[row, : cached + new] = slots
        rows.append(row)
        locs.append(slots[cached:])
        positions.append(torch.arange(cached, cached + new, dtype=torch.int64))
    t = sum(new for _, new in reqs)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.randint(10, runner.model_cfg.vocab_size - 10, (t,), generator=gen),
        positions=torch.cat(positions),
        out_cache_loc=torch.cat(locs),
        req_rows=torch.tensor(rows, dtype=torch.int64),
        seq_lens=[c + n for c, n in reqs],
        extend_lens=[n for _, n in reqs],
    )


def linear_flops(cfg, tokens: int) -> int:
    """2·T·ΣN·K over every decoder layer's qkv, o, gate_up and down."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (
        cfg.hidden_size * (qkv + 2 * cfg.intermediate_size)
        + (cfg.num_heads * cfg.head_dim + cfg.intermediate_size) * cfg.hidden_size
    )
    return 2 * tokens * cfg.num_layers * per_token


# ---- timing by part ----------------------------------------------------------------------------


def wall_clock() -> float:
    return time.perf_counter()


def cpu_clock() -> float:
    """The process's CPU seconds per thread: on a shared machine, the time this process ran
    (spinning threads count), not the time others held its cores."""
    return time.process_time() / torch.get_num_threads()


CLOCKS = {"wall": wall_clock, "cpu": cpu_clock}
clock = wall_clock  # set by --clock


class PartTimer:
    """Own time per part: a part's clock stops while a part called inside it runs."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [part, start, time of the parts inside]

    def enter(self, part: str) -> None:
        self.stack.append([part, clock(), 0.0])

    def leave(self) -> None:
        part, start, inner = self.stack.pop()
        spent = clock() - start
        self.own[part] += spent - inner
        if self.stack:
            self.stack[-1][2] += spent


def module_parts(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(part, module) for every module whose call is a part."""
    yield "embedding", model.model.embed_tokens
    yield "head", model.model.norm
    yield "head", model.lm_head
    yield "rotary", model.model.layers[0].self_attn.rotary
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield from (("qkv", attn.qkv_proj), ("o", attn.o_proj))
        yield from (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            yield "norms", norm
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None:
                yield "norms", norm


@contextlib.contextmanager
def timed_parts(runner, timer: PartTimer) -> Iterator[None]:
    """Every part of ``runner``'s forward timed into ``timer`` while inside."""
    handles = []
    for part, module in module_parts(runner.model):
        handles.append(module.register_forward_pre_hook(lambda m, a, p=part: timer.enter(p)))
        handles.append(module.register_forward_hook(lambda m, a, o: timer.leave()))
    backend = runner.attn_backend
    wrapped = {(backend, "forward"): "attention", (backend, "init_forward_metadata"): "metadata"}
    for layer in runner.model.model.layers:  # SiLU-and-mul where it runs after the linear
        method = layer.mlp.gate_up_proj.method
        if hasattr(method, "act"):
            wrapped[method, "act"] = "silu_mul"
    saved = {}
    for (obj, name), part in wrapped.items():
        saved[obj, name] = vars(obj).get(name)  # None: the class's
        setattr(obj, name, _timed(getattr(obj, name), part, timer))
    chain, runner.decode_chain = runner.decode_chain, None  # its one C call hides the parts
    try:
        yield
    finally:
        runner.decode_chain = chain
        for h in handles:
            h.remove()
        for (obj, name), own in saved.items():
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)


def _timed(fn, part: str, timer: PartTimer):
    def call(*args, **kwargs):
        timer.enter(part)
        try:
            return fn(*args, **kwargs)
        finally:
            timer.leave()

    return call


def peak_gflops(clib, kind: str, threads: int, seconds: float = 0.1, repeats: int = 5) -> float:
    """``ceilings.peak_gflops`` on this run's clock (best of ``repeats``); 0 where the build
    lacks ``kind``."""
    code, flops_per_op = ceilings.FLOPS_PER_OP[kind]
    iters = 1 << 16
    while True:  # size a run
        t0 = clock()
        if clib.radixrt_peak(code, iters, threads) == -1:
            return 0.0
        if clock() - t0 >= seconds / 4:
            break
        iters *= 2
    iters = int(iters * seconds / max(clock() - t0, 1e-9)) + 1
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        clib.radixrt_peak(code, iters, threads)
        best = min(best, clock() - t0)
    return iters * 12 * flops_per_op * threads / best / 1e9


# ---- a workload --------------------------------------------------------------------------------


def run_steps(runner, batch, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = clock()
        runner.forward(batch)
        times.append(clock() - t0)
    return times


def profile_workload(runner, name: str, args: argparse.Namespace) -> dict:
    """One workload's record: wall times, each part's median own time, GFLOP/s."""
    reqs = WORKLOADS[name]
    batch = make_batch(runner, reqs, seed=len(name))
    run_steps(runner, batch, args.warmup)
    parts: dict[str, list[float]] = defaultdict(list)
    hooked = []
    for _ in range(args.repeats):
        timer = PartTimer()
        with timed_parts(runner, timer):
            hooked += run_steps(runner, batch, 1)
        for part in PARTS:
            parts[part].append(timer.own.get(part, 0.0))
        parts["other"].append(hooked[-1] - sum(timer.own.values()))
    wall = run_steps(runner, batch, args.repeats)
    tokens = int(batch.input_ids.shape[0])
    flops = linear_flops(runner.model_cfg, tokens)
    split = {p: _median(v) for p, v in parts.items()}
    best = min(wall)
    linear_s = sum(split[p] for p in LINEARS)
    return {
        "workload": name,
        "requests": [list(r) for r in reqs],
        "tokens": tokens,
        "wall_s": {"best": best, "median": _median(wall), "hooked_median": _median(hooked)},
        "parts_s": split,
        "linear_gflops_end_to_end": flops / best / 1e9,
        "linear_gflops_in_linears": flops / linear_s / 1e9 if linear_s else None,
    }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def torch_ops(runner, name: str, top: int = 12) -> list[dict]:
    """PyTorch's profile of one step: its top operators by own CPU time."""
    batch = make_batch(runner, WORKLOADS[name], seed=len(name))
    runner.forward(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.forward(batch)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        for e in events[:top]
    ]


def engine_prefill(engine, repeats: int) -> dict:
    """``prefill`` through the Engine: each run on a flushed cache, max_new_tokens=1."""
    from radixrt import SamplingParams

    reqs = WORKLOADS["prefill"]
    gen = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(10, vocab - 10, (n,), generator=gen).tolist() for _, n in reqs]
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(input_ids=prompts[:2], sampling_params=sp)  # warm-up
    times = []
    for _ in range(repeats):
        engine.flush_cache()
        t0 = clock()
        engine.generate(input_ids=prompts, sampling_params=sp)
        times.append(clock() - t0)
    tokens = sum(n for _, n in reqs)
    flops = linear_flops(engine.model_config, tokens)
    return {"tokens": tokens, "wall_s": min(times), "linear_gflops": flops / min(times) / 1e9}


# ---- report ------------------------------------------------------------------------------------


def print_record(rec: dict, peaks: dict[str, float]) -> None:
    wall = rec["wall_s"]["best"]
    hooked = rec["wall_s"]["hooked_median"]
    print(
        f"\n{rec['workload']}: {rec['tokens']} tokens, {len(rec['requests'])} requests; "
        f"wall {wall * 1e3:.1f} ms (median {rec['wall_s']['median'] * 1e3:.1f}, "
        f"timed by part {hooked * 1e3:.1f})"
    )
    for part, s in sorted(rec["parts_s"].items(), key=lambda kv: -kv[1]):
        if s:
            print(f"  {part:<10} {s * 1e3:9.2f} ms  {100 * s / hooked:5.1f} %")
    for key, what in (
        ("linear_gflops_end_to_end", "linear GFLOP/s end to end"),
        ("linear_gflops_in_linears", "linear GFLOP/s in the linears"),
    ):
        g = rec[key]
        if g is not None:  # None: no linear was timed by part (a decode chain's one C call)
            print(f"  {what}: {g:.1f} ({_of_peaks(g, peaks)})")


def _of_peaks(gflops: float, peaks: dict[str, float]) -> str:
    return ", ".join(f"{100 * gflops / p:.0f} % of {k}" for k, p in peaks.items() if p)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=None, help="default: PyTorch's")
    ap.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="cpu: CPU time per thread"
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="also time prefill through Engine")
    ap.add_argument("--torch-ops", action="store_true", help="PyTorch's top operators")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_profile.json")
    return ap.parse_args()


def main() -> None:
    global clock
    args = parse_args()
    clock = CLOCKS[args.clock]
    from radixrt import Engine
    from radixrt.model.weights import cache_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(model=args.model)
    runner = engine.runner
    threads = torch.get_num_threads()
    clib = ceilings.load(cache_dir())
    peaks = {k: peak_gflops(clib, k, threads) for k in ("fma", "avx512_bf16")}
    print(
        f"{platform.processor() or platform.machine()}, {threads} threads, {args.clock} clock, "
        f"RADIXRT_KERNEL_CFLAGS={os.environ.get('RADIXRT_KERNEL_CFLAGS', '')!r}; "
        f"ceilings GFLOP/s: {', '.join(f'{k} {v:.1f}' for k, v in peaks.items())}\n"
        f"kernels: {runner.kernels.describe()['linear']}; attention: "
        f"{runner.attn_backend.describe()}; decode chain: {runner.decode_chain_info}"
    )
    records = [profile_workload(runner, name, args) for name in args.workloads]
    for rec in records:
        print_record(rec, peaks)
        if args.torch_ops:
            rec["torch_ops"] = torch_ops(runner, rec["workload"])
            for op in rec["torch_ops"]:
                print(f"    {op['op']:<40} {op['calls']:6d} calls {op['self_ms']:9.2f} ms")
    result = {
        "threads": threads,
        "clock": args.clock,
        "cflags": os.environ.get("RADIXRT_KERNEL_CFLAGS", ""),
        "ceilings_gflops": peaks,
        "kernels": runner.kernels.describe(),
        "attention": runner.attn_backend.describe(),
        "decode_chain": runner.decode_chain_info,
        "workloads": records,
    }
    if args.engine:
        result["engine_prefill"] = e = engine_prefill(engine, args.repeats)
        print(
            f"\nEngine prefill: {e['tokens']} tokens in {e['wall_s']:.3f} s, linear "
            f"{e['linear_gflops']:.1f} GFLOP/s ({_of_peaks(e['linear_gflops'], peaks)})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
