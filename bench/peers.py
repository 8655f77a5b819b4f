"""radixrt against vLLM's CPU build and llama.cpp's ``llama-server`` (issue 38's benchmark).

Every target serves the same model and the same token-id workloads (seeded), streamed,
greedy, each request forced to its full length (``ignore_eos``):

- ``w1``: 4 groups x 8 questions on 512-token shared prefixes (32-token questions), 32 tokens
  out, all released at once;
- ``w2``: 32 unrelated 544-token prompts, 32 tokens out, all at once;
- ``poisson``: ``--poisson-requests`` W2-shaped prompts arriving as a Poisson process at
  ``--rate`` req/s (default: 0.8 x the fastest W2 request rate measured before it in this run,
  a load of about 80 %; the arrival times are the same for every target);
- ``single``: one 128-token prompt, 256 tokens out: one stream's decode rate;
- ``burst``: 4 streams of 256 tokens (128-token prompts); once each has streamed 64 tokens,
  W2's shape of burst is released: the streams' ITL during the burst (from its release to
  its last request's end) against before it, and the burst's TTFTs.

``--scale`` multiplies every count and length (``--scale 0.25`` for a quick run).

Targets (``--targets``; the groups run one after the other, each with its own servers):

- ``radixrt-http`` (``/v1/completions``, token-id prompts) and ``radixrt-rpc``
  (``radixrt.AsyncClient``) on one ``radixrt launch`` (plus ``--radixrt-args``), and
  ``radixrt-engine``: an ``Engine`` with the same settings in a worker process, stepped by
  the script (TTFT from ``Req.first_token_at``). The three take turns on each workload, and
  their outputs must be the same (the exactness check counts the requests that differ);
- ``vllm-fp32``, ``vllm-bf16``: ``python -m vllm.entrypoints.openai.api_server`` of
  ``--vllm-python`` on radixrt's model folder, on every core of this process
  (``VLLM_CPU_OMP_THREADS_BIND``), with ``VLLM_SERVER_DEV_MODE=1`` (``/reset_prefix_cache``)
  and ``--enable-prompt-tokens-details``;
- ``llama-server``: ``--llama-server`` on each ``--gguf`` file (a target per file,
  ``llama-server:<file stem>``), one slot per request that can be in flight at once.

Each workload starts cold, after a warm-up request: radixrt flushes its cache, vLLM resets
its prefix cache, llama-server is started afresh (its slots and its prompt cache in RAM go
with the process). The script installs nothing: every peer runs from the paths given; its
output goes to ``bench/results/peers_logs/``.

Reports, per target, the best of ``--repeats`` runs of each workload (the shortest wall
time), the issue's targets as ratios with pass or fail (against vLLM's better dtype on each
metric), the CPU (``lscpu``) and radixrt's kernel paths; writes JSON (and a PNG with
matplotlib) under ``bench/results/``.

    python bench/peers.py --scale 0.25 --workloads w1,w2
    python bench/peers.py --vllm-python /work/peers/vllm/bin/python \\
        --llama-server PATH/llama-server --gguf smollm2-bf16.gguf --gguf smollm2-q4_1.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import routing  # noqa: E402  (radixrt launched as a subprocess, free ports)
import serving  # noqa: E402  (the backends, one streamed request, its Record, percentiles)

RESULTS = Path(__file__).parent / "results"
WORKLOADS = ("w1", "w2", "poisson", "single", "burst")
RADIXRT = ("radixrt-http", "radixrt-rpc", "radixrt-engine")
VLLM = {"vllm-fp32": "float32", "vllm-bf16": "bfloat16"}
LLAMA = "llama-server"
LOAD = 0.8  # the default Poisson rate: this share of the fastest W2 request rate
GROUPS, STREAMS = 4, 4  # W1's shared prefixes; the burst run's long streams
POLL_S = 0.01  # how often the burst run looks at the streams' progress
WARM_UP = list(range(1000, 1016))
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
BUILD_ENV = (
    "RADIXRT_KERNEL_CFLAGS",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
)
# --isa avx2: every library of radixrt and vLLM held to AVX2 and FMA (an AVX2-only CPU's code on
# this one): radixrt's kernels built without AVX-512 or AMX, oneDNN, MKL and PyTorch's own kernels
# at AVX2, and vLLM's AVX2 extension (it picks by what torch.cpu reports: AVX2_SITE).
AVX2_ENV = {
    "RADIXRT_KERNEL_CFLAGS": " ".join(
        f"-mno-{x}" for x in ("avx512f", "amx-tile", "amx-bf16", "amx-int8", "avx512bf16")
    ),
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
}
AVX2_SITE = """\
# Written by radixrt's bench/peers.py --isa avx2: a vLLM process on this path sees no
# AVX-512 or AMX, so it loads its AVX2 extension and picks its AVX2 attention.
import torch.cpu

for _name in ("avx512", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_fp16"):
    setattr(torch.cpu, f"_is_{_name}_supported", lambda: False)
"""


# ------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Request:
    ids: list[int]
    max_new_tokens: int
    at: float = 0.0  # s after the run's start (a gated request: after the gate opens)
    gated: bool = False  # held until every ungated request has Workload.gate_tokens tokens


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    gate_tokens: int = 0


class Sizes(NamedTuple):
    questions: int  # per shared prefix (W1)
    prefix: int
    question: int
    out: int  # tokens out of every W1, W2, Poisson and burst request
    w2_requests: int
    w2_len: int
    poisson_requests: int
    single_prompt: int  # also the burst streams' prompts
    single_out: int
    stream_out: int
    gate_tokens: int


FULL = Sizes(8, 512, 32, 32, 32, 544, 64, 128, 256, 256, 64)


def sizes(scale: float, poisson_requests: int | None = None) -> Sizes:
    """FULL with every count and length times ``scale`` (at least 2 each)."""
    sz = Sizes(*(max(2, round(v * scale)) for v in FULL))
    return sz._replace(poisson_requests=poisson_requests) if poisson_requests else sz


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]  # serving.py's token range


def make_workload(
    name: str, sz: Sizes, vocab: int, seed: int, rate: float | None = None
) -> Workload:
    """The named workload's requests, the same for every target (``rate``: Poisson only)."""
    rng = random.Random(f"{seed}:{name}")
    unrelated = lambda n: [Request(_ids(rng, vocab, sz.w2_len), sz.out) for _ in range(n)]  # noqa: E731
    if name == "w1":
        shape = argparse.Namespace(
            backend="openai",
            groups=GROUPS,
            questions=sz.questions,
            prefix_len=sz.prefix,
            question_len=sz.question,
        )
        prompts = serving.shared_prefix(shape, rng, vocab)
        return Workload(name, [Request(p["input_ids"], sz.out) for p in prompts])
    if name == "w2":
        return Workload(name, unrelated(sz.w2_requests))
    if name == "poisson":
        if not rate or rate <= 0:
            raise ValueError(f"the Poisson workload needs a rate > 0 req/s, got {rate!r}")
        reqs, at = unrelated(sz.poisson_requests), 0.0
        for i, r in enumerate(reqs):
            at += rng.expovariate(rate)
            reqs[i] = dataclasses.replace(r, at=at)
        return Workload(name, reqs)
    if name == "single":
        return Workload(name, [Request(_ids(rng, vocab, sz.single_prompt), sz.single_out)])
    if name == "burst":
        streams = [
            Request(_ids(rng, vocab, sz.single_prompt), sz.stream_out) for _ in range(STREAMS)
        ]
        burst = [dataclasses.replace(r, gated=True) for r in unrelated(sz.w2_requests)]
        return Workload(name, streams + burst, gate_tokens=sz.gate_tokens)
    raise ValueError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")


def sampling(r: Request) -> dict:
    return {"max_new_tokens": r.max_new_tokens, "temperature": 0.0, "ignore_eos": True}


WARM = Request(WARM_UP, 4)  # the warm-up request before each workload


# ----------------------------------------------------------------- runs


class Sample(NamedTuple):
    sent: float  # s after the run's start
    rec: serving.Record
    text: str


class Run(NamedTuple):
    samples: list[Sample]  # in the workload's order
    gate_at: float | None  # s after the run's start that the gated requests were let go


def streamed(rec: serving.Record) -> int:
    """Chunks with tokens received so far (one token each while decoding)."""
    return 1 + len(rec.itl) if rec.ttft else 0


async def run_client(backend, wl: Workload) -> Run:
    """The workload through one of serving.py's backends: each request sent at its time."""
    recs = [serving.Record() for _ in wl.requests]
    done = [False] * len(recs)
    t0 = time.perf_counter()
    gate = asyncio.get_running_loop().create_future()

    async def send(i: int, r: Request) -> Sample:
        start = await gate if r.gated else t0
        await asyncio.sleep(max(0.0, start + r.at - time.perf_counter()))
        sent = time.perf_counter()
        rec, text = await serving.one_request(
            backend, {"input_ids": r.ids}, sampling(r), True, recs[i]
        )
        done[i] = True
        return Sample(sent - t0, rec, text)

    watch = asyncio.create_task(_open_gate(gate, wl, recs, done))
    try:
        samples = await asyncio.gather(*(send(i, r) for i, r in enumerate(wl.requests)))
    finally:
        watch.cancel()
    gated = any(r.gated for r in wl.requests)
    return Run(list(samples), gate.result() - t0 if gated else None)


async def _open_gate(gate: asyncio.Future, wl: Workload, recs: list, done: list[bool]) -> None:
    ungated = [i for i, r in enumerate(wl.requests) if not r.gated]
    while not gate.done():
        if all(done[i] or streamed(recs[i]) >= wl.gate_tokens for i in ungated):
            gate.set_result(time.perf_counter())
        else:
            await asyncio.sleep(POLL_S)


class EngineRun:
    """One workload through an ``Engine``, stepped here: a request is added at its time, and
    each token's time is the end of the step that made it (what a stream would see)."""

    def __init__(self, eng, wl: Workload) -> None:
        from radixrt import SamplingParams

        self.eng, self.wl, self.params = eng, wl, SamplingParams
        self.t0 = time.monotonic()
        reqs = wl.requests
        self.todo = sorted(range(len(reqs)), key=lambda i: (reqs[i].gated, reqs[i].at))
        self.ungated = [i for i, r in enumerate(reqs) if not r.gated]
        self.live: dict[int, tuple[Any, float, list[float]]] = {}  # i -> (Req, sent, times)
        self.gate: float | None = None
        self.check_gate(self.t0)

    def run(self) -> tuple[list[tuple[float, serving.Record, str]], float | None]:
        while self.todo or self.busy():
            self.release(time.monotonic())
            if not self.busy():
                time.sleep(max(0.0, self.due(self.todo[0]) - time.monotonic()))
                continue
            self.eng.step()
            self.book(time.monotonic())
        gated = any(r.gated for r in self.wl.requests)
        samples = [self.sample(i) for i in range(len(self.wl.requests))]
        return samples, self.gate - self.t0 if gated else None

    def due(self, i: int) -> float:
        r = self.wl.requests[i]
        start = self.gate if r.gated else self.t0
        return float("inf") if start is None else start + r.at

    def busy(self) -> bool:
        return any(not req.finished for req, _, _ in self.live.values())

    def release(self, now: float) -> None:
        while self.todo and self.due(self.todo[0]) <= now:
            i = self.todo.pop(0)
            r = self.wl.requests[i]
            req = self.eng.add_request(r.ids, self.params(**sampling(r)))
            self.live[i] = (req, now, [])

    def book(self, now: float) -> None:
        for req, _, times in self.live.values():
            times.extend([now] * (len(req.output_ids) - len(times)))
        self.check_gate(now)

    def check_gate(self, now: float) -> None:
        def ready(i: int) -> bool:
            req = self.live[i][0] if i in self.live else None
            return req is not None and (req.finished or len(req.output_ids) >= self.wl.gate_tokens)

        if self.gate is None and all(ready(i) for i in self.ungated):
            self.gate = now

    def sample(self, i: int) -> tuple[float, serving.Record, str]:
        req, sent, times = self.live[i]
        rec = serving.Record(
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            output_tokens=len(req.output_ids),
            ttft=req.first_token_at - sent if req.first_token_at else 0.0,
            itl=[b - a for a, b in zip(times, times[1:])],
            latency=(times[-1] if times else sent) - sent,
            error=req.error,
        )
        return sent - self.t0, rec, self.eng.make_output(req).text


# -------------------------------------------------------------- summaries


def token_times(s: Sample) -> list[float]:
    """When each streamed chunk arrived, in s after the run's start."""
    if not s.rec.ttft:
        return []
    times = [s.sent + s.rec.ttft]
    for gap in s.rec.itl:
        times.append(times[-1] + gap)
    return times


def summarize(wl: Workload, run: Run) -> dict:
    """One run's figures (seconds unless the name says ms)."""
    pct = serving.percentile
    pairs = list(zip(wl.requests, run.samples))
    ok = [s for _, s in pairs if s.rec.error is None]
    wall = max((s.sent + s.rec.latency for s in run.samples), default=0.0)
    ttft = [s.rec.ttft for s in ok if s.rec.output_tokens]
    itl = [x for s in ok for x in s.rec.itl]
    decode = [
        (s.rec.output_tokens - 1) / (s.rec.latency - s.rec.ttft)
        for s in ok
        if s.rec.output_tokens > 1 and s.rec.latency > s.rec.ttft
    ]
    prompt = sum(s.rec.prompt_tokens for s in ok)
    chunks = sum(streamed(s.rec) for s in ok)
    summary = {
        "requests": len(pairs),
        "errors": len(pairs) - len(ok),
        "short": sum(
            s.rec.error is None and s.rec.output_tokens != r.max_new_tokens for r, s in pairs
        ),
        "wall_s": wall,
        "output_tok_s": sum(s.rec.output_tokens for s in ok) / wall if wall else 0.0,
        "request_rate": len(ok) / wall if wall else 0.0,
        "ttft_first_s": min(ttft, default=0.0),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
        "decode_tok_s": statistics.median(decode) if decode else 0.0,
        "hit_rate": sum(s.rec.cached_tokens for s in ok) / prompt if prompt else 0.0,
        # above 1 where a stream's chunks carry several tokens (its ITL is then per chunk)
        "tokens_per_chunk": ratio(sum(s.rec.output_tokens for s in ok), chunks),
        "first_error": next((s.rec.error for s in run.samples if s.rec.error), None),
    }
    if run.gate_at is not None:
        summary.update(burst_summary(wl, run))
    return summary


def burst_summary(wl: Workload, run: Run) -> dict:
    """The streams' ITL alone (between tokens after every stream had its first one, so their
    own start-up is not counted, and before the gated requests went) and while the gated
    requests ran (up to the last one's end), and the gated requests' TTFTs."""
    pct = serving.percentile
    pairs = list(zip(wl.requests, run.samples))
    burst = [s for r, s in pairs if r.gated]
    streams = [s for r, s in pairs if not r.gated]
    end = max(s.sent + s.rec.latency for s in burst)
    streaming = max((token_times(s)[0] for s in streams if s.rec.ttft), default=0.0)
    alone, during = [], []
    for s in streams:
        times = token_times(s)
        for before, t, gap in zip(times, times[1:], s.rec.itl):
            if t <= run.gate_at:
                if before >= streaming:
                    alone.append(gap)
            elif t <= end:
                during.append(gap)
    ttft = [s.rec.ttft for s in burst if s.rec.error is None and s.rec.output_tokens]
    itl_ratio = ratio(pct(during, 99), pct(alone, 99)) if during else None
    return {
        "gate_at_s": run.gate_at,
        "burst_end_s": end,
        "itl_alone_p50_ms": 1e3 * pct(alone, 50),
        "itl_alone_p99_ms": 1e3 * pct(alone, 99),
        "itl_burst_p50_ms": 1e3 * pct(during, 50),
        "itl_burst_p99_ms": 1e3 * pct(during, 99),
        "itl_burst_samples": len(during),
        "itl_p99_ratio": itl_ratio,
        "burst_ttft_first_s": min(ttft, default=0.0),
        "burst_ttft_p50_s": pct(ttft, 50),
    }


class Book:
    """Every run's summary by target and workload, and the radixrt targets' outputs."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, list[dict]]] = {}
        self.outputs: dict[tuple[str, int], set[tuple[str, int]]] = {}
        self.rate: float | None = None

    def add(self, target: str, wl: Workload, run: Run) -> dict:
        summary = summarize(wl, run)
        self.runs.setdefault(target, {}).setdefault(wl.name, []).append(summary)
        if target in RADIXRT:
            for i, s in enumerate(run.samples):
                self.outputs.setdefault((wl.name, i), set()).add((s.text, s.rec.output_tokens))
        return summary

    def fastest_w2_rate(self) -> float:
        rates = [s["request_rate"] for t in self.runs.values() for s in t.get("w2", ())]
        return max(rates, default=0.0)

    def differing(self) -> dict:
        """Requests whose output was not the same in every run of every radixrt target."""
        counts: dict[str, list[int]] = {}
        for (name, _), outs in self.outputs.items():
            counts.setdefault(name, [0, 0])
            counts[name][0] += len(outs) > 1
            counts[name][1] += 1
        total = sum(d for d, _ in counts.values())
        return {"differing": total, "by_workload": {k: tuple(v) for k, v in counts.items()}}

    def best(self) -> dict[str, dict[str, dict]]:
        """Each target's shortest run of each workload."""
        return {
            t: {w: min(runs, key=lambda s: s["wall_s"]) for w, runs in per.items()}
            for t, per in self.runs.items()
        }


# ------------------------------------------------------------- targets' checks


class Check(NamedTuple):
    name: str
    value: float | None
    bound: float
    at_least: bool  # value >= bound passes (else value <= bound)

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.bound if self.at_least else self.value <= self.bound


def checks(book: Book) -> list[Check]:
    """The issue's targets that this run's targets and workloads can tell."""
    best = book.best()
    out = []
    vllm = [best[t] for t in VLLM if t in best]
    for t in (t for t in RADIXRT if t in best):
        out += _against_vllm(t, best[t], vllm) + _latency_checks(t, best[t])
    for front in ("radixrt-http", "radixrt-rpc"):
        for w in ("w1", "w2"):
            ratio = paired_ratio(book.runs, front, "radixrt-engine", w)
            if ratio is not None:
                out.append(Check(f"{front} / engine throughput, {w}", ratio, 0.95, True))
    if book.outputs:
        out.append(Check("radixrt outputs differing", book.differing()["differing"], 0, False))
    return out


def _against_vllm(t: str, mine: dict, vllm: list[dict]) -> list[Check]:
    out = []
    for w in ("w1", "w2"):
        walls = [v[w]["wall_s"] for v in vllm if w in v]
        if walls and w in mine:
            x = ratio(min(walls), mine[w]["wall_s"])
            out.append(Check(f"{t} {w} throughput / vLLM's best", x, 1.5, True))
    ttfts = [v["w2"]["ttft_p50_s"] for v in vllm if "w2" in v]
    if ttfts and "w2" in mine:
        x = ratio(mine["w2"]["ttft_p50_s"], min(ttfts))
        out.append(Check(f"{t} w2 TTFT p50 / vLLM's best", x, 0.5, False))
    return out


def _latency_checks(t: str, mine: dict) -> list[Check]:
    out = []
    if "w2" in mine:
        out.append(Check(f"{t} w2 first TTFT s", mine["w2"]["ttft_first_s"], 1.0, False))
    if "burst" in mine:
        b = mine["burst"]
        out.append(Check(f"{t} burst first TTFT s", b["burst_ttft_first_s"], 1.0, False))
        out.append(Check(f"{t} burst ITL p99 / alone", b["itl_p99_ratio"], 5.0, False))
    return out


def paired_ratio(runs: dict, a: str, b: str, w: str) -> float | None:
    """Median over repeats of b's wall / a's wall (a's throughput over b's): the targets of a
    group take turns, so each repeat pairs runs made close together."""
    if w not in runs.get(a, {}) or w not in runs.get(b, {}):
        return None
    pairs = [ratio(y["wall_s"], x["wall_s"]) for x, y in zip(runs[a][w], runs[b][w])]
    return None if None in pairs else statistics.median(pairs)


def ratio(a: float, b: float) -> float | None:
    """a / b; None (a failed check) where b is 0 (a run with no request through)."""
    return a / b if b > 0 else None


# ------------------------------------------------------------------ targets


class VllmBackend(serving.OpenAIBackend):
    """vLLM's server: its prefix cache reset (``VLLM_SERVER_DEV_MODE=1``), its version."""

    async def flush_cache(self) -> None:
        async with self.http.post("/reset_prefix_cache") as resp:
            resp.raise_for_status()

    async def server_info(self) -> dict:
        async with self.http.get("/version") as resp:
            return {"vllm": (await resp.json()).get("version")}


class LlamaBackend(serving.OpenAIBackend):
    """llama-server: a cold cache is a fresh process (``ClientTarget.restart``)."""

    async def flush_cache(self) -> None:
        raise NotImplementedError("llama-server starts cold by a restart")

    async def server_info(self) -> dict:
        async with self.http.get("/props") as resp:
            props = await resp.json()
        keys = ("build_info", "total_slots", "model_path")
        return {k: props.get(k) for k in keys} | {"n_ctx": _n_ctx(props)}


def _n_ctx(props: dict) -> int | None:
    return (props.get("default_generation_settings") or {}).get("n_ctx")


class ClientTarget:
    """A target reached through a backend of serving.py (``backend()`` makes one)."""

    def __init__(
        self,
        name: str,
        backend: Callable[[], Any],
        restart: Callable[[], None] | None = None,
        extra: Callable[[], dict] | None = None,
    ) -> None:
        self.name, self.backend, self.restart = name, backend, restart
        self.extra = extra  # more of info(), from outside the server's API

    async def prepare(self) -> None:
        """A warm-up request, then a cold cache."""
        if self.restart is not None:
            self.restart()
        async with self.backend() as b:
            rec, _ = await serving.one_request(b, {"input_ids": WARM.ids}, sampling(WARM))
            if rec.error:
                raise RuntimeError(f"{self.name}: the warm-up request failed: {rec.error}")
            if self.restart is None:
                await b.flush_cache()

    async def run(self, wl: Workload) -> Run:
        async with self.backend() as b:
            return await run_client(b, wl)

    async def info(self) -> dict:
        async with self.backend() as b:
            return await b.server_info() | (self.extra() if self.extra else {})


class EngineTarget(serving.WorkerProcess):
    """``radixrt-engine``: an Engine in a worker process (``_engine_worker``)."""

    name = "radixrt-engine"

    def __init__(self, config) -> None:
        super().__init__(_engine_worker, config)

    async def prepare(self) -> None:
        self._call("warm_up")
        self._call("flush")

    async def run(self, wl: Workload) -> Run:
        samples, gate_at = self._call("run", wl)
        return Run([Sample(*s) for s in samples], gate_at)

    async def info(self) -> dict:
        return self._call("info")


def _engine_worker(conn, config) -> None:
    from radixrt import Engine, SamplingParams

    eng = Engine(config)

    def warm_up() -> None:
        eng.generate(input_ids=[WARM.ids], sampling_params=SamplingParams(**sampling(WARM)))

    serving.serve_calls(
        conn,
        {
            "warm_up": warm_up,
            "flush": eng.flush_cache,
            "run": lambda wl: EngineRun(eng, wl).run(),
            "info": lambda: engine_info(eng),
        },
    )


def engine_info(eng) -> dict:
    """The kernel paths an Engine runs (the fields of the server's ``/server_info``)."""
    import torch

    runner = eng.runner
    return {
        "dtype": eng.config.dtype,
        "kernels": runner.kernels.describe(),
        "attention": runner.attn_backend.describe(),
        "decode_chain": runner.decode_chain_info,
        **runner.exactness.info(),
        "threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------- processes


class Spawned:
    """A peer's server process, its output in ``log``; up once GET ``url``/health says 200."""

    def __init__(self, cmd: list[str], env: dict, url: str, log: Path, timeout_s: float) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.cmd, self.url, self.log = cmd, url, log
        with open(log, "ab") as out:
            out.write(f"\n$ {shlex.join(cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.cmd[0]} exited ({self.proc.returncode}):\n{tail}")
            if routing.health_ok(self.url, timeout=5.0):
                return
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{shlex.join(self.cmd)} not up in {timeout_s:.0f} s (see {self.log})")

    def stop(self) -> None:
        routing.stop_process(self.proc)


def peer_env(**extra: str) -> dict:
    """This environment without PYTHONPATH (radixrt's tree is nothing to a peer)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | extra


def mapped_libraries(pid: int, part: str) -> list[str]:
    """The file names of the libraries, their paths containing ``part``, that process ``pid``
    and its descendants have loaded (which of a peer's builds runs)."""
    names, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/maps") as maps:
                names |= {Path(ln.split()[-1]).name for ln in maps if part in ln}
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [
                    int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()
                ]
        except OSError:
            continue
    return sorted(names)


def avx2_site() -> Path:
    """A folder whose sitecustomize.py (AVX2_SITE) narrows a vLLM process to AVX2 (beside the
    peers' logs)."""
    folder = log_path("avx2_site").with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(AVX2_SITE)
    return folder


def narrowed_to_avx2(argv: list[str]) -> None:
    """Run this script again (same arguments) with AVX2_ENV, unless it already has it: the
    environment must be there before PyTorch loads, and every process started inherits it."""
    if all(os.environ.get(k) == v for k, v in AVX2_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable, __file__, *argv], os.environ | AVX2_ENV)


def cpu_list() -> str:
    """This process's CPUs as a list of ranges (``0-1``; ``0-3,8-11``)."""
    cpus, spans = sorted(os.sched_getaffinity(0)), []
    for c in cpus:
        if spans and spans[-1][1] == c - 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


class RadixrtGroup:
    """``radixrt launch`` (for -http and -rpc) and the Engine's worker, started together."""

    def __init__(self, names: list[str], args: argparse.Namespace) -> None:
        self.names, self.args = names, args
        self.label = ",".join(names)
        self.server: routing.Launched | None = None
        self.engine: EngineTarget | None = None

    def start(self) -> list:
        config = radixrt_config(self.args)
        targets: list = []
        if {"radixrt-http", "radixrt-rpc"} & set(self.names):
            shape = argparse.Namespace(dtype=config.dtype, model=self.args.model)
            self.server = routing.Launched(shape, *shlex.split(self.args.radixrt_args))
            info = httpx.get(self.server.http + "/server_info", timeout=30).json()
            slots = info["internal_states"][0]["kv_slots"]
            config = dataclasses.replace(config, max_total_tokens=slots)  # the Engine's pool too
            targets += self._fronts()
        if "radixrt-engine" in self.names:
            self.engine = EngineTarget(config)
            targets.append(self.engine)
        return targets

    def _fronts(self) -> list[ClientTarget]:
        srv, timeout = self.server, self.args.timeout
        rpc = f"tcp://127.0.0.1:{srv.port}"
        make = {
            "radixrt-http": lambda: serving.OpenAIBackend(srv.http, timeout, chat=False),
            "radixrt-rpc": lambda: serving.RadixrtBackend(rpc, timeout),
        }
        return [ClientTarget(n, make[n]) for n in RADIXRT if n in make and n in self.names]

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.server is not None:
            self.server.stop()


def radixrt_config(args: argparse.Namespace):
    """The EngineConfig ``radixrt launch`` makes of ``--radixrt-args`` (and ``--model``)."""
    from radixrt.cli import build_parser
    from radixrt.config import launch_fields, load_config

    extra = shlex.split(args.radixrt_args) + (["--model", args.model] if args.model else [])
    ns = build_parser().parse_args(["launch", *extra])
    flags = {f.name: getattr(ns, f.name, None) for _, f in launch_fields()}
    return load_config(ns.config, flags)[0]


class VllmGroup:
    """vLLM's OpenAI server in one dtype, from ``--vllm-python``."""

    def __init__(self, name: str, args: argparse.Namespace, model_dir: str) -> None:
        self.name, self.args, self.model_dir = name, args, model_dir
        self.label = name
        self.proc: Spawned | None = None

    def start(self) -> list[ClientTarget]:
        port = routing.free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [self.args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", self.model_dir, "--dtype", VLLM[self.name]]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details"]
        cmd += ["--gpu-memory-utilization", str(self.args.vllm_memory)]
        cmd += shlex.split(self.args.vllm_args)
        env = peer_env(VLLM_CPU_OMP_THREADS_BIND=self.args.cpus, VLLM_SERVER_DEV_MODE="1")
        if self.args.isa == "avx2":
            env["PYTHONPATH"] = str(avx2_site())
        self.proc = Spawned(cmd, env, url, log_path(self.name), self.args.ready_timeout)
        timeout, model, pid = self.args.timeout, self.model_dir, self.proc.proc.pid
        backend = lambda: VllmBackend(url, timeout, False, model=model)  # noqa: E731
        extra = lambda: {"extensions": mapped_libraries(pid, "vllm/_C")}  # noqa: E731
        return [ClientTarget(self.name, backend, extra=extra)]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class LlamaGroup:
    """llama-server on one GGUF file, restarted for every cold start."""

    def __init__(self, gguf: str, args: argparse.Namespace, slots: int, ctx: int) -> None:
        self.gguf, self.args, self.slots, self.ctx = gguf, args, slots, ctx
        self.name = self.label = f"{LLAMA}:{Path(gguf).stem}"
        self.url = ""  # a fresh port at each start
        self.proc: Spawned | None = None

    def start(self) -> list[ClientTarget]:
        self.restart()
        timeout = self.args.timeout
        backend = lambda: LlamaBackend(self.url, timeout, False)  # noqa: E731
        return [ClientTarget(self.name, backend, restart=self.restart)]

    def restart(self) -> None:
        self.stop()
        port = routing.free_port()
        self.url = f"http://127.0.0.1:{port}"
        threads = str(len(os.sched_getaffinity(0)))
        cmd = [self.args.llama_server, "-m", self.gguf, "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "-t", threads, "-np", str(self.slots)]
        cmd += ["-c", str(self.ctx), "--cont-batching", *shlex.split(self.args.llama_args)]
        self.proc = Spawned(cmd, peer_env(), self.url, log_path(self.name), self.args.ready_timeout)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def log_path(target: str) -> Path:
    return RESULTS / "peers_logs" / f"{target.replace(':', '_')}.log"


def llama_slots(workloads: list[Workload]) -> tuple[int, int]:
    """(slots, context) for llama-server: a slot per request that may be in flight at once,
    each holding the longest prompt and its output."""
    slots = max(len(wl.requests) for wl in workloads)
    per_slot = max(len(r.ids) + r.max_new_tokens for wl in workloads for r in wl.requests)
    return slots, slots * (per_slot + 16)


# -------------------------------------------------------------------- run


def plan(args: argparse.Namespace, model_dir: str, sz: Sizes) -> list:
    """The groups to run, in order; a target whose peer was not given is an error."""
    names = args.targets
    radixrt = [n for n in names if n in RADIXRT]
    groups: list = [RadixrtGroup(radixrt, args)] if radixrt else []
    for n in (n for n in names if n in VLLM):
        if not args.vllm_python:
            raise SystemExit(f"--targets {n} needs --vllm-python (vLLM's environment)")
        groups.append(VllmGroup(n, args, model_dir))
    if LLAMA in names:
        if not args.llama_server or not args.gguf:
            raise SystemExit("--targets llama-server needs --llama-server and --gguf")
        shapes = [make_workload(w, sz, 100, args.seed, rate=1.0) for w in args.workloads]
        slots, ctx = llama_slots(shapes)
        groups += [LlamaGroup(g, args, slots, ctx) for g in args.gguf]
    return groups


async def run_all(args: argparse.Namespace, groups: list, vocab: int, sz: Sizes) -> dict:
    """Every group in turn; a group that fails is reported and the next one runs."""
    book, infos, failures = Book(), {}, {}
    book.rate = args.rate
    for group in groups:
        try:
            await run_group(args, group, book, infos, vocab, sz)
        except Exception as e:  # noqa: BLE001 (reported; the other groups' results stand)
            failures[group.label] = f"{type(e).__name__}: {e}"
            print(f"{group.label} FAILED: {failures[group.label]}", file=sys.stderr, flush=True)
        finally:
            group.stop()
    return {"book": book, "infos": infos, "failures": failures}


async def run_group(args, group, book: Book, infos: dict, vocab: int, sz: Sizes) -> None:
    """The group's targets take turns on each workload, ``--repeats`` times."""
    targets = group.start()
    for t in targets:
        infos[t.name] = await t.info()
    for rep in range(args.repeats):
        for name in args.workloads:
            wl = make_workload(name, sz, vocab, args.seed, poisson_rate(book, name))
            for t in targets:
                await t.prepare()
                s = book.add(t.name, wl, await t.run(wl))
                print(progress_line(t.name, name, rep, s), flush=True)


def poisson_rate(book: Book, workload: str) -> float | None:
    """The Poisson rate, fixed at first use: --rate, else LOAD x the fastest W2 so far."""
    if workload != "poisson":
        return None
    if book.rate is None:
        fastest = book.fastest_w2_rate()
        if not fastest:
            raise RuntimeError("the Poisson workload needs --rate, or w2 run before it")
        book.rate = LOAD * fastest
    return book.rate


def progress_line(target: str, workload: str, rep: int, s: dict) -> str:
    return (
        f"{target:>24} {workload:>8} #{rep}: wall {s['wall_s']:.2f} s, TTFT p50 "
        f"{s['ttft_p50_s']:.3f} s, ITL p50 {s['itl_p50_ms']:.1f} ms, {s['errors']} errors, "
        f"{s['short']} short"
    )


# ---------------------------------------------------------------- report


def machine() -> dict:
    """``lscpu``'s model name, the instruction sets that matter, the CPUs this process has,
    and the environment that narrows radixrt's kernels (the AVX2 imitation)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {
        "model_name": fields.get("Model name", "?").strip(),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cpus": cpu_list(),
        "env": {k: os.environ[k] for k in BUILD_ENV if k in os.environ},
    }


COLUMNS = (
    ("W1 wall s", "w1", ("wall_s",), "{:.2f}"),
    ("W1 TTFT p50 s", "w1", ("ttft_p50_s",), "{:.3f}"),
    ("W2 wall s", "w2", ("wall_s",), "{:.2f}"),
    ("W2 TTFT p50 s", "w2", ("ttft_p50_s",), "{:.3f}"),
    ("W2 first TTFT s", "w2", ("ttft_first_s",), "{:.3f}"),
    ("Poisson TTFT p50/p99 s", "poisson", ("ttft_p50_s", "ttft_p99_s"), "{:.3f}"),
    ("Poisson ITL p50/p99 ms", "poisson", ("itl_p50_ms", "itl_p99_ms"), "{:.1f}"),
    ("single tok/s", "single", ("decode_tok_s",), "{:.1f}"),
    ("burst ITL p99 x", "burst", ("itl_p99_ratio",), "{:.2f}"),
    ("burst TTFT first/p50 s", "burst", ("burst_ttft_first_s", "burst_ttft_p50_s"), "{:.3f}"),
)


def table(book: Book) -> str:
    """The best run of each workload per target, as Markdown; the last column counts the
    requests of every run that failed or stopped short of their length."""
    best = book.best()
    head = ["target", *(c[0] for c in COLUMNS), "errors + short"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for t, per in best.items():
        cells = [t]
        for _, w, keys, fmt in COLUMNS:
            values = [per.get(w, {}).get(k) for k in keys]
            cells.append("/".join("-" if v is None else fmt.format(v) for v in values))
        bad = sum(s["errors"] + s["short"] for runs in book.runs[t].values() for s in runs)
        lines.append("| " + " | ".join([*cells, str(bad)]) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    book, infos, m = result["book"], result["infos"], result["machine"]
    lines = [
        f"CPU: {m['model_name']} ({', '.join(m['isa'])}); CPUs {m['cpus']}"
        + (f"; {m['env']}" if m["env"] else ""),
    ]
    for t, info in infos.items():
        lines.append(f"{t}: {describe(info)}")
    if book.rate:
        lines.append(
            f"Poisson rate {book.rate:.3f} req/s (fastest W2 {book.fastest_w2_rate():.3f})"
        )
    lines += ["", table(book), ""]
    for c in result["checks"]:
        value = "-" if c.value is None else f"{c.value:.3f}"
        op = ">=" if c.at_least else "<="
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {value} ({op} {c.bound})")
    if book.outputs:
        lines.append(f"exactness: {book.differing()}")
    for label, error in result["failures"].items():
        lines.append(f"FAILED  {label}: {error}")
    return "\n".join(lines)


def describe(info: dict) -> str:
    """A target's paths in one line (radixrt: kernels, attention, decode chain, exactness)."""
    if "kernels" not in info:
        return json.dumps(info)
    linear = ", ".join(f"{k} {v}" for k, v in info["kernels"].get("linear", {}).items())
    return (
        f"dtype {info.get('dtype')}; linear {linear}; attention {info.get('attention')}; "
        f"decode chain {info.get('decode_chain')}; exact outputs {info.get('exact_outputs')}"
    )


def plot(book: Book, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    best = book.best()
    names = list(best)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, (key, label) in zip(axes, (("wall_s", "wall s"), ("ttft_p50_s", "TTFT p50 s"))):
        for k, w in enumerate(("w1", "w2", "poisson")):
            xs = [i + 0.27 * (k - 1) for i in range(len(names))]
            ax.bar(xs, [best[n].get(w, {}).get(key, 0.0) for n in names], 0.27, label=w)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add(
        "--targets",
        default=None,
        help="comma-separated (default: radixrt's three, then the "
        "peers whose paths are given): " + ", ".join((*RADIXRT, *VLLM, LLAMA)),
    )
    add("--workloads", default=",".join(WORKLOADS), help="comma-separated, run in this order")
    add("--repeats", type=int, default=1, help="runs of each workload per target (best kept)")
    add("--scale", type=float, default=1.0, help="multiplies every count and length")
    add("--rate", type=float, default=None, help=f"Poisson req/s (default {LOAD} x fastest W2)")
    add("--poisson-requests", type=int, default=None, help="default 64 x --scale")
    add("--seed", type=int, default=0)
    add("--model", default=None, help="a HF model folder (default: radixrt's default model)")
    add(
        "--radixrt-args",
        default="--dtype bfloat16",  # the default model's bf16 folder, the weights vLLM reads
        help="added to radixrt launch and the Engine's config (--radixrt-args='--x y')",
    )
    add("--vllm-python", default=None, help="the python of vLLM's environment")
    add("--vllm-args", default="", help="added to vLLM's api_server (--vllm-args='--x y')")
    add(
        "--vllm-memory",
        type=float,
        default=0.3,
        help="vLLM's --gpu-memory-utilization: on a CPU, the share of memory it reserves (its "
        "default, 0.92, fails wherever other processes hold memory)",
    )
    add("--llama-server", default=None, help="the llama-server binary")
    add("--gguf", action="append", default=[], help="a GGUF file for llama-server (repeatable)")
    add("--llama-args", default="", help="added to llama-server (--llama-args=--no-repack)")
    add(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: radixrt and vLLM held to AVX2 and FMA (AVX2_ENV; an AVX2-only CPU's code "
        "paths on this one); llama-server keeps its own build, so it is refused here",
    )
    add("--cpus", default=cpu_list(), help="VLLM_CPU_OMP_THREADS_BIND (default: this process's)")
    add("--ready-timeout", type=float, default=900.0, help="s for a peer to come up")
    add("--timeout", type=float, default=3600.0, help="s for one request")
    add("--out", default=None, help="JSON path (default bench/results/peers.json)")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.targets = default_targets(args) if args.targets is None else args.targets.split(",")
    unknown = [t for t in args.targets if t not in (*RADIXRT, *VLLM, LLAMA)]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or bad:
        ap.error(f"unknown targets {unknown} or workloads {bad}")
    if args.isa == "avx2" and LLAMA in args.targets:
        ap.error("--isa avx2 cannot narrow llama-server's build; leave it out of --targets")
    return args


def default_targets(args: argparse.Namespace) -> list[str]:
    names = list(RADIXRT)
    if args.vllm_python:
        names += list(VLLM)
    if args.llama_server and args.gguf:
        names.append(LLAMA)
    return names


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.isa == "avx2":
        narrowed_to_avx2(argv)
    from radixrt.model.default_model import resolve_model_path

    model_dir = resolve_model_path(args.model, "bfloat16")  # the peers read its bf16 folder
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    sz = sizes(args.scale, args.poisson_requests)
    if "poisson" in args.workloads and args.rate is None:
        before = args.workloads[: args.workloads.index("poisson")]
        if "w2" not in before:
            raise SystemExit("the Poisson workload needs --rate, or w2 before it in --workloads")
    result = asyncio.run(run_all(args, plan(args, model_dir, sz), vocab, sz))
    result["machine"], result["checks"] = machine(), checks(result["book"])
    out = Path(args.out) if args.out else RESULTS / "peers.json"
    write(out, args, result)
    plot(result["book"], out.with_suffix(".png"))
    print(report(result))
    print(f"wrote {out}")
    if result["failures"]:
        sys.exit(1)


def write(out: Path, args: argparse.Namespace, result: dict) -> None:
    book = result["book"]
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "config": vars(args),
        "machine": result["machine"],
        "poisson_rate": book.rate,
        "infos": result["infos"],
        "best": book.best(),
        "runs": book.runs,
        "checks": [c._asdict() | {"passed": c.passed} for c in result["checks"]],
        "exactness": book.differing() if book.outputs else None,
        "failures": result["failures"],
    }
    out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
