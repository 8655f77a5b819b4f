"""Online serving benchmark: radixrt's RPC client (``--backend radixrt``, ``radixrt.AsyncClient``)
or the OpenAI-compatible HTTP API (``--backend openai`` for /v1/completions, ``openai-chat`` for
/v1/chat/completions), with the same workloads.

Requests arrive as a Poisson process (``--request-rate``, default: all at
once) and/or under a concurrency cap (``--max-concurrency``). Workloads:
``shared-prefix`` (G groups × Q questions on a shared system prompt, token ids),
``multi-turn`` (C conversations × T turns through the chat template, each turn
sending the whole history) and ``random`` (independent random prompts). Every
request streams, so TTFT and inter-token latency (ITL) are measured per chunk.
Reports throughput, TTFT / ITL p50 / p99 and the prefix-cache hit rate;
writes JSON (and a PNG when matplotlib is installed) under bench/results/.

    python bench/serving.py --server tcp://127.0.0.1:30000 [--workload shared-prefix] ...
    python bench/serving.py --backend openai --server http://127.0.0.1:8000 ...
    python bench/serving.py --server ADDR --compare-engine [--dtype float32]
    python bench/serving.py --backend openai --server http://HOST:8000 --compare-fronts tcp://HOST:30000

Over HTTP every request streams with ``stream_options.include_usage`` (token counts and
cached tokens from the final usage chunk; TTFT at the first chunk with a choice, which
radixrt sends with the first token). The completions backend sends a multi-turn
conversation as plain text (``role: content`` lines). The chat
backend sends text: its shared-prefix and random workloads are words (about one token each
with the default model's tokenizer) instead of token ids.

``--compare-engine`` runs the shared-prefix workload on the server (all at
once streamed, all at once not streamed, then one request at a time) and on
an ``Engine`` loaded from the server's model (in a worker process, so that
neither side shares a process with the client), interleaved, best of
``--repeats``; it reports the throughput ratio and the TTFT the server adds
(as the difference of p50s, and as ``ttft_paired_low_load``: ``--pairs`` prompts, each
cold, sent to the server and then to the Engine back to back; the p50 of the
per-pair differences does not move with the machine's drift between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from radixrt import AsyncClient

RESULTS = Path(__file__).parent / "results"


@dataclass
class Record:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


# ------------------------------------------------------------ workloads

WORDS = (
    "radix tree cache prefix token batch decode schedule memory page request reply kernel slot "
    "evict lock split match insert stream"
).split()


def _prompt(ids: list[int], chat: bool, system: int = 0) -> dict:
    """Token ids as a request; for chat, as words (``system``: how many make the system prompt)."""
    if not chat:
        return {"input_ids": ids}
    words = [WORDS[t % len(WORDS)] for t in ids]
    messages = [{"role": "system", "content": " ".join(words[:system])}] if system else []
    return {"messages": messages + [{"role": "user", "content": " ".join(words[system:])}]}


def shared_prefix(args, rng: random.Random, vocab: int) -> list[dict]:
    reqs = []
    chat = args.backend == "openai-chat"
    for _ in range(args.groups):
        system = [rng.randrange(10, vocab - 10) for _ in range(args.prefix_len)]
        for _ in range(args.questions):
            question = [rng.randrange(10, vocab - 10) for _ in range(args.question_len)]
            reqs.append(_prompt(system + question, chat, len(system)))
    rng.shuffle(reqs)
    return reqs


def random_prompts(args, rng: random.Random, vocab: int) -> list[dict]:
    chat = args.backend == "openai-chat"
    return [
        _prompt(
            [rng.randrange(10, vocab - 10) for _ in range(rng.randint(16, args.prefix_len))], chat
        )
        for _ in range(args.num_requests)
    ]


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# --------------------------------------------------------------- backends


class RadixrtBackend:
    """radixrt's ZeroMQ RPC client."""

    def __init__(self, server: str, timeout: float) -> None:
        self.client = AsyncClient(server, timeout=timeout)

    async def __aenter__(self):
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.__aexit__(*exc)

    async def flush_cache(self) -> None:
        await self.client.flush_cache()

    async def server_info(self) -> dict:
        return await self.client.server_info()

    async def request(
        self, kwargs: dict, sp: dict, stream: bool, rec: Record | None = None
    ) -> tuple[Record, str]:
        """One request; without ``stream`` TTFT is the whole latency and ITL is not measured.
        ``rec``: filled as chunks arrive (a caller may watch a stream's progress in it)."""
        rec, text, t0 = rec if rec is not None else Record(), [], time.perf_counter()
        last = t0
        client = self.client
        if not stream:
            out = await client.generate(sampling_params=sp, **kwargs)
            rec.ttft = time.perf_counter() - t0
            rec.output_tokens, rec.prompt_tokens, rec.cached_tokens = (
                len(out.token_ids),
                out.prompt_tokens,
                out.cached_tokens,
            )
            return rec, out.text
        async for chunk in await client.generate(sampling_params=sp, stream=True, **kwargs):
            now = time.perf_counter()
            if chunk.token_ids:
                if rec.output_tokens == 0:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                rec.output_tokens += len(chunk.token_ids)
            text.append(chunk.text)
            if chunk.finish_reason is not None:
                rec.prompt_tokens, rec.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
        return rec, "".join(text)


class OpenAIBackend:
    """The OpenAI-compatible HTTP API (``chat``: /v1/chat/completions, else /v1/completions), with
    SGLang's /flush_cache and /get_server_info for the rest."""

    def __init__(
        self,
        server: str,
        timeout: float,
        chat: bool,
        api_key: str | None = None,
        model: str | None = None,
    ) -> None:
        self.server, self.timeout = server.rstrip("/"), timeout
        self.model = model  # sent as the body's "model" when given (SGLang's router needs one)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.chat = chat
        self.path = "/v1/chat/completions" if chat else "/v1/completions"

    async def __aenter__(self):
        import aiohttp  # a C HTTP parser: the client takes little of the server's CPU

        self.http = aiohttp.ClientSession(
            self.server,
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    async def flush_cache(self) -> None:
        async with self.http.post("/flush_cache") as resp:
            resp.raise_for_status()

    async def server_info(self) -> dict:
        async with self.http.get("/get_server_info") as resp:
            resp.raise_for_status()
            return (await resp.json())["internal_states"][0]

    def body(self, kwargs: dict, sp: dict, stream: bool) -> dict:
        body = {
            "max_tokens": sp["max_new_tokens"],
            "temperature": sp.get("temperature", 1.0),
            "stream": stream,
            **({"ignore_eos": True} if sp.get("ignore_eos") else {}),
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.model is not None:
            body["model"] = self.model
        if self.chat:
            if "messages" not in kwargs:
                raise ValueError("--backend openai-chat sends messages (a workload made for it)")
            return {**body, "messages": kwargs["messages"]}
        if "messages" in kwargs:  # multi-turn as completions: the conversation as plain text
            lines = [f"{m['role']}: {m['content']}\n" for m in kwargs["messages"]]
            return {**body, "prompt": "".join(lines) + "assistant:"}
        return {**body, "prompt": kwargs["input_ids"]}

    def text_of(self, choice: dict) -> str:
        if self.chat:
            return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
        return choice.get("text") or ""

    async def request(
        self, kwargs: dict, sp: dict, stream: bool, rec: Record | None = None
    ) -> tuple[Record, str]:
        rec, text, t0 = rec if rec is not None else Record(), [], time.perf_counter()
        body = self.body(kwargs, sp, stream)
        if not stream:
            async with self.http.post(self.path, json=body) as resp:
                resp.raise_for_status()
                data = await resp.json()
            rec.ttft = time.perf_counter() - t0
            self._usage(rec, data["usage"])
            return rec, self.text_of(data["choices"][0])
        last, chunks = t0, 0
        async with self.http.post(self.path, json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(data["error"]["message"])
                now = time.perf_counter()
                if self.carries_tokens(data["choices"]):  # radixrt: a chunk per step
                    if not chunks:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append("".join(self.text_of(c) for c in data["choices"]))
                if data.get("usage"):
                    self._usage(rec, data["usage"])
        return rec, "".join(text)

    def carries_tokens(self, choices: list[dict]) -> bool:
        """Whether a streamed chunk brings tokens: not the usage chunk (no choices), nor a
        closing chunk with a finish_reason and no text (llama-server's after its last token)."""
        return any(self.text_of(c) or c.get("finish_reason") is None for c in choices)

    @staticmethod
    def _usage(rec: Record, usage: dict) -> None:
        rec.prompt_tokens, rec.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        rec.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]


def make_backend(args):
    if args.backend == "radixrt":
        return RadixrtBackend(args.server, args.timeout)
    return OpenAIBackend(
        args.server, args.timeout, chat=args.backend == "openai-chat", api_key=args.api_key
    )


# ---------------------------------------------------------------- runner


async def one_request(
    backend, kwargs: dict, sp: dict, stream: bool = True, rec: Record | None = None
) -> tuple[Record, str]:
    """One request through the backend; errors (overloaded, timeouts) are counted, not fatal.
    ``rec``: the Record the backend fills as chunks arrive (default: a new one)."""
    t0 = time.perf_counter()
    try:
        rec, text = await backend.request(kwargs, sp, stream, rec)
    except Exception as e:
        rec, text = Record(), ""
        rec.error = f"{type(e).__name__}: {e}"
    rec.latency = time.perf_counter() - t0
    return rec, text


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req")
            except ImportError:
                pass

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_requests(
    client,
    reqs: list[dict],
    sp: dict,
    rate: float,
    concurrency: int | None,
    progress: Progress,
    seed: int,
    stream: bool = True,
) -> list[Record]:
    sem = asyncio.Semaphore(concurrency or len(reqs) or 1)
    rng = random.Random(seed)

    async def task(kwargs: dict) -> Record:
        async with sem:
            rec, _ = await one_request(client, kwargs, sp, stream)
        progress.update()
        return rec

    tasks = []
    for kwargs in reqs:
        tasks.append(asyncio.create_task(task(kwargs)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def run_multi_turn(client, args, sp: dict, progress: Progress) -> list[Record]:
    rng = random.Random(args.seed)
    words = "radix tree cache prefix token batch decode schedule memory page request reply".split()
    sem = asyncio.Semaphore(args.max_concurrency or args.conversations)

    async def conversation(k: int) -> list[Record]:
        messages = [
            {"role": "system", "content": " ".join(rng.choices(words, k=args.prefix_len // 2))}
        ]
        recs = []
        for turn in range(args.turns):
            messages.append(
                {"role": "user", "content": f"turn {turn}: " + " ".join(rng.choices(words, k=24))}
            )
            async with sem:
                rec, text = await one_request(client, {"messages": list(messages)}, sp)
            messages.append({"role": "assistant", "content": text})
            recs.append(rec)
            progress.update()
        return recs

    per_conv = await asyncio.gather(*(conversation(k) for k in range(args.conversations)))
    return [r for recs in per_conv for r in recs]


def summarize(recs: list[Record], elapsed: float) -> dict:
    ok = [r for r in recs if r.error is None]
    ttft = [r.ttft for r in ok if r.output_tokens]
    itl = [x for r in ok for x in r.itl]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "elapsed_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out / elapsed,
        "total_throughput": (prompt + out) / elapsed,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "latency_mean_s": statistics.fmean([r.latency for r in ok]) if ok else 0.0,
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": out,
    }


async def bench_server(
    args,
    reqs: list[dict] | None,
    rate: float,
    concurrency: int | None,
    show: bool = True,
    stream: bool = True,
) -> tuple[dict, list[Record]]:
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    async with make_backend(args) as client:
        if args.flush:
            await client.flush_cache()
        forward_before = (await client.server_info()).get("forward_s", 0.0)
        total = args.conversations * args.turns if reqs is None else len(reqs)
        progress = Progress(total, show and not args.no_progress)
        t0 = time.perf_counter()
        if reqs is None:
            recs = await run_multi_turn(client, args, sp, progress)
        else:
            recs = await run_requests(
                client, reqs, sp, rate, concurrency, progress, args.seed, stream
            )
        elapsed = time.perf_counter() - t0
        progress.close()
        summary = summarize(recs, elapsed)
        info = await client.server_info()
        summary["server_hit_rate"] = info.get("hit_rate", 0.0)
        # the scheduler's forward passes during the run; the rest of elapsed_s is everything else
        summary["server_forward_s"] = info.get("forward_s", 0.0) - forward_before
    return summary, recs


async def compare_fronts(args, reqs: list[dict]) -> dict:
    """The shared-prefix workload through this backend (``--server``) and through the RPC
    client (``--compare-fronts tcp://...``, the same server), streamed and not, interleaved
    ``--repeats`` times: medians of the wall time, of the scheduler's forward passes in it, and
    of the rest (sockets, processes, HTTP, the client)."""
    rpc = argparse.Namespace(**{**vars(args), "backend": "radixrt", "server": args.compare_fronts})
    args.flush = rpc.flush = True
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats + 1):  # the first round warms up, untimed
        for name, a in ((args.backend, args), ("radixrt", rpc)):
            for stream in (True, False):
                summary, _ = await bench_server(
                    a, reqs, float("inf"), None, show=False, stream=stream
                )
                runs.setdefault(f"{name}_{'stream' if stream else 'no_stream'}", []).append(summary)
    med = statistics.median
    return {
        k: {
            "elapsed_s_median": med(r["elapsed_s"] for r in v[1:]),
            "forward_s_median": med(r["server_forward_s"] for r in v[1:]),
            "outside_forward_s_median": med(r["elapsed_s"] - r["server_forward_s"] for r in v[1:]),
            "output_throughput_median": med(r["output_throughput"] for r in v[1:]),
            "output_throughput_runs": [r["output_throughput"] for r in v[1:]],
        }
        for k, v in runs.items()
    }


# ------------------------------------------------------- engine compare


class WorkerProcess:
    """``target(conn, *args)`` in a spawned process, answering calls over a pipe
    (``serve_calls`` on its side); ``_call`` raises RuntimeError with the worker's error."""

    def __init__(self, target, *args) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self._call("ready")

    def _call(self, method: str, *args):
        self.conn.send((method, args))
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"worker process: {value}")
        return value

    def close(self) -> None:
        self.conn.send(("stop", ()))
        self.proc.join(30)


def serve_calls(conn, methods: dict) -> None:
    """The worker's side of ``WorkerProcess``: (method, args) in, (ok, value) out, until
    "stop"; "ready" answers True."""
    methods = {"ready": lambda: True, **methods}
    while True:
        method, args = conn.recv()
        if method == "stop":
            return
        try:
            conn.send((True, methods[method](*args)))
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            conn.send((False, f"{type(e).__name__}: {e}"))


class EngineRunner(WorkerProcess):
    """The Engine on the server's model, for --compare-engine, in a process of its own.

    Not in this process: a second PyTorch process computing on the same cores
    changes how fast the other one's forward runs (measured: the server's
    forward ran ~7 % slower while this process held an Engine, ~8 % faster
    with that Engine's OpenMP threads set passive), so both sides are
    measured as processes apart from the client, and the client does no
    compute. Times are taken inside the worker, around ``Engine.generate``.
    """

    def __init__(self, model: str, dtype: str, max_total_tokens: int | None) -> None:
        super().__init__(_engine_worker, model, dtype, max_total_tokens)

    def throughput(self, reqs: list[dict], max_new_tokens: int) -> dict:
        return self._call("throughput", [r["input_ids"] for r in reqs], max_new_tokens)

    def ttft_low_load(self, reqs: list[dict]) -> float:
        """p50 ms of a 1-token generate, one request at a time (what TTFT is in-process)."""
        return 1e3 * percentile([self.first_token(r["input_ids"])[0] for r in reqs], 50)

    def first_token(self, input_ids: list[int]) -> tuple[float, float]:
        """(wall s, forward s) of a 1-token generate on a cold cache."""
        return self._call("first_token", input_ids)


def _engine_worker(conn, model: str, dtype: str, max_total_tokens: int | None) -> None:
    from radixrt import Engine, SamplingParams

    eng = Engine(model=model, dtype=dtype, max_total_tokens=max_total_tokens)
    eng.generate(input_ids=[[11, 12, 13, 14]], sampling_params=SamplingParams(max_new_tokens=2))

    def throughput(ids: list[list[int]], max_new_tokens: int) -> dict:
        eng.flush_cache()
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=ids, sampling_params=sp)
        elapsed = time.perf_counter() - t0
        out_tokens = sum(len(o.token_ids) for o in outs)
        return {
            "elapsed_s": elapsed,
            "output_throughput": out_tokens / elapsed,
            "total_throughput": (out_tokens + sum(map(len, ids))) / elapsed,
        }

    def first_token(ids: list[int]) -> tuple[float, float]:
        eng.flush_cache()
        before = eng.stats().get("forward_s", 0.0)
        t0 = time.perf_counter()
        eng.generate(
            input_ids=[ids],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        )
        return time.perf_counter() - t0, eng.stats().get("forward_s", 0.0) - before

    serve_calls(conn, {"throughput": throughput, "first_token": first_token})


async def paired_ttft(client, engine: EngineRunner, reqs: list[dict]) -> dict:
    """TTFT added by the server, measured in pairs: for each prompt (cold cache each time) the
    server's first streamed chunk and the Engine's 1-token generate, back to back. The median
    of the differences is robust to the machine's drift between whole runs.

    The pairs alternate which side goes first: the first forward of a pair runs ~4 % slower
    than the second on this kind of machine, whoever runs it (measured with two identical
    Engine workers: 8-9 ms on a 210 ms forward), so a fixed order would bill that to one side.

    Both sides also report the time spent in their forward pass (``forward_s``; the same code
    in both), so the added time splits into "outside the forward" (sockets, processes,
    scheduling: what the server adds) and the difference between the two forwards."""
    added, outside, forward_diff, server, local = [], [], [], [], []

    async def on_server(prompt: dict) -> tuple[float, float]:
        await client.flush_cache()
        before = (await client.server_info()).get("forward_s", 0.0)
        rec, _ = await client.request(prompt, {"max_new_tokens": 1, "temperature": 0.0}, True)
        return rec.ttft, (await client.server_info()).get("forward_s", 0.0) - before

    for i, r in enumerate(reqs):
        if i % 2 == 0:
            first, s_fwd = await on_server(r)
            mine, e_fwd = engine.first_token(r["input_ids"])
        else:
            mine, e_fwd = engine.first_token(r["input_ids"])
            first, s_fwd = await on_server(r)
        server.append(first)
        local.append(mine)
        added.append(first - mine)
        outside.append((first - s_fwd) - (mine - e_fwd))
        forward_diff.append(s_fwd - e_fwd)
    ms = lambda xs: 1e3 * percentile(xs, 50)  # noqa: E731
    # Split the forward difference by pair order: the sides alternate, so a forward follows the
    # same process's previous forward when it goes first (server first: S E | E S | S E ...).
    # Server first = d - c, Engine first = d + c: d is the server's own forward penalty, c
    # what following the other process's forward costs.
    server_first, engine_first = ms(forward_diff[0::2]), ms(forward_diff[1::2])
    return {
        "pairs": len(reqs),
        "server_p50_ms": ms(server),
        "engine_p50_ms": ms(local),
        "added_p50_ms": ms(added),
        "added_outside_forward_p50_ms": ms(outside),
        "forward_diff_p50_ms": ms(forward_diff),
        "forward_diff_server_first_p50_ms": server_first,
        "forward_diff_engine_first_p50_ms": engine_first,
        "forward_penalty_d_ms": (server_first + engine_first) / 2,
        "order_effect_c_ms": (engine_first - server_first) / 2,
    }


async def compare(args, reqs: list[dict]) -> dict:
    """Best of ``--repeats`` interleaved runs of each mode (robust to a busy machine)."""
    if args.backend == "openai-chat":
        raise SystemExit("--compare-engine sends token ids: use --backend openai or radixrt")
    async with make_backend(args) as client:
        info = await client.server_info()
    engine = EngineRunner(
        info["model"], args.dtype or info.get("dtype", "auto"), info.get("kv_slots")
    )
    args.flush = True
    runs: dict[str, list[dict]] = {
        "server": [],
        "server_no_stream": [],
        "server_low_load": [],
        "engine": [],
    }
    try:
        # Warm-up, untimed: one full run on each side (first touch of activation and KV memory;
        # a process's first run of a workload is 10-30 % slower here than its later ones).
        await bench_server(args, reqs, float("inf"), None, show=False)
        engine.throughput(reqs, args.max_new_tokens)
        for _ in range(args.repeats):
            runs["server"].append(
                (await bench_server(args, reqs, float("inf"), None, show=False))[0]
            )
            runs["server_no_stream"].append(
                (await bench_server(args, reqs, float("inf"), None, show=False, stream=False))[0]
            )
            runs["server_low_load"].append(
                (await bench_server(args, reqs[:8], float("inf"), 1, show=False))[0]
            )
            runs["engine"].append(engine.throughput(reqs, args.max_new_tokens))
            runs["engine"][-1]["ttft_p50_ms_low_load"] = engine.ttft_low_load(reqs[:8])
        async with make_backend(args) as client:
            ttft_pairs = await paired_ttft(client, engine, reqs[: args.pairs])
    finally:
        engine.close()
    best = {k: max(v, key=lambda r: r["output_throughput"]) for k, v in runs.items()}
    engine_ttft = min(r["ttft_p50_ms_low_load"] for r in runs["engine"])
    server_ttft = min(r["ttft_p50_ms"] for r in runs["server_low_load"])
    tput = {k: [r["output_throughput"] for r in v] for k, v in runs.items()}
    # each repeat runs the server and the Engine back to back: the median of the per-repeat ratios
    # does not move with the machine's drift between repeats
    paired = {
        k: statistics.median(a / b for a, b in zip(tput[k], tput["engine"]))
        for k in ("server", "server_no_stream")
    }
    return {
        **best,
        "repeats": args.repeats,
        "output_throughput_runs": tput,
        "throughput_ratio_paired_median": paired["server"],
        "throughput_ratio_no_stream_paired_median": paired["server_no_stream"],
        "throughput_ratio": best["server"]["output_throughput"]
        / best["engine"]["output_throughput"],
        "throughput_ratio_no_stream": (
            best["server_no_stream"]["output_throughput"] / best["engine"]["output_throughput"]
        ),
        "ttft_ms_low_load": {"server": server_ttft, "engine": engine_ttft},
        "ttft_added_ms_low_load": server_ttft - engine_ttft,
        "ttft_paired_low_load": ttft_pairs,
    }


# ------------------------------------------------------------------ main


def plot(recs: list[Record], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.hist([1e3 * r.ttft for r in recs if r.error is None], bins=30)
    a.set_xlabel("TTFT (ms)"), a.set_ylabel("requests")
    itl = sorted(1e3 * x for r in recs for x in r.itl)
    b.plot(itl, [i / max(1, len(itl)) for i in range(len(itl))])
    b.set_xlabel("ITL (ms)"), b.set_ylabel("CDF")
    fig.tight_layout()
    fig.savefig(path)


def table(result: dict, compare: bool) -> str:
    """The figures as a Markdown table (the JSON holds everything)."""
    cols = (
        "elapsed_s",
        "output_throughput",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "hit_rate",
    )
    rows = (
        [(k, result[k]) for k in ("server", "server_no_stream", "server_low_load", "engine")]
        if compare
        else [("run", result)]
    )
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in rows:
        lines.append(
            f"| {name} | " + " | ".join(f"{r[c]:.3f}" if c in r else "-" for c in cols) + " |"
        )
    if compare:
        p = result["ttft_paired_low_load"]
        lines.append(
            f"\nthroughput server/engine, best of each: {result['throughput_ratio']:.3f} streamed, "
            f"{result['throughput_ratio_no_stream']:.3f} unstreamed; median of the per-repeat "
            f"ratios: {result['throughput_ratio_paired_median']:.3f} streamed, "
            f"{result['throughput_ratio_no_stream_paired_median']:.3f} unstreamed; "
            "TTFT added at low load "
            f"(paired p50): {p['added_p50_ms']:.2f} ms ({p['added_outside_forward_p50_ms']:.2f} ms "
            f"outside the forward); TTFT p50 one request at a time: server "
            f"{result['ttft_ms_low_load']['server']:.1f} ms, "
            f"Engine {result['ttft_ms_low_load']['engine']:.1f} ms"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--server", required=True, help="tcp://HOST:PORT (radixrt) or http://HOST:PORT (openai*)"
    )
    ap.add_argument("--backend", choices=("radixrt", "openai", "openai-chat"), default="radixrt")
    ap.add_argument(
        "--api-key", default=None, help="HTTP backends: sent as Authorization: Bearer KEY"
    )
    ap.add_argument(
        "--workload", choices=("shared-prefix", "multi-turn", "random"), default="shared-prefix"
    )
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (req/s)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--num-requests", type=int, default=64, help="random workload")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--flush", action="store_true", help="flush the server's cache first")
    ap.add_argument("--compare-engine", action="store_true")
    ap.add_argument(
        "--compare-fronts",
        default=None,
        metavar="tcp://HOST:PORT",
        help="with an HTTP --backend: the same server's RPC address, to compare the two fronts",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="--compare-engine: best of N interleaved runs"
    )
    ap.add_argument(
        "--pairs", type=int, default=24, help="--compare-engine: prompts in the paired TTFT test"
    )
    ap.add_argument(
        "--dtype", default=None, help="Engine dtype for --compare-engine (default: the server's)"
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--out", default=None, help="JSON path (default bench/results/serving_<workload>.json)"
    )
    return ap.parse_args(argv)


async def amain(args) -> dict:
    async with make_backend(args) as client:
        vocab = (await client.server_info())["vocab_size"]
    rng = random.Random(args.seed)
    if args.compare_engine:
        return await compare(args, shared_prefix(args, rng, vocab))
    if args.compare_fronts:
        if args.backend == "radixrt":
            raise SystemExit(
                "--compare-fronts compares an HTTP backend (--backend openai) with the RPC client"
            )
        return await compare_fronts(args, shared_prefix(args, rng, vocab))
    reqs = {"shared-prefix": shared_prefix, "random": random_prompts}.get(args.workload)
    summary, recs = await bench_server(
        args, reqs(args, rng, vocab) if reqs else None, args.request_rate, args.max_concurrency
    )
    args._recs = recs
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    result = asyncio.run(amain(args))
    name = (
        "serving_compare"
        if args.compare_engine
        else "serving_fronts"
        if args.compare_fronts
        else f"serving_{args.workload.replace('-', '_')}"
    )
    if args.backend != "radixrt":
        name += f"_{args.backend.replace('-', '_')}"
    out = Path(args.out) if args.out else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    config["request_rate"] = str(config["request_rate"])
    out.write_text(json.dumps({"config": config, "result": result}, indent=2) + "\n")
    if getattr(args, "_recs", None):
        plot(args._recs, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    if not args.compare_fronts:
        print(table(result, args.compare_engine))
    else:
        for k, v in result.items():
            print(
                f"| {k} | "
                + " | ".join(
                    f"{v[c]:.3f}"
                    for c in (
                        "elapsed_s_median",
                        "forward_s_median",
                        "outside_forward_s_median",
                        "output_throughput_median",
                    )
                )
                + " |"
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
