"""Exact outputs: their cost in throughput, and how many requests differ without them.

Two workloads of seeded random token ids, greedy, every request asking for its logprobs:
- ``shared``: R prompts sharing a P-token prefix, each with its own 8-24-token question;
- ``random``: R unrelated prompts of 64-256 tokens.
Each runs with exact outputs on (the default on the CPU) and off
(``--disable-deterministic-inference``), each mode in a fresh process: first every request
alone on a flushed cache (the reference), then one untimed warm-up of the whole batch, then
``--repeats`` timed runs of the whole batch on a flushed cache (best reported), then one run
on the warm cache. A request "differs" when its token ids or any of its logprobs is not the
same bits as its run alone. Prints a table, writes JSON to bench/results/exactness.json.

    python bench/exactness.py [--model DIR] [--dtype bfloat16] [--requests 16] [--prefix 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def workload(kind: str, vocab: int, requests: int, prefix: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = 10, vocab - 10  # clear of special tokens at either end

    def ids(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    if kind == "shared":
        shared = ids(prefix)
        return [shared + ids(rng.randrange(8, 25)) for _ in range(requests)]
    return [ids(rng.randrange(64, 257)) for _ in range(requests)]


def run_mode(args: dict, exact: bool) -> dict:
    """One mode of one workload, in this (fresh) process."""
    from radixrt import Engine, SamplingParams
    from radixrt.testing import output_bits

    eng = Engine(
        model=args["model"], dtype=args["dtype"], disable_deterministic_inference=not exact
    )
    prompts = workload(
        args["kind"], eng.model_config.vocab_size, args["requests"], args["prefix"], args["seed"]
    )
    sp = SamplingParams(max_new_tokens=args["out"], temperature=0.0, ignore_eos=True, logprobs=True)
    alone = []
    for p in prompts:
        eng.flush_cache()
        alone.append(output_bits(eng.generate(input_ids=[p], sampling_params=sp)[0]))

    def batch() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=[sp] * len(prompts))
        seconds = time.perf_counter() - t0
        return seconds, sum(output_bits(o) != a for o, a in zip(outs, alone))

    eng.flush_cache()
    batch()  # warm-up
    cold = []
    for _ in range(args["repeats"]):
        eng.flush_cache()
        cold.append(batch())
    warm = batch()
    tokens = len(prompts) * args["out"]
    best = min(s for s, _ in cold)
    return {
        "exact": exact,
        "exactness": eng.runner.exactness.describe(),
        "kernels": eng.runner.kernels.describe(),
        "attention": eng.runner.attn_backend.describe(),
        "decode_chain": eng.runner.decode_chain_info,
        "batch_seconds": [s for s, _ in cold],
        "best_seconds": best,
        "output_tokens_per_s": tokens / best,
        "warm_seconds": warm[0],
        "differ_batched": max(d for _, d in cold),
        "differ_cached": warm[1],
        "requests": len(prompts),
    }


def _child(args: dict, exact: bool, queue) -> None:
    queue.put(run_mode(args, exact))


def in_fresh_process(args: dict, exact: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(args, exact, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model folder (default: the embedded one)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workloads", default="shared,random")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--out", type=int, default=16, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(RESULTS / "exactness.json"))
    a = p.parse_args()
    rows = []
    for kind in a.workloads.split(","):
        args = {**vars(a), "kind": kind}
        for exact in (True, False):
            rows.append({"workload": kind, **in_fresh_process(args, exact)})
    print(f"CPU: {cpu_model()}; model: {a.model or 'SmolLM2-135M-Instruct'} {a.dtype}")
    print(
        "| workload | outputs | output tok/s | batch s (best) | differ: batched | differ: cached |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        mode = "exact" if r["exact"] else "fast"
        print(
            f"| {r['workload']} | {mode} | {r['output_tokens_per_s']:.1f} | "
            f"{r['best_seconds']:.3f} | {r['differ_batched']}/{r['requests']} | "
            f"{r['differ_cached']}/{r['requests']} |"
        )
    for kind in a.workloads.split(","):
        on, off = (
            next(r for r in rows if r["workload"] == kind and r["exact"] is e)
            for e in (True, False)
        )
        print(f"{kind}: exact costs {100 * (on['best_seconds'] / off['best_seconds'] - 1):+.1f} %")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps({"cpu": cpu_model(), "args": vars(a), "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
