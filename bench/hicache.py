"""Hierarchical-cache benchmark (issue 21): a multi-turn chat workload whose working set is
about ``--pool-ratio`` (4) times the device KV pool, served with and without the tiers below
the pool, and the same workload's second half after a restart.

The workload: ``--conversations`` chats of ``--turns`` turns. Each conversation has a system
prompt of its own (``--system-len`` words) and each turn a user message (``--turn-len``
words; a word is about one token with the default model) answered with ``--max-new-tokens``
greedy tokens (``ignore_eos``); every turn sends the whole conversation so far to
/v1/chat/completions, streamed. Turns go round robin over the conversations (every
conversation's turn t before any turn t + 1), ``--max-concurrency`` at a time (default one, so
TTFT is the prefill of what the cache lacks), so a conversation's prefix was last used
``conversations - 1`` requests earlier: in a pool a quarter of the working set, LRU has
evicted it by then. The pool (``--max-total-tokens``) is the working set over
``--pool-ratio``, where the working set is every final conversation's distinct tokens,
counted with the model's tokenizer (replies stood in for by words); the measured figure is
reported beside it.

Configurations, each on ``radixrt launch`` servers of its own (the default model unless
``--model``), each with a warm-up request before it is measured:

- ``no_tiers``: the device pool only.
- ``tiers``: ``--enable-hierarchical-cache`` with a fresh ``--hicache-storage-dir`` (the host
  tier is ``--hicache-ratio`` = 2 pools by default, so storage holds the rest);
  ``--tier-args`` adds launch flags (e.g. ``--hicache-write-policy write_back``).
- ``restart``: the first half of the turns on a tiered server, which is then stopped with
  SIGTERM (it drains; its scheduler writes what the storage tier still had queued); a new
  server on the same storage directory runs the second half. The blocks the old server held
  in storage and those the new one found there are reported.

Reported per configuration, whole and per half: hit rate (cached / prompt tokens, from the
responses), prefill tokens computed (the scheduler's ``prefill_tokens`` from
/get_server_info, before and after), TTFT p50 / p99, the tokens loaded from the host and from
the storage tier, bytes loaded and seconds spent loading. Then the issue's targets: prefill
tokens computed with tiers <= 0.2 x without; TTFT p50 at least 3 x lower with tiers; the
restarted second half's hit rate within 10 % (relative) of the tiers run's second half.
Prints a Markdown table; writes bench/results/hicache.json (and .png with matplotlib).

    python bench/hicache.py [--conversations 8] [--turns 10] [--pool-ratio 4] [--model DIR]
    python bench/hicache.py --model "$(python -c 'from radixrt.testing import tiny_model_path as
        p; print(p("llama"))')" --dtype float32 --conversations 6 --turns 4 --system-len 32
        --turn-len 24 --max-new-tokens 8

Why ten turns by default: with every prefix evicted, recomputing the conversation at each of
T turns costs about T (T + 1) / 2 turns' worth of prefill against T with the tiers, a ratio
of 2 / (T + 1), and no lower than 1 / T however long the system prompt. Below 0.2 takes at
least five turns; with a system prompt about twice a turn, ten give about 0.16.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
import routing  # noqa: E402  (launching servers)
import serving  # noqa: E402  (the HTTP client, one request, the summary)

RESULTS = Path(__file__).parent / "results"
CONFIGS = ("no_tiers", "tiers", "restart")
PARTS = ("all", "first_half", "second_half")
# /get_server_info counters reported as their change over a run
COUNTERS = (
    "prefill_tokens",
    "prompt_tokens",
    "cached_tokens",
    "hicache_host_hit_tokens",
    "hicache_storage_hit_tokens",
    "hicache_loaded_bytes",
    "hicache_load_s",
    "hicache_host_evicted_blocks",
    "hicache_storage_written_blocks",
    "hicache_storage_dropped_blocks",
    "hicache_storage_corrupt_blocks",
    "evicted_tokens",
)
WARM_UP = {"role": "user", "content": "warm up: " + " ".join(serving.WORDS)}
TARGETS = {"prefill_ratio": 0.2, "ttft_p50_speedup": 3.0, "restart_hit_rate_tolerance": 0.1}


# ------------------------------------------------------------ workload


@dataclasses.dataclass(frozen=True)
class Script:
    """A conversation's fixed part: its system prompt and each turn's user message."""

    system: str
    users: list[str]


def make_scripts(args) -> list[Script]:
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(rng.choices(serving.WORDS, k=n))

    return [
        Script(
            f"conversation {k}: " + words(args.system_len),
            [f"turn {t}: " + words(args.turn_len) for t in range(args.turns)],
        )
        for k in range(args.conversations)
    ]


class Sizes(NamedTuple):
    working_set: int  # distinct tokens of every final conversation and its last reply
    longest: int  # the longest request: last prompt and its reply


def estimate_sizes(args, scripts: list[Script]) -> Sizes:
    """Token counts of the whole workload with the model's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from radixrt.model.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    reply = " ".join(random.Random(args.seed).choices(serving.WORDS, k=args.max_new_tokens))
    lengths = []
    for s in scripts:
        messages = [{"role": "system", "content": s.system}]
        for user in s.users:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        text = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        lengths.append(len(tok.encode(text)) + args.max_new_tokens)
    return Sizes(sum(lengths), max(lengths))


@dataclasses.dataclass
class Chats:
    """The conversations so far, kept by the client (they outlive a server)."""

    scripts: list[Script]
    messages: list[list[dict]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [[{"role": "system", "content": s.system}] for s in self.scripts]


class Turn(NamedTuple):
    conversation: int
    turn: int
    rec: serving.Record


async def run_turns(client, chats: Chats, turns: range, sp: dict, concurrency: int) -> list[Turn]:
    """Turns ``turns`` of every conversation, round robin; each reply joins its conversation."""
    sem = asyncio.Semaphore(concurrency)

    async def one(k: int, t: int) -> Turn:
        messages = chats.messages[k] + [{"role": "user", "content": chats.scripts[k].users[t]}]
        async with sem:  # FIFO: requests go in conversation order
            rec, text = await serving.one_request(client, {"messages": messages}, sp)
        chats.messages[k] = messages + [{"role": "assistant", "content": text}]
        return Turn(k, t, rec)

    out: list[Turn] = []
    for t in turns:
        out += await asyncio.gather(*(one(k, t) for k in range(len(chats.messages))))
    return out


# ------------------------------------------------------------ runs


class Segment(NamedTuple):
    """Turns run on one server: the requests, wall time, the server's stats before and after."""

    turns: list[Turn]
    elapsed: float
    before: dict
    after: dict

    @property
    def delta(self) -> dict[str, float]:
        """The counters' change over the segment (those the server reports)."""
        return {k: self.after[k] - self.before.get(k, 0) for k in COUNTERS if k in self.after}


async def run_segment(args, url: str, chats: Chats, turns: range) -> Segment:
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    async with serving.OpenAIBackend(url, args.timeout, chat=True) as client:
        before = await client.server_info()
        t0 = time.perf_counter()
        done = await run_turns(client, chats, turns, sp, args.max_concurrency)
        elapsed = time.perf_counter() - t0
        after = await client.server_info()
    return Segment(done, elapsed, before, after)


async def warm_up(args, url: str) -> None:
    """One short request, so that no measured one pays a first call's costs."""
    sp = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    async with serving.OpenAIBackend(url, args.timeout, chat=True) as client:
        rec, _ = await serving.one_request(client, {"messages": [WARM_UP]}, sp)
    if rec.error:
        raise RuntimeError(f"the warm-up request failed: {rec.error}")


def server_flags(args, pool: int, storage: str | None) -> list[str]:
    flags = ["--max-total-tokens", str(pool)]
    if storage is not None:
        flags += ["--enable-hierarchical-cache", "--hicache-storage-dir", storage]
        flags += shlex.split(args.tier_args)
    return flags


def start_server(args, flags: list[str]) -> routing.Launched:
    srv = routing.Launched(args, *flags)
    try:
        asyncio.run(warm_up(args, srv.http))
    except BaseException:
        srv.stop()
        raise
    return srv


def bench_config(args, config: str, scripts: list[Script], pool: int) -> dict:
    """Both halves of the turns on ``config``'s server(s); the summaries of each and of both."""
    chats, half = Chats(scripts), args.turns // 2
    storage = None
    if config != "no_tiers":
        storage = tempfile.mkdtemp(prefix=f"hicache-{config}-", dir=args.storage_root)
    flags = server_flags(args, pool, storage)
    segments = []
    srv = start_server(args, flags)
    try:
        segments.append(asyncio.run(run_segment(args, srv.http, chats, range(half))))
        if config == "restart":
            srv.stop()
            srv = start_server(args, flags)
        segments.append(asyncio.run(run_segment(args, srv.http, chats, range(half, args.turns))))
    finally:
        srv.stop()
        if storage is not None and not args.keep_storage:
            shutil.rmtree(storage, ignore_errors=True)
    out = {
        "all": summarize(segments),
        "first_half": summarize(segments[:1]),
        "second_half": summarize(segments[1:]),
    }
    if config == "restart":
        out["storage_blocks_before_stop"] = segments[0].after.get("hicache_storage_blocks")
        # what the new server found on disk (its scan at start; the warm-up adds no block)
        out["storage_blocks_after_restart"] = segments[1].before.get("hicache_storage_blocks")
    out["working_set_measured"] = measured_working_set(segments)
    out["per_request"] = [
        {"conversation": t.conversation, "turn": t.turn, **dataclasses.asdict(t.rec)}
        for s in segments
        for t in s.turns
    ]
    return out


def summarize(segments: list[Segment]) -> dict:
    """serving's summary of the segments' requests, with the server's counters and TTFT p50
    per turn."""
    turns = [t for s in segments for t in s.turns]
    out = serving.summarize([t.rec for t in turns], sum(s.elapsed for s in segments))
    held = [k for k in COUNTERS if any(k in s.delta for s in segments)]
    delta = {k: sum(s.delta.get(k, 0) for s in segments) for k in held}
    prompt = delta.pop("prompt_tokens", 0)  # the scheduler's count; the responses' is serving's
    out["server_hit_rate"] = delta.pop("cached_tokens", 0) / prompt if prompt else 0.0
    out["prefill_tokens_computed"] = delta.pop("prefill_tokens", 0)
    out.update(delta)
    by_turn: dict[int, list[float]] = {}
    for t in turns:
        if t.rec.error is None:
            by_turn.setdefault(t.turn, []).append(t.rec.ttft)
    out["ttft_p50_by_turn_ms"] = {
        t: 1e3 * serving.percentile(v, 50) for t, v in sorted(by_turn.items())
    }
    return out


def measured_working_set(segments: list[Segment]) -> int:
    """Each conversation's last prompt and reply, as the server counted them."""
    last: dict[int, Turn] = {}
    for t in (t for s in segments for t in s.turns):
        last[t.conversation] = t
    return sum(t.rec.prompt_tokens + t.rec.output_tokens for t in last.values())


def check_targets(results: dict) -> dict:
    """The issue's three targets, each with its value and whether it holds."""
    out = {}
    if "no_tiers" in results and "tiers" in results:
        base, tiers = results["no_tiers"]["all"], results["tiers"]["all"]
        ratio = tiers["prefill_tokens_computed"] / max(1, base["prefill_tokens_computed"])
        speedup = base["ttft_p50_ms"] / tiers["ttft_p50_ms"] if tiers["ttft_p50_ms"] else 0.0
        out["prefill_ratio"] = {
            "value": ratio,
            "target": f"<= {TARGETS['prefill_ratio']}",
            "pass": ratio <= TARGETS["prefill_ratio"],
        }
        out["ttft_p50_speedup"] = {
            "value": speedup,
            "target": f">= {TARGETS['ttft_p50_speedup']}",
            "pass": speedup >= TARGETS["ttft_p50_speedup"],
        }
    if "tiers" in results and "restart" in results:
        plain = results["tiers"]["second_half"]["hit_rate"]
        ratio = results["restart"]["second_half"]["hit_rate"] / plain if plain else 0.0
        tol = TARGETS["restart_hit_rate_tolerance"]
        out["restart_hit_rate_ratio"] = {
            "value": ratio,
            "target": f"1 +- {tol}",
            "pass": abs(ratio - 1) <= tol,
        }
    return out


# ------------------------------------------------------------ report

COLUMNS = (  # (header, key, format)
    ("requests", "requests", "d"),
    ("errors", "errors", "d"),
    ("hit rate", "hit_rate", ".3f"),
    ("prompt tokens", "prompt_tokens", "d"),
    ("prefill computed", "prefill_tokens_computed", "d"),
    ("TTFT p50 ms", "ttft_p50_ms", ".1f"),
    ("TTFT p99 ms", "ttft_p99_ms", ".1f"),
    ("ITL p50 ms", "itl_p50_ms", ".1f"),  # the same decode everywhere: the machine's speed
    ("host hit tok", "hicache_host_hit_tokens", "d"),
    ("storage hit tok", "hicache_storage_hit_tokens", "d"),
    ("loaded MB", "hicache_loaded_bytes", "mb"),
    ("load s", "hicache_load_s", ".2f"),
    ("elapsed s", "elapsed_s", ".1f"),
)


def cell(summary: dict, key: str, fmt: str) -> str:
    if key not in summary:
        return "-"
    value = summary[key]
    if fmt == "mb":
        return f"{value / 1e6:.1f}"
    return f"{int(value)}" if fmt == "d" else f"{value:{fmt}}"


def table(results: dict, targets: dict) -> str:
    lines = [
        "| config | part | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for config, per in results.items():
        for part in PARTS:
            cells = " | ".join(cell(per[part], k, f) for _, k, f in COLUMNS)
            lines.append(f"| {config} | {part} | {cells} |")
    lines.append("")
    for name, t in targets.items():
        verdict = "PASS" if t["pass"] else "FAIL"
        lines.append(f"- {name}: {t['value']:.3f} (target {t['target']}): {verdict}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    a.bar(names, [results[c]["all"]["prefill_tokens_computed"] for c in names])
    a.set_title("prefill tokens computed")
    for c in names:
        by_turn = results[c]["all"]["ttft_p50_by_turn_ms"]
        b.plot(list(by_turn), list(by_turn.values()), marker="o", label=c)
    b.set_xlabel("turn"), b.set_ylabel("TTFT p50 (ms)"), b.set_yscale("log"), b.legend()
    fig.tight_layout()
    fig.savefig(path)


# ------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-len", type=int, default=256, help="words of each system prompt")
    p.add_argument("--turn-len", type=int, default=128, help="words of each user message")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=1)
    p.add_argument(
        "--pool-ratio", type=float, default=4.0, help="the working set over the device pool"
    )
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="the pool (default: from --pool-ratio)"
    )
    p.add_argument(
        "--tier-args", default="", help="more launch flags for the tiered servers (one string)"
    )
    p.add_argument("--storage-root", default=None, help="where storage dirs go (default: tmp)")
    p.add_argument("--keep-storage", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "hicache.json"))
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    if args.turns < 2:
        p.error("--turns must be at least 2 (the restart splits them in halves)")
    return args


def pool_size(args, sizes: Sizes) -> int:
    pool = args.max_total_tokens or int(sizes.working_set / args.pool_ratio)
    if pool < sizes.longest * args.max_concurrency:
        raise SystemExit(
            f"a pool of {pool} tokens cannot hold {args.max_concurrency} of the longest request "
            f"({sizes.longest} tokens): fewer turns, more conversations or a lower --pool-ratio"
        )
    return pool


def main(argv=None) -> None:
    args = parse_args(argv)
    scripts = make_scripts(args)
    sizes = estimate_sizes(args, scripts)
    pool = pool_size(args, sizes)
    print(
        f"working set ~{sizes.working_set} tokens (longest request {sizes.longest}); pool {pool} "
        f"tokens ({sizes.working_set / pool:.2f}x)",
        flush=True,
    )
    results = {}
    for config in args.configs:
        results[config] = bench_config(args, config, scripts, pool)
        s = results[config]["all"]
        print(
            f"{config:9s} hit {s['hit_rate']:.3f}  computed {s['prefill_tokens_computed']:7d}  "
            f"TTFT p50 {s['ttft_p50_ms']:8.1f} ms  p99 {s['ttft_p99_ms']:8.1f} ms  "
            f"errors {s['errors']}",
            flush=True,
        )
    targets = check_targets(results)
    # the working set as served (real replies), the same in every config but for reply tokens
    measured = max(r["working_set_measured"] for r in results.values())
    print(f"working set as served: {measured} tokens ({measured / pool:.2f}x the pool)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": vars(args),
        "sizes": {**sizes._asdict(), "pool": pool, "measured": measured},
        "results": results,
        "targets": targets,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(table(results, targets))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
