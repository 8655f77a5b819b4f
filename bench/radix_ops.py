"""Radix cache micro-benchmark: per-op cost on a shared-prefix trace, and evict scaling.

Part 1 replays a seeded serving trace through RadixCache + KVSlotAllocator
alone (no model): G groups share an S-token system prompt; each of the G × R
requests adds a unique U-token suffix (± 25 %) and generates O output tokens
(± 25 %). The pool holds a quarter of the unique tokens, so eviction runs
often. Requests arrive in a shuffled order; C run at a time, round-robin
decoding one token each per step (the life cycle of radixrt.scheduler.kv):

    match_prefix → lock → alloc suffix (evict when short) → decode:
    alloc_extend per token (evict when short) → insert → free the duplicate
    and unaligned-tail slots → unlock

Every request's token list is made at admission from a numpy array, so it
holds fresh int objects (as a tokenizer's output does) and key comparisons
cannot take CPython's identity shortcut. radixrt, like its scheduler, then
copies the prompt into an int64 TokenBuffer (row "ids at admit") that the
tree reads with memcpy, and at finish appends the generated tokens to it
(row "ids at finish"); the baseline hands its lists to the tree as they
are. Row "ids+match+insert" sums these costs per request, for both (this
trace matches and inserts once per request; the scheduler, which also
caches after prefill and re-matches after each insert, reads each buffer
more often). Each cache call is timed on its own,
in place in the trace (so with the CPU caches as the surrounding work leaves
them), as thread CPU time (time.thread_time_ns, less its own overhead; or
wall time with --clock wall): the machines this runs on are shared, and CPU
time leaves out the waits for other processes. The trace runs --repeat
times; the table shows the best mean of the repeats and the median call
over all of them.

Part 2 times evict as the tree grows: a tree of N leaves (random short keys
under a few shared prefixes), then many evict(1) calls, each followed by an
untimed insert of a new leaf so the tree stays at N leaves; evict(1) stops
after its first leaf, so per call = per leaf. It must not grow with N. The
"py calls" column counts Python function calls per evict (under cProfile,
on 200 more calls): the work per call, free of timing noise; time still
creeps up a little as the tree outgrows the CPU caches.

Both parts also run a *baseline*: the algorithm of SGLang's Python
RadixCache re-implemented here (token-by-token key compare, evict collects
every leaf and heapifies them on each call, a torch free list that
concatenates on free), to compare on the same machine; the issue's quoted
SGLang figures are printed too. Before each timed phase the heap is
collected and frozen (gc.freeze), so one implementation's garbage does not
land on the other's clock; the cache's own garbage (evicted nodes) still
counts.

    python bench/radix_ops.py            # full defaults (64 × 16, 2048-token prompts)
    python bench/radix_ops.py --quick    # small run (seconds)
Writes bench/results/radix_ops.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import heapq
import json
import platform
import random
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from radixrt.cache import KVSlotAllocator, RadixCache, TokenBuffer, check_slot_partition

RESULTS = Path(__file__).parent / "results"
VOCAB = 32000
OPS = ("match", "insert", "lock", "unlock", "evict", "alloc", "free", "ids_admit", "ids_finish")
COUNTED_CALLS = 200  # part 2: evict calls run under cProfile to count Python calls

# SGLang's Python RadixCache on this trace, as quoted in the issue (µs).
SGLANG_US = {"match": 41.0, "evict": 47.0, "evict_call_100k_leaves": 74_000.0}


CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}


class Timer:
    """Per-call samples of one op (ns), less the clock's own overhead."""

    clock = staticmethod(time.thread_time_ns)
    overhead = 0

    @classmethod
    def use(cls, name: str) -> None:
        cls.clock = staticmethod(CLOCKS[name])
        xs = []
        for _ in range(5000):
            t0 = cls.clock()
            xs.append(cls.clock() - t0)
        cls.overhead = sorted(xs)[len(xs) // 2]

    def __init__(self) -> None:
        self.samples: list[int] = []

    def add(self, dt: int) -> None:
        self.samples.append(max(0, dt - self.overhead))

    @property
    def calls(self) -> int:
        return len(self.samples)

    def us(self, per: int | None = None) -> float:
        """Mean µs per call (or per ``per`` units of work)."""
        n = self.calls if per is None else per
        return sum(self.samples) / 1e3 / n if n else float("nan")

    def pct(self, q: float) -> float:
        """q-quantile of the per-call time, µs."""
        if not self.samples:
            return float("nan")
        xs = sorted(self.samples)
        return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3


def count_nodes(cache) -> int:
    n, stack = 0, [cache.root]
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n - 1


def fresh(ids) -> list[int]:
    """The same token ids as new int objects (like a tokenizer's output)."""
    return np.asarray(ids, dtype=np.int64).tolist()


# ----------------------------------------------------------------- baseline


class BaselineAllocator:
    """Torch free list: alloc slices the head, free concatenates (page_size 1)."""

    def __init__(self, num_slots: int) -> None:
        self.capacity = num_slots - 1
        self.free_slots = torch.arange(1, num_slots, dtype=torch.int64)

    @property
    def available(self) -> int:
        return self.free_slots.numel()

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.free_slots.numel():
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def alloc_extend(self, n: int, last_slot: int) -> torch.Tensor | None:
        return self.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.free_slots = torch.cat((self.free_slots, slots))


class _BaseNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self) -> None:
        self.children: dict[int, _BaseNode] = {}
        self.parent: _BaseNode | None = None
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access = time.monotonic()

    def __lt__(self, other: _BaseNode) -> bool:
        return self.last_access < other.last_access


class BaselineRadixCache:
    """SGLang's Python RadixCache algorithm (page_size 1, LRU), written here for comparison."""

    def __init__(self, allocator: BaselineAllocator) -> None:
        self.allocator = allocator
        self.root = _BaseNode()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    @staticmethod
    def _key_match(a: list[int], b: list[int]) -> int:
        i = 0
        for x, y in zip(a, b):
            if x != y:
                break
            i += 1
        return i

    def match_prefix(self, key: list[int]):
        node, values = self.root, []
        node.last_access = time.monotonic()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = time.monotonic()
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        kv = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return kv.numel(), kv, node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        node, total = self.root, 0
        node.last_access = time.monotonic()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = time.monotonic()
            n = self._key_match(child.key, key)
            total += n
            key, value = key[n:], value[n:]
            node = self._split(child, n) if n < len(child.key) else child
        if key:
            leaf = _BaseNode()
            leaf.parent, leaf.key, leaf.value = node, key, value.clone()
            node.children[key[0]] = leaf
            self.evictable_size += len(key)
        return total

    def _split(self, child: _BaseNode, n: int) -> _BaseNode:
        new = _BaseNode()
        new.parent, new.key, new.value = child.parent, child.key[:n], child.value[:n]
        new.lock_ref = child.lock_ref
        new.children = {child.key[n]: child}
        new.parent.children[child.key[0]] = new
        child.parent, child.key, child.value = new, child.key[n:], child.value[n:]
        return new

    def lock(self, node: _BaseNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _BaseNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                leaves.append(node)
            stack.extend(node.children.values())
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            x = heapq.heappop(leaves)
            if x is self.root:
                break
            if x.lock_ref > 0:
                continue
            self.allocator.free(x.value)
            freed += len(x.key)
            self.evictable_size -= len(x.key)
            parent = x.parent
            del parent.children[x.key[0]]
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed


# ------------------------------------------------------------------ part 1


def make_trace(
    groups: int, per_group: int, system: int, suffix: int, output: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, output) token ids per request, in arrival order."""
    rng = random.Random(seed)

    def jitter(n: int) -> int:
        return max(1, rng.randint(n - n // 4, n + n // 4))

    reqs = []
    for _ in range(groups):
        sys_ids = [rng.randrange(VOCAB) for _ in range(system)]
        for _ in range(per_group):
            prompt = sys_ids + [rng.randrange(VOCAB) for _ in range(jitter(suffix))]
            out = [rng.randrange(VOCAB) for _ in range(jitter(output))]
            reqs.append((np.array(prompt, dtype=np.int64), np.array(out, dtype=np.int64)))
    rng.shuffle(reqs)
    return reqs


def pool_slots(trace, args) -> tuple[int, int]:
    """(unique tokens, num_slots): a quarter of the unique tokens, room for a full batch."""
    p = args.page_size
    unique = args.groups * args.system + sum(len(pr) - args.system + len(o) for pr, o in trace)
    longest = max(len(pr) + len(o) for pr, o in trace)
    pool = max(-(-unique // args.pool_fraction), (args.concurrency + 1) * longest)
    return unique, (-(-pool // p) + 1) * p


class Running:
    __slots__ = ("tokens", "ids", "out", "slots", "hit", "node")

    def __init__(self, tokens, ids, out, slots, hit, node):
        self.tokens, self.ids, self.out, self.slots, self.hit, self.node = (
            tokens,
            ids,
            out,
            slots,
            hit,
            node,
        )


def run_trace(impl: str, trace, args) -> dict:
    p = args.page_size
    unique, num_slots = pool_slots(trace, args)
    if impl == "radixrt":
        alloc = KVSlotAllocator(num_slots, p)
        cache = RadixCache(alloc, p, eviction_policy=args.policy)
    else:
        alloc = BaselineAllocator(num_slots)
        cache = BaselineRadixCache(alloc)
    t = {k: Timer() for k in OPS}
    stats = {
        "evicted_leaves": 0,
        "evicted_tokens": 0,
        "hit_tokens": 0,
        "prompt_tokens": 0,
        "deferred": 0,
        "max_tree_nodes": 0,
    }
    clock = Timer.clock

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

    def admit(prompt_ids: np.ndarray, out_ids: np.ndarray) -> Running | None:
        # The request's token lists are made now, as a tokenizer would: fresh
        # int objects, warm in cache (the tree's keys are whatever is left).
        prompt, out = prompt_ids.tolist(), out_ids.tolist()
        ids = None
        if impl == "radixrt":  # what radixrt's scheduler hands the tree
            t0 = clock()
            ids = TokenBuffer(prompt, capacity=len(prompt) + len(out))
            t["ids_admit"].add(clock() - t0)
        t0 = clock()
        hit, kv, node = cache.match_prefix(prompt if ids is None else ids.array)
        t["match"].add(clock() - t0)
        t0 = clock()
        cache.lock(node)
        t["lock"].add(clock() - t0)
        own = alloc_slots(len(prompt) - hit, int(kv[-1]) if hit else -1)
        if own is None:  # too little memory now: wait for running requests to finish
            t0 = clock()
            cache.unlock(node)
            t["unlock"].add(clock() - t0)
            stats["deferred"] += 1
            return None
        stats["hit_tokens"] += hit
        stats["prompt_tokens"] += len(prompt)
        return Running(list(prompt), ids, deque(out), torch.cat([kv, own]), hit, node)

    def finish(r: Running) -> None:
        key = r.tokens
        if r.ids is not None:
            t0 = clock()
            r.ids.extend(r.tokens[len(r.ids) :])
            t["ids_finish"].add(clock() - t0)
            key = r.ids.array
        t0 = clock()
        cached = cache.insert(key, r.slots)
        t["insert"].add(clock() - t0)
        aligned = len(r.tokens) // p * p
        free(torch.cat([r.slots[r.hit : cached], r.slots[aligned:]]))
        t0 = clock()
        cache.unlock(r.node)
        t["unlock"].add(clock() - t0)

    gc.collect()
    gc.freeze()
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
    gc.unfreeze()
    assert cache.protected_size == 0
    assert alloc.available + cache.evictable_size == alloc.capacity
    if impl == "radixrt":
        check_slot_partition(alloc, cache, [])
    return {
        "impl": impl,
        "num_slots": num_slots,
        "unique_tokens": unique,
        "requests": len(trace),
        "wall_s": wall,
        "hit_rate": stats["hit_tokens"] / max(1, stats["prompt_tokens"]),
        **stats,
        "timers": t,
    }


def summarize(runs: list[dict]) -> dict:
    """Best mean of the repeats and the median over all calls, per op."""
    out = {}
    for name in OPS:
        timers = [r["timers"][name] for r in runs]
        if not timers[0].calls:
            continue
        allsamples = Timer()
        for tm in timers:
            allsamples.samples += tm.samples
        best = min(tm.us() for tm in timers)
        out[name] = {
            "calls": timers[0].calls,
            "us_per_op": best,
            "ops_per_s": 1e6 / best,
            "p50_us": allsamples.pct(0.5),
            "p90_us": allsamples.pct(0.9),
        }
    leaves = runs[0]["evicted_leaves"]
    if "evict" in out and leaves:
        per_leaf = min(r["timers"]["evict"].us(leaves) for r in runs)
        out["evict_leaf"] = {"calls": leaves, "us_per_op": per_leaf, "ops_per_s": 1e6 / per_leaf}
    info = {k: v for k, v in runs[0].items() if k != "timers"}
    info["wall_s"] = min(r["wall_s"] for r in runs)
    return {"info": info, "ops": out}


def request_key_us(summary: dict) -> float:
    """Mean µs per request of key conversion + match + insert (all calls / requests)."""
    ops, requests = summary["ops"], summary["info"]["requests"]
    names = ("ids_admit", "ids_finish", "match", "insert")
    return sum(ops[k]["us_per_op"] * ops[k]["calls"] for k in names if k in ops) / requests


# ------------------------------------------------------------------ part 2


def run_scaling(impl: str, leaves: int, calls: int, page_size: int, seed: int, policy: str) -> dict:
    rng = random.Random(seed)
    p = page_size
    prefix_len, key_len, num_prefixes = 16 * p, 4 * p, 8
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    num_slots = ((leaves + calls + 2) * key_len + num_prefixes * prefix_len) // p * p + 2 * p
    if impl == "radixrt":
        alloc = KVSlotAllocator(num_slots, p)
        cache = RadixCache(alloc, p, eviction_policy=policy)
    else:
        alloc = BaselineAllocator(num_slots)
        cache = BaselineRadixCache(alloc)

    def new_key() -> list[int]:
        return fresh(rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(key_len)])

    def add(key: list[int]):
        slots = alloc.alloc(len(key))
        t0 = Timer.clock()
        cached = cache.insert(key, slots)
        dt = Timer.clock() - t0
        alloc.free(slots[:cached])
        return dt

    t0 = time.perf_counter()
    keys = [new_key() for _ in range(leaves)]
    for k in keys:
        add(k)
    build_s = time.perf_counter() - t0
    # Touch a random half so LRU order is not insertion order.
    for k in rng.sample(keys, leaves // 2):
        cache.match_prefix(fresh(k))
    probes = [fresh(rng.choice(keys)) for _ in range(calls)]
    counted = COUNTED_CALLS if impl == "radixrt" else 0
    new_keys = [new_key() for _ in range(calls + counted)]

    gc.collect()
    gc.freeze()
    clock = Timer.clock
    ev, mt, it = Timer(), Timer(), Timer()
    evicted_tokens = 0
    for i in range(calls):
        t0 = clock()
        evicted_tokens += cache.evict(1)
        ev.add(clock() - t0)
        t0 = clock()
        cache.match_prefix(probes[i])
        mt.add(clock() - t0)
        it.add(add(new_keys[i]))
    gc.unfreeze()
    # Python function calls per evict: a noise-free measure of the work per
    # call (time also grows with cache misses as the tree outgrows the caches).
    prof = cProfile.Profile()
    for i in range(calls, calls + counted):
        prof.enable()
        evicted_tokens += cache.evict(1)
        prof.disable()
        add(new_keys[i])
    py_calls = sum(st.callcount for st in prof.getstats()) / counted if counted else None
    # evict(1) stops after its first leaf: one leaf per call (a leaf may be
    # shorter than key_len where two random keys share tokens).
    assert 0 < evicted_tokens <= (calls + counted) * key_len
    return {
        "impl": impl,
        "leaves": leaves,
        "calls": calls,
        "build_s": build_s,
        "py_calls_per_evict": py_calls,
        "evict_us_per_call": ev.us(),
        "evict_p50_us": ev.pct(0.5),
        "match_us": mt.us(),
        "insert_us": it.us(),
    }


# --------------------------------------------------------------------- main


def fmt(x: float | None, w: int, prec: int = 1) -> str:
    return f"{'-':>{w}}" if x is None or x != x else f"{x:>{w}.{prec}f}"


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
    ap.add_argument("--repeat", type=int, default=3, help="trace repeats (best mean is shown)")
    ap.add_argument("--leaves", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--evict-calls", type=int, default=2000)
    ap.add_argument(
        "--baseline-evict-work",
        type=int,
        default=2_000_000,
        help="baseline evict calls at N leaves: min(--evict-calls, this / N)",
    )
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument(
        "--clock",
        default="thread",
        choices=sorted(CLOCKS),
        help="thread CPU time (default; robust on shared machines) or wall time",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small run (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS / "radix_ops.json")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.per_group, args.system, args.concurrency = 16, 8, 512, 4
        args.leaves, args.evict_calls, args.repeat = [1_000, 10_000], 500, 1
    baseline = not args.no_baseline and args.page_size == 1 and args.policy == "lru"
    torch.set_num_threads(1)
    Timer.use(args.clock)

    trace = make_trace(
        args.groups, args.per_group, args.system, args.suffix, args.output, args.seed
    )
    ours = summarize([run_trace("radixrt", trace, args) for _ in range(args.repeat)])
    base = (
        summarize([run_trace("baseline", trace, args) for _ in range(args.repeat)])
        if baseline
        else None
    )
    info = ours["info"]
    print(
        f"part 1: {args.groups} groups x {args.per_group} requests, system {args.system}, "
        f"suffix ~{args.suffix}, output ~{args.output}; page_size {args.page_size}, "
        f"{args.policy}, concurrency {args.concurrency}, best of {args.repeat}"
    )
    print(
        f"pool {info['num_slots']} slots for {info['unique_tokens']} unique tokens; "
        f"hit rate {info['hit_rate']:.1%}; {info['evicted_tokens']} tokens evicted in "
        f"{ours['ops']['evict']['calls']} calls ({info['evicted_leaves']} leaves); "
        f"max tree nodes {info['max_tree_nodes']}; wall {info['wall_s']:.2f}s"
    )
    head = (
        f"{'op':<17}{'calls':>7}{'us/op':>8}{'p50 us':>8}{'ops/s':>10}"
        f"{'base us':>9}{'x base':>8}{'SGLang us':>10}{'x SGLang':>9}"
    )
    print(head)
    names = [
        ("match", "match"),
        ("insert", "insert"),
        ("lock", "lock"),
        ("unlock", "unlock"),
        ("evict (per call)", "evict"),
        ("evict (per leaf)", "evict_leaf"),
        ("alloc.alloc", "alloc"),
        ("alloc.free", "free"),
        ("ids at admit", "ids_admit"),
        ("ids at finish", "ids_finish"),
    ]
    quoted = {
        "match": SGLANG_US["match"],
        "evict": SGLANG_US["evict"],
        "evict_leaf": SGLANG_US["evict"],
    }
    for label, key in names:
        o = ours["ops"].get(key)
        if o is None:
            continue
        b = base["ops"].get(key) if base else None
        bus = b["us_per_op"] if b else None
        q = quoted.get(key)
        print(
            f"{label:<17}{o['calls']:>7}{fmt(o['us_per_op'], 8, 2)}{fmt(o.get('p50_us'), 8, 2)}"
            f"{o['ops_per_s']:>10.0f}{fmt(bus, 9)}{fmt(bus / o['us_per_op'] if bus else None, 7)}x"
            f"{fmt(q, 10)}{fmt(q / o['us_per_op'] if q else None, 8)}x"
        )
    per_req = request_key_us(ours)
    base_req = request_key_us(base) if base else None
    print(
        f"{'ids+match+insert':<17}{info['requests']:>7}{fmt(per_req, 8, 2)}{'-':>8}{'-':>10}"
        f"{fmt(base_req, 9)}{fmt(base_req / per_req if base_req else None, 7)}x   (per request)"
    )
    if base:
        bi = base["info"]
        print(
            f"baseline: hit rate {bi['hit_rate']:.1%}, {bi['evicted_tokens']} tokens evicted "
            f"in {base['ops']['evict']['calls']} calls; wall {bi['wall_s']:.2f}s"
        )

    print(f"\npart 2: evict(1) per call (= per leaf) vs tree size; {args.evict_calls} calls each")
    print(
        f"{'leaves':>8}{'build s':>9}{'evict us':>10}{'p50 us':>8}{'py calls':>9}"
        f"{'match us':>10}{'insert us':>11}{'base evict us':>15}{'x base':>8}"
    )
    scaling = []
    for n in args.leaves:
        r = run_scaling("radixrt", n, args.evict_calls, args.page_size, args.seed, args.policy)
        if baseline:
            bcalls = max(5, min(args.evict_calls, args.baseline_evict_work // n))
            r["baseline"] = run_scaling("baseline", n, bcalls, 1, args.seed, "lru")
        scaling.append(r)
        bev = r["baseline"]["evict_us_per_call"] if baseline else None
        print(
            f"{n:>8}{r['build_s']:>9.2f}{r['evict_us_per_call']:>10.2f}{r['evict_p50_us']:>8.2f}"
            f"{r['py_calls_per_evict']:>9.1f}{r['match_us']:>10.2f}{r['insert_us']:>11.2f}"
            f"{fmt(bev, 15)}"
            f"{fmt(bev / r['evict_us_per_call'] if bev else None, 7, 0)}x"
        )
    growth = scaling[-1]["evict_us_per_call"] / scaling[0]["evict_us_per_call"]
    growth_p50 = scaling[-1]["evict_p50_us"] / scaling[0]["evict_p50_us"]
    print(
        f"evict per call at {scaling[-1]['leaves']} vs {scaling[0]['leaves']} leaves: "
        f"{growth:.2f}x mean, {growth_p50:.2f}x median"
    )
    if scaling[-1]["leaves"] >= 100_000:
        ref = SGLANG_US["evict_call_100k_leaves"]
        us = scaling[-1]["evict_us_per_call"]
        print(
            f"quoted SGLang at 100k leaves: {ref / 1e3:.0f} ms per evict call; here {us:.1f} us "
            f"({ref / us:.0f}x)"
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {
        "config": cfg,
        "trace": ours,
        "trace_baseline": base,
        "scaling": scaling,
        "evict_growth": growth,
        "evict_growth_p50": growth_p50,
        "sglang_quoted_us": SGLANG_US,
        "clock": args.clock,
        "clock_overhead_ns": Timer.overhead,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
