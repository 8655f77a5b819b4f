"""Radix cache micro-benchmark: per-op cost on a shared-prefix trace, and evict scaling.

Part 1 replays a seeded serving trace through RadixCache + KVSlotAllocator
alone (no model): G groups share an S-token system prompt; each of the G × R
requests adds a unique U-token suffix (± 25 %) and generates O output tokens
(± 25 %). The pool holds a quarter of the unique tokens, so eviction runs
often. Requests arrive in a shuffled order; C run at a time, round-robin
decoding one token each per step (the scheduler life cycle of
radixrt.scheduler.kv):

    match_prefix → lock → alloc suffix (evict when short) → decode:
    alloc_extend per token (evict when short) → insert → free the duplicate
    and unaligned-tail slots → unlock

Each cache call is timed on its own (perf_counter_ns).

Part 2 times evict as the tree grows: a tree of N leaves (random short keys
under a few shared prefixes), then many evict(1) calls, each followed by an
untimed insert of a new leaf so the tree stays at N leaves. The per-call
cost must not grow with N.

    python bench/radix_ops.py            # full defaults (64 × 16, 2048-token prompts)
    python bench/radix_ops.py --quick    # small run
Writes bench/results/radix_ops.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from collections import deque
from pathlib import Path

import torch

from radixrt.cache import KVSlotAllocator, RadixCache, check_slot_partition

RESULTS = Path(__file__).parent / "results"
VOCAB = 32000

# SGLang's Python RadixCache on the same trace (from the issue), in µs.
SGLANG_US = {"match": 41.0, "evict": 47.0, "evict_call_100k_leaves": 74_000.0}


class Timer:
    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def add(self, dt: int) -> None:
        self.ns += dt
        self.calls += 1

    def us(self, per: int | None = None) -> float:
        n = self.calls if per is None else per
        return self.ns / 1e3 / n if n else float("nan")


def count_nodes(cache: RadixCache) -> int:
    n, stack = 0, [cache.root]
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n - 1


# ------------------------------------------------------------------ part 1


def make_trace(groups: int, per_group: int, system: int, suffix: int, output: int,
               seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)

    def jitter(n: int) -> int:
        return max(1, rng.randint(n - n // 4, n + n // 4))

    reqs = []
    for _ in range(groups):
        sys_ids = [rng.randrange(VOCAB) for _ in range(system)]
        for _ in range(per_group):
            prompt = sys_ids + [rng.randrange(VOCAB) for _ in range(jitter(suffix))]
            out = [rng.randrange(VOCAB) for _ in range(jitter(output))]
            reqs.append((prompt, out))
    rng.shuffle(reqs)
    return reqs


class Running:
    __slots__ = ("tokens", "out", "slots", "hit", "node")

    def __init__(self, tokens, out, slots, hit, node):
        self.tokens, self.out, self.slots, self.hit, self.node = tokens, out, slots, hit, node


def run_trace(args) -> dict:
    p = args.page_size
    trace = make_trace(args.groups, args.per_group, args.system, args.suffix, args.output,
                       args.seed)
    unique = args.groups * args.system + sum(len(pr) - args.system + len(o) for pr, o in trace)
    # A quarter of the unique tokens, but room for a full running batch at least.
    longest = max(len(pr) + len(o) for pr, o in trace)
    pool = max(-(-unique // args.pool_fraction), (args.concurrency + 1) * longest)
    num_slots = (-(-pool // p) + 1) * p
    alloc = KVSlotAllocator(num_slots, p)
    cache = RadixCache(alloc, p, eviction_policy=args.policy)
    t = {k: Timer() for k in ("match", "insert", "evict", "lock", "unlock", "alloc", "free")}
    stats = {"evicted_leaves": 0, "evicted_tokens": 0, "hit_tokens": 0, "prompt_tokens": 0,
             "deferred": 0, "max_tree_nodes": 0}
    clock = time.perf_counter_ns

    def alloc_slots(n: int, last: int):
        t0 = clock()
        s = alloc.alloc_extend(n, last)
        t["alloc"].add(clock() - t0)
        if s is not None:
            return s
        need = -(-n // p) * p - alloc.available
        nodes = count_nodes(cache)
        t0 = clock()
        freed = cache.evict(need)
        t["evict"].add(clock() - t0)
        stats["max_tree_nodes"] = max(stats["max_tree_nodes"], nodes)
        stats["evicted_leaves"] += nodes - count_nodes(cache)
        stats["evicted_tokens"] += freed
        t0 = clock()
        s = alloc.alloc_extend(n, last)
        t["alloc"].add(clock() - t0)
        return s

    def free(slots: torch.Tensor) -> None:
        if slots.numel():
            t0 = clock()
            alloc.free(slots)
            t["free"].add(clock() - t0)

    def admit(prompt, out) -> Running | None:
        t0 = clock()
        m = cache.match_prefix(prompt)
        t["match"].add(clock() - t0)
        t0 = clock()
        cache.lock(m.last_node)
        t["lock"].add(clock() - t0)
        own = alloc_slots(len(prompt) - m.hit_len, int(m.kv_indices[-1]) if m.hit_len else -1)
        if own is None:  # too little memory now: wait for running requests to finish
            t0 = clock()
            cache.unlock(m.last_node)
            t["unlock"].add(clock() - t0)
            stats["deferred"] += 1
            return None
        stats["hit_tokens"] += m.hit_len
        stats["prompt_tokens"] += len(prompt)
        return Running(list(prompt), deque(out), torch.cat([m.kv_indices, own]), m.hit_len,
                       m.last_node)

    def finish(r: Running) -> None:
        t0 = clock()
        cached = cache.insert(r.tokens, r.slots)
        t["insert"].add(clock() - t0)
        aligned = len(r.tokens) // p * p
        free(torch.cat([r.slots[r.hit:cached], r.slots[aligned:]]))
        t0 = clock()
        cache.unlock(r.node)
        t["unlock"].add(clock() - t0)

    queue = deque(trace)
    running: list[Running] = []
    wall0 = time.perf_counter()
    while queue or running:
        while queue and len(running) < args.concurrency:
            r = admit(*queue[0])
            if r is None:
                if not running:
                    raise RuntimeError("pool too small for a single request")
                break
            queue.popleft()
            running.append(r)
        still = []
        for r in running:  # one decode step for every running request
            s = alloc_slots(1, int(r.slots[-1]))
            if s is None:
                raise RuntimeError("pool too small for the running batch")
            r.slots = torch.cat([r.slots, s])
            r.tokens.append(r.out.popleft())
            if r.out:
                still.append(r)
            else:
                finish(r)
        running = still
    wall = time.perf_counter() - wall0
    check_slot_partition(alloc, cache, [])
    assert cache.protected_size == 0
    assert alloc.available + cache.evictable_size == alloc.capacity

    ops = {}
    for name in ("match", "insert", "lock", "unlock", "alloc", "free"):
        ops[name] = {"calls": t[name].calls, "us_per_op": t[name].us(),
                     "ops_per_s": 1e6 / t[name].us() if t[name].calls else 0.0}
    ev = t["evict"]
    ops["evict"] = {"calls": ev.calls, "us_per_op": ev.us(), "ops_per_s": 1e6 / ev.us(),
                    "leaves": stats["evicted_leaves"],
                    "us_per_leaf": ev.us(stats["evicted_leaves"]),
                    "leaves_per_s": 1e6 / ev.us(stats["evicted_leaves"])}
    return {"num_slots": num_slots, "unique_tokens": unique, "requests": len(trace),
            "wall_s": wall, "hit_rate": stats["hit_tokens"] / max(1, stats["prompt_tokens"]),
            "evicted_tokens": stats["evicted_tokens"], "deferred": stats["deferred"],
            "max_tree_nodes": stats["max_tree_nodes"], "ops": ops}


# ------------------------------------------------------------------ part 2


def run_scaling(leaves: int, calls: int, page_size: int, seed: int, policy: str) -> dict:
    rng = random.Random(seed)
    p = page_size
    prefix_len, key_len, num_prefixes = 16 * p, 4 * p, 8
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    num_slots = ((leaves + calls + 2) * key_len + num_prefixes * prefix_len) // p * p + 2 * p
    alloc = KVSlotAllocator(num_slots, p)
    cache = RadixCache(alloc, p, eviction_policy=policy)

    def new_key() -> list[int]:
        return rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(key_len)]

    def add(key: list[int]) -> None:
        slots = alloc.alloc(len(key))
        cached = cache.insert(key, slots)
        alloc.free(slots[:cached])

    t0 = time.perf_counter()
    keys = [new_key() for _ in range(leaves)]
    for k in keys:
        add(k)
    build_s = time.perf_counter() - t0
    assert cache.num_evictable_leaves == leaves, cache.num_evictable_leaves
    # Touch a random half so LRU order is not insertion order.
    for k in rng.sample(keys, leaves // 2):
        cache.match_prefix(k)

    fresh = [new_key() for _ in range(calls)]
    probes = [rng.choice(keys) for _ in range(calls)]
    clock = time.perf_counter_ns
    ev = Timer()
    mt = Timer()
    it = Timer()
    evicted_tokens = 0
    for i in range(calls):
        t0 = clock()
        evicted_tokens += cache.evict(1)
        ev.add(clock() - t0)
        t0 = clock()
        cache.match_prefix(probes[i])
        mt.add(clock() - t0)
        slots = alloc.alloc(len(fresh[i]))
        t0 = clock()
        cached = cache.insert(fresh[i], slots)
        it.add(clock() - t0)
        alloc.free(slots[:cached])
    # evict(1) stops after its first node, so each call evicts exactly one leaf
    # (a leaf may be shorter than key_len where two random keys share tokens).
    assert 0 < evicted_tokens <= calls * key_len
    return {"leaves": leaves, "leaves_at_end": cache.num_evictable_leaves, "calls": calls,
            "build_s": build_s,
            "evict_us_per_call": ev.us(), "evict_us_per_leaf": ev.us(),
            "match_us": mt.us(), "insert_us": it.us()}


# --------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool-fraction", type=int, default=4, help="pool = unique tokens / this")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    ap.add_argument("--leaves", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--evict-calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small run (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS / "radix_ops.json")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.per_group, args.system, args.concurrency = 16, 8, 512, 4
        args.leaves, args.evict_calls = [1_000, 10_000], 500
    torch.set_num_threads(1)

    print(f"part 1: {args.groups} groups x {args.per_group} requests, system {args.system}, "
          f"suffix ~{args.suffix}, output ~{args.output}, page_size {args.page_size}, "
          f"{args.policy}, concurrency {args.concurrency}")
    trace = run_trace(args)
    print(f"pool {trace['num_slots']} slots for {trace['unique_tokens']} unique tokens; "
          f"hit rate {trace['hit_rate']:.1%}; evicted {trace['evicted_tokens']} tokens in "
          f"{trace['ops']['evict']['calls']} calls; max tree nodes {trace['max_tree_nodes']}; "
          f"deferred admissions {trace['deferred']}; "
          f"wall {trace['wall_s']:.2f}s")
    print(f"{'op':<18}{'calls':>9}{'us/op':>10}{'ops/s':>12}{'SGLang us':>11}{'speedup':>9}")
    rows = [(n, trace["ops"][n]["calls"], trace["ops"][n]["us_per_op"], trace["ops"][n]["ops_per_s"],
             SGLANG_US.get(n)) for n in ("match", "insert", "lock", "unlock")]
    e = trace["ops"]["evict"]
    rows.append(("evict (per call)", e["calls"], e["us_per_op"], e["ops_per_s"], SGLANG_US["evict"]))
    rows.append(("evict (per leaf)", e["leaves"], e["us_per_leaf"], e["leaves_per_s"],
                 SGLANG_US["evict"]))
    rows += [(f"alloc.{n}", trace["ops"][n]["calls"], trace["ops"][n]["us_per_op"],
              trace["ops"][n]["ops_per_s"], None) for n in ("alloc", "free")]
    for name, calls, us, ops, ref in rows:
        ref_s = f"{ref:>11.1f}{ref / us:>8.1f}x" if ref else f"{'':>11}{'':>9}"
        print(f"{name:<18}{calls:>9}{us:>10.2f}{ops:>12.0f}{ref_s}")

    print(f"\npart 2: evict(1) cost vs tree size ({args.evict_calls} calls each; "
          "each call evicts one leaf)")
    print(f"{'leaves':>8}{'build s':>9}{'evict us/call':>15}{'match us':>10}{'insert us':>11}")
    scaling = []
    for n in args.leaves:
        gc.collect()
        r = run_scaling(n, args.evict_calls, args.page_size, args.seed, args.policy)
        scaling.append(r)
        print(f"{n:>8}{r['build_s']:>9.2f}{r['evict_us_per_call']:>15.2f}{r['match_us']:>10.2f}"
              f"{r['insert_us']:>11.2f}")
    growth = scaling[-1]["evict_us_per_call"] / scaling[0]["evict_us_per_call"]
    print(f"evict per call, {scaling[-1]['leaves']} vs {scaling[0]['leaves']} leaves: {growth:.2f}x")
    if scaling[-1]["leaves"] >= 100_000:
        ref = SGLANG_US["evict_call_100k_leaves"]
        print(f"SGLang at 100k leaves: {ref / 1e3:.0f} ms per evict call; "
              f"here {scaling[-1]['evict_us_per_call']:.1f} us ({ref / scaling[-1]['evict_us_per_call']:.0f}x)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"config": cfg, "trace": trace, "scaling": scaling, "evict_growth": growth,
              "sglang_reference_us": SGLANG_US, "python": platform.python_version(),
              "torch": torch.__version__, "machine": platform.machine()}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
