"""Sliding-window layers' KV per running request, prefix hits, and a mixture-of-experts model
against the dense model of the same active size (issue 35), on tiny-but-not-toy models.

1. ``swa``: a gemma3_text model (``--layers`` layers, hidden ``--hidden``, window ``--window``,
   one full layer in ``--pattern``) serves ``--groups`` groups × ``--questions`` questions on
   ``--prefix``-token shared prefixes (a ``--question``-token question each, ``--out`` tokens
   out), all at once, through the Engine, twice: with the sliding layers in a pool of their own
   (the default: each request holds its window's KV there) and with
   ``--disable-hybrid-swa-memory`` (they keep every token's, as the full layers do), the
   second of two rounds on a flushed cache (the first warms the process up). While the
   batch runs, the most sliding-layer slots a decoding request holds (its private SWA slots
   and the window its lock protects in the tree; with every token kept: its sequence); the hit
   rate of the whole run; the outputs (the same bits either way, or the run says so). Target:
   the hybrid's per-request sliding KV ≤ W / L of a request's dense KV (L slots: its
   sequence), hit rates equal.
2. ``moe``: a qwen3_moe model (``--experts`` experts of width ``--expert-width``, top
   ``--top-k``) and the qwen3 model of the same active size (MLP width top-k × expert width),
   decode tokens/s for each ``--batch`` count of requests of ``--moe-prompt`` tokens,
   ``--moe-out`` tokens out. Target: the MoE model ≥ 0.8× the dense one.

Models are random (``radixrt.testing.make_tiny_model``, written once under
``$RADIXRT_CACHE_DIR/bench-families``), bf16 by default. Prints a table, writes
``bench/results/families.json``:

    python bench/families.py [--parts swa,moe] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from radixrt import Engine, SamplingParams
from radixrt.testing import make_tiny_model, output_bits

RESULTS = Path(__file__).parent / "results"


def model_dir(name: str) -> Path:
    root = os.environ.get("RADIXRT_CACHE_DIR") or os.path.expanduser("~/.cache/radixrt")
    return Path(root) / "bench-families" / name


def tiny(name: str, arch: str, **sizes) -> str:
    path = model_dir(name)
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch, **sizes)
    return str(path)


def swa_workload(args) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(args.groups):
        prefix = [rng.randrange(3, 2048) for _ in range(args.prefix)]
        for _ in range(args.questions):
            prompts.append(prefix + [rng.randrange(3, 2048) for _ in range(args.question)])
    return prompts


def sliding_held(kv, req, hybrid: bool) -> int:
    """The sliding layers' slots ``req`` holds: its private SWA slots and the window it locks in
    the tree (with every token kept: its whole sequence)."""
    if not hybrid:
        return req.kv_len
    row = kv.pool.req_to_token[req.row]
    private = int((kv.allocator.translate(row[req.prefix_len : req.kv_len]) != 0).sum())
    start = max(req.swa_released, req.prefix_len - kv.window)  # where its window lock begins
    locked = max(0, req.prefix_len - start)
    return private + locked


def run_swa(path: str, prompts, args, hybrid: bool) -> dict:
    sp = SamplingParams(max_new_tokens=args.out, temperature=0, ignore_eos=True)
    with Engine(
        model=path,
        dtype=args.dtype,
        max_total_tokens=args.slots,
        disable_hybrid_swa_memory=not hybrid,
        max_prefill_step_ms=0,  # token budgets only: the same steps in both runs
    ) as eng:
        # a warm-up round: the process's heap grows to the workload once (and the heap
        # collapser turns the growth into huge pages) before the timed round
        eng.generate(input_ids=prompts, sampling_params=sp)
        eng.flush_cache()
        t0 = time.perf_counter()
        reqs = [eng.add_request(p, sp) for p in prompts]
        held = []
        while not all(r.finished for r in reqs):
            eng.step()
            kv = eng.scheduler.kv
            held += [sliding_held(kv, r, hybrid) for r in kv.running.values() if r.output_ids]
        wall = time.perf_counter() - t0
        eng.check_memory()
        stats = eng.stats()
        outs = [output_bits(eng.make_output(r)) for r in reqs]
        pool = eng.runner.pool
    return {
        "hybrid": hybrid,
        "wall_s": wall,
        "hit_rate": stats["hit_rate"],
        "sliding_slots_per_request": max(held),
        "pool_bytes": pool.kv_bytes() if hasattr(pool, "kv_bytes") else None,
        "outputs": outs,
    }


def swa_part(args) -> dict:
    path = tiny(
        f"gemma3-{args.layers}x{args.hidden}-w{args.window}",
        "gemma3_text",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=2 * (args.prefix + args.question + args.out),
        sliding_window=args.window,
        sliding_window_pattern=args.pattern,
    )
    prompts = swa_workload(args)
    run_swa(path, prompts[:2], args, True)  # the first start measures the kernels
    hybrid, dense = run_swa(path, prompts, args, True), run_swa(path, prompts, args, False)
    seq = args.prefix + args.question + args.out
    ratio = hybrid["sliding_slots_per_request"] / seq  # a request's dense KV spans seq tokens
    same = hybrid.pop("outputs") == dense.pop("outputs")
    return {
        "hybrid": hybrid,
        "dense": dense,
        "window_over_length": args.window / seq,
        "sliding_kv_ratio": ratio,
        "same_outputs": same,
        "pass_memory": ratio <= args.window / seq,
        "pass_hit_rate": abs(hybrid["hit_rate"] - dense["hit_rate"]) < 1e-9,
    }


def decode_rate(path: str, args, batch: int) -> float:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2048) for _ in range(args.moe_prompt)] for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=args.moe_out, temperature=0, ignore_eos=True)
    with Engine(model=path, dtype=args.dtype, max_total_tokens=args.slots) as eng:
        eng.generate(input_ids=prompts[:1], sampling_params=sp)  # warm-up
        best = 0.0
        for _ in range(args.repeats):
            eng.flush_cache()
            reqs = [eng.add_request(p, sp) for p in prompts]
            while not all(r.output_ids for r in reqs):
                eng.step()
            t0 = time.perf_counter()
            while not all(r.finished for r in reqs):
                eng.step()
            tokens = sum(len(r.output_ids) - 1 for r in reqs)
            best = max(best, tokens / (time.perf_counter() - t0))
    return best


def moe_part(args) -> dict:
    common = dict(num_layers=args.layers, hidden_size=args.hidden, num_heads=8, num_kv_heads=4)
    moe = tiny(
        f"qwen3moe-{args.layers}x{args.hidden}-e{args.experts}k{args.top_k}i{args.expert_width}",
        "qwen3_moe",
        intermediate_size=4 * args.expert_width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width,
        **common,
    )
    dense = tiny(
        f"qwen3-{args.layers}x{args.hidden}-i{args.top_k * args.expert_width}",
        "qwen3",
        intermediate_size=args.top_k * args.expert_width,
        **common,
    )
    rates = {}
    for batch in args.batch:
        r = {
            "moe": decode_rate(moe, args, batch),
            "dense_same_active": decode_rate(dense, args, batch),
        }
        r["ratio"] = r["moe"] / r["dense_same_active"]
        r["pass"] = r["ratio"] >= 0.8
        rates[batch] = r
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="swa,moe")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--pattern", type=int, default=4, help="one full layer in this many")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--out", type=int, default=32)
    p.add_argument("--slots", type=int, default=65536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16], help="requests decoding")
    p.add_argument("--moe-prompt", type=int, default=128)
    p.add_argument("--moe-out", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    parts = args.parts.split(",")
    result = {"cpu": platform.processor() or platform.machine(), "args": vars(args)}
    if "swa" in parts:
        result["swa"] = swa = swa_part(args)
        h, d = swa["hybrid"], swa["dense"]
        print("| sliding layers' KV | slots per running request | hit rate | wall s |")
        print("|---|---|---|---|")
        for name, r in (("own pool (window)", h), ("every token", d)):
            print(
                f"| {name} | {r['sliding_slots_per_request']:.0f} | {r['hit_rate']:.6f} | "
                f"{r['wall_s']:.2f} |"
            )
        print(
            f"sliding KV per request / L {swa['sliding_kv_ratio']:.4f} (target <= W/L = "
            f"{swa['window_over_length']:.4f}): {'PASS' if swa['pass_memory'] else 'FAIL'}; "
            f"hit rates equal: {'PASS' if swa['pass_hit_rate'] else 'FAIL'}; "
            f"same outputs: {swa['same_outputs']}"
        )
    if "moe" in parts:
        result["moe"] = moe_part(args)
        for batch, moe in result["moe"].items():
            print(
                f"{batch} decoding: MoE {moe['moe']:.1f} tok/s, dense of the same active size "
                f"{moe['dense_same_active']:.1f} tok/s: {moe['ratio']:.2f}x (target >= 0.8): "
                f"{'PASS' if moe['pass'] else 'FAIL'}"
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "families.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {RESULTS / 'families.json'}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
