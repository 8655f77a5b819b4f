"""Soak: a bounded load-and-fault run against a radixrt server.

    python bench/soak.py [--server tcp://HOST:PORT] (--short | --long | --duration S) [--clients N]

N client processes (forked from a forkserver that preloads radixrt.client; one
``AsyncClient`` each, ``--concurrency`` request loops per client) send a mix
for ``--duration`` seconds: shared-prefix prompts (a few long system prompts, as text or token
ids, plus varied questions), multi-turn chats (``messages=`` with a growing
history), streamed and unary requests, random sampling params, and a few
deliberately invalid requests. Faults: about ``--abort-fraction`` of the
requests are aborted at a random point (``abort(rid)`` after k chunks of a
stream, or after a random delay on a unary request), and about
``--kill-rate`` of the clients per minute (at least one per run) are
SIGKILLed while a stream of theirs is under way, then replaced.

Accounting. Every worker appends one JSON line per event to its own journal
(``sent`` before the request goes out, ``first`` at a stream's first token,
``done`` with the outcome), each line one ``os.write`` on an O_APPEND file, so
a SIGKILL loses nothing written. Each request sent ends as exactly one of:

- completed: a final reply (finish_reason stop / length; also an abort that
  lost the race to the request's finish);
- aborted:   finish_reason "abort";
- errored:   a ``ServerError`` (counted per code; expected for the invalid ones);
- killed:    no outcome, and its worker was SIGKILLed by the soak;
- lost:      no reply and no error within ``--request-timeout`` (the worker
  saw a timeout), or no outcome from a worker that crashed or hung.

Then it waits for the server to go idle (running == waiting == 0) and checks
the KV invariant: protected_tokens == 0 and free_slots + evictable_tokens ==
kv_slots. It reports latency / TTFT p50 / p99 and the RSS of the server's
processes (``server_info()["pids"]`` and their children, from /proc; a local
server only) before and after. Exit status 0 only when nothing was lost,
something completed and the idle invariant holds. Writes JSON to
bench/results/soak-<mode>.json (``--out`` to override).

Without ``--server`` it launches its own server (``--model tiny``: the tiny
generated llama; ``default``: the default model; or a path) and stops it at
the end with SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PRESETS = {"short": {"duration": 60.0, "clients": 8}, "long": {"duration": 600.0, "clients": 16}}
OUTCOMES = ("completed", "aborted", "errored", "killed", "lost")
WORDS = (
    "radix tree cache prefix token batch decode schedule memory page request reply stream abort "
    "kernel tensor layer head query key value rotary norm sample logits chunk eviction lock "
    "slot pool server client socket frame latency throughput"
).split()
STOPS = (["e"], ["\n"], [" the", "."], ["zz"], ["a", "o"])


# ================================================================ workload


@dataclass
class Plan:
    """One request to send: its input, params, and the fault to inject."""

    kind: str  # "shared" | "chat" | "invalid"
    inputs: dict  # prompt= / input_ids= / messages=
    params: dict
    stream: bool
    abort_after: float | None = None  # stream: chunks before abort(); unary: seconds
    expect_error: str | None = None  # the ErrorCode an invalid request must get


class Workload:
    """Random requests over shared system prompts; the prompts are the same in every worker."""

    def __init__(
        self, info: dict, rng: random.Random, abort_fraction: float, invalid_fraction: float
    ) -> None:
        self.rng, self.vocab, self.max_context = (
            rng,
            int(info["vocab_size"]),
            int(info["max_context"]),
        )
        self.abort_fraction, self.invalid_fraction = abort_fraction, invalid_fraction
        shared = random.Random(1234)  # not the worker's seed: every worker shares these prefixes
        self.systems = [
            " ".join(shared.choices(WORDS, k=shared.randint(120, 240))) for _ in range(4)
        ]
        self.system_ids = [
            [shared.randrange(10, self.vocab - 10) for _ in range(shared.randint(200, 400))]
            for _ in range(3)
        ]

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choices(WORDS, k=self.rng.randint(lo, hi)))

    def params(self) -> dict:
        rng = self.rng
        sp: dict = {"max_new_tokens": 0 if rng.random() < 0.01 else rng.randint(1, 48)}
        if rng.random() < 0.4:
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = round(rng.uniform(0.3, 1.5), 2)
            for name, value, p in (
                ("top_p", round(rng.uniform(0.5, 1.0), 2), 0.5),
                ("top_k", rng.choice([1, 5, 20, 100]), 0.5),
                ("min_p", round(rng.uniform(0.0, 0.2), 2), 0.2),
                ("seed", rng.randrange(2**31), 0.5),
            ):
                if rng.random() < p:
                    sp[name] = value
        for name, value, p in (
            ("stop", rng.choice(STOPS), 0.2),
            ("ignore_eos", True, 0.3),
            ("logprobs", True, 0.2),
        ):
            if rng.random() < p:
                sp[name] = value
        return sp

    def plan(self, kind: str, inputs: dict) -> Plan:
        stream = self.rng.random() < 0.5
        plan = Plan(kind, inputs, self.params(), stream)
        if self.rng.random() < self.abort_fraction:
            plan.abort_after = self.rng.randint(0, 8) if stream else self.rng.uniform(0.001, 0.5)
        return plan

    def shared(self) -> Plan:
        rng = self.rng
        if rng.random() < 0.5:
            ids = rng.choice(self.system_ids) + [
                rng.randrange(10, self.vocab - 10) for _ in range(rng.randint(4, 60))
            ]
            return self.plan("shared", {"input_ids": ids})
        prompt = f"{rng.choice(self.systems)}\n\nQuestion: {self.words(4, 30)}?\nAnswer:"
        return self.plan("shared", {"prompt": prompt})

    def chat_turn(self, history: list[dict]) -> Plan:
        history.append({"role": "user", "content": self.words(3, 25)})
        return self.plan("chat", {"messages": list(history)})

    def invalid(self) -> Plan:
        """A request the server must refuse, with the code it must refuse it with."""
        cases = [
            ({"input_ids": [1, 2, self.vocab + 5]}, {}, "invalid_request"),
            ({"prompt": "hello"}, {"top_p": 0.0}, "invalid_request"),
            ({"prompt": "hello"}, {"max_new_tokens": -1}, "invalid_request"),
            ({"input_ids": [11] * self.max_context}, {}, "prompt_too_long"),
        ]
        inputs, params, code = self.rng.choice(cases)
        return Plan("invalid", inputs, params, self.rng.random() < 0.5, expect_error=code)


# ================================================================== worker


class Journal:
    """Append-only JSON lines, one ``os.write`` each: what is written survives a SIGKILL."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **record) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())


async def try_abort(client, rid: str) -> str:
    """ "acked", or the error code (``unknown_rid`` when the request had already finished)."""
    from radixrt.client import ServerError

    try:
        await client.abort(rid)
        return "acked"
    except ServerError as e:
        return e.code


async def run_stream(client, plan: Plan, rid: str, timeout: float, journal: Journal) -> dict:
    t0 = time.monotonic()
    res: dict = {"tokens": 0}
    text = []
    stream = await client.generate(
        sampling_params=plan.params, stream=True, rid=rid, timeout=timeout, **plan.inputs
    )
    if plan.abort_after == 0:
        res["abort"] = await try_abort(client, rid)
    chunks = 0
    async for chunk in stream:
        chunks += 1
        if chunk.token_ids and "ttft" not in res:
            res["ttft"] = time.monotonic() - t0
            journal.write(ev="first", rid=rid)
        res["tokens"] += len(chunk.token_ids)
        text.append(chunk.text)
        res["finish_reason"] = chunk.finish_reason
        if (
            plan.abort_after
            and "abort" not in res
            and chunks >= plan.abort_after
            and chunk.finish_reason is None
        ):
            res["abort"] = await try_abort(client, rid)
    res.update(latency=time.monotonic() - t0, text="".join(text))
    return res


async def run_unary(client, plan: Plan, rid: str, timeout: float) -> dict:
    t0 = time.monotonic()
    res: dict = {}
    task = asyncio.ensure_future(
        client.generate(sampling_params=plan.params, rid=rid, timeout=timeout, **plan.inputs)
    )
    if plan.abort_after is not None:
        done, _ = await asyncio.wait({task}, timeout=plan.abort_after)
        if not done:
            res["abort"] = await try_abort(client, rid)
    out = await task
    res.update(
        latency=time.monotonic() - t0,
        tokens=len(out.token_ids),
        finish_reason=out.finish_reason,
        text=out.text,
    )
    return res


async def execute(client, plan: Plan, rid: str, timeout: float, journal: Journal) -> dict:
    """Send one request and journal its outcome; returns the ``done`` record."""
    from radixrt.client import ServerError

    journal.write(
        ev="sent",
        rid=rid,
        kind=plan.kind,
        stream=plan.stream,
        abort=plan.abort_after is not None,
        t=time.time(),
    )
    rec: dict = {"ev": "done", "rid": rid}
    try:
        run = (
            run_stream(client, plan, rid, timeout, journal)
            if plan.stream
            else run_unary(client, plan, rid, timeout)
        )
        res = await run
        rec.update(res, outcome="aborted" if res["finish_reason"] == "abort" else "completed")
    except ServerError as e:
        rec.update(outcome="errored", code=e.code, message=e.message[:200])
    except TimeoutError as e:
        rec.update(outcome="lost", reason=f"timeout: {e}")
    except Exception as e:  # a client-side failure is reported, not hidden
        rec.update(outcome="errored", code=f"client:{type(e).__name__}", message=str(e)[:200])
    if plan.expect_error is not None:
        rec["expected_error"] = plan.expect_error
    journal.write(**{k: v for k, v in rec.items() if k != "text"})
    return rec


async def request_loop(client, work: Workload, args, name: str, journal: Journal) -> None:
    """Chats and single requests, one at a time, until ``stop_at`` (or the parent is gone)."""
    rids = (f"{name}-{n}" for n in itertools.count())

    def more() -> bool:
        return time.time() < args.stop_at and parent_alive(args.parent_pid)

    while more():
        r = work.rng.random()
        if r < 0.5:
            await run_chat(client, work, args, rids, journal, more)
        else:
            plan = work.invalid() if r < 0.5 + work.invalid_fraction else work.shared()
            rec = await execute(client, plan, next(rids), args.request_timeout, journal)
            if (
                rec["outcome"] == "errored" and plan.expect_error is None
            ):  # e.g. overloaded: back off
                await asyncio.sleep(work.rng.uniform(0.05, 0.5))


async def run_chat(client, work: Workload, args, rids, journal: Journal, more) -> None:
    """2-6 turns on a shared system prompt, each sending the whole history (a reused prefix)."""
    history = [{"role": "system", "content": work.rng.choice(work.systems)}]
    for _ in range(work.rng.randint(2, 6)):
        rec = await execute(
            client, work.chat_turn(history), next(rids), args.request_timeout, journal
        )
        if rec["outcome"] == "errored":
            await asyncio.sleep(work.rng.uniform(0.05, 0.5))
        if rec["outcome"] != "completed" or not more():
            return
        history.append({"role": "assistant", "content": rec["text"]})


def parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


async def worker_main(args, index: int, journal_path: Path) -> None:
    from radixrt.client import AsyncClient

    journal = Journal(str(journal_path))
    client = AsyncClient(args.server, timeout=args.request_timeout, **api_key_kwargs(args))
    await client.connect()
    work = Workload(
        client.info,
        random.Random(args.seed * 100003 + index),
        args.abort_fraction,
        args.invalid_fraction,
    )
    try:
        await asyncio.gather(
            *(
                request_loop(client, work, args, f"w{index}-{k}", journal)
                for k in range(args.concurrency)
            )
        )
    finally:
        await client.close()


def worker_entry(args, index: int, journal_path: Path, log_path: Path) -> None:
    """A worker process (forked from the forkserver, radixrt.client already imported)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    asyncio.run(worker_main(args, index, journal_path))


def api_key_kwargs(args) -> dict:
    return {"api_key": args.api_key} if args.api_key else {}


# ================================================================== parent


@dataclass
class Worker:
    """A worker process and what its journal has said so far."""

    index: int
    proc: multiprocessing.Process
    journal: Path
    fate: str = "running"  # running | exited | killed (by the soak) | hung | crashed
    offset: int = 0
    partial: bytes = b""
    sent: dict[str, dict] = field(default_factory=dict)
    first: set[str] = field(default_factory=set)
    done: dict[str, dict] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)

    def read(self) -> None:
        """Take in the journal lines written since the last read."""
        try:
            with open(self.journal, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            rec = json.loads(line)
            if rec["ev"] == "sent":
                self.sent[rec["rid"]] = rec
            elif rec["ev"] == "first":
                self.first.add(rec["rid"])
            elif rec["rid"] in self.done or rec["rid"] not in self.sent:
                self.anomalies.append(f"unexpected done record {rec}")
            else:
                self.done[rec["rid"]] = rec

    def streaming(self) -> bool:
        """True while a stream of this worker has produced tokens and not finished."""
        return any(rid not in self.done for rid in self.first)

    def outcomes(self) -> list[dict]:
        """One record per request sent; the ones without a ``done`` line settled by the fate."""
        recs = []
        for rid, sent in self.sent.items():
            rec = dict(sent, **self.done.get(rid, {}))
            if rid not in self.done:
                rec["outcome"] = "killed" if self.fate == "killed" else "lost"
                rec["reason"] = f"no outcome; worker {self.fate} (exit code {self.proc.exitcode})"
            recs.append(rec | {"worker": self.index})
        return recs


class Fleet:
    """Keeps ``clients`` worker processes running until ``stop_at``; kills some on schedule."""

    def __init__(self, args, address: str, workdir: Path, stop_at: float) -> None:
        self.args, self.address, self.workdir, self.stop_at = args, address, workdir, stop_at
        self.rng = random.Random(args.seed)
        self.mp = multiprocessing.get_context("forkserver")
        self.mp.set_forkserver_preload(["radixrt.client"])  # workers start without importing torch
        self.workers: list[Worker] = []
        self.crashes = 0

    @property
    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.fate == "running"]

    def spawn(self) -> None:
        k = len(self.workers)
        journal = self.workdir / f"worker-{k}.jsonl"
        args = argparse.Namespace(
            **{
                **vars(self.args),
                "server": self.address,
                "stop_at": self.stop_at,
                "parent_pid": os.getpid(),
            }
        )
        proc = self.mp.Process(
            target=worker_entry,
            name=f"soak-worker-{k}",
            daemon=True,
            args=(args, k, journal, self.workdir / f"worker-{k}.log"),
        )
        proc.start()
        self.workers.append(Worker(k, proc, journal))

    def poll(self) -> None:
        """Read every journal; settle the workers that exited (and replace crashed ones)."""
        for w in self.live:
            w.read()
            if w.proc.is_alive():
                continue
            w.proc.join()
            rc = w.proc.exitcode
            w.read()
            w.fate = "exited" if rc == 0 else "crashed"
            if rc != 0:
                self.crashes += 1
                if time.time() < self.stop_at and self.crashes <= 2 * self.args.clients:
                    self.spawn()

    def kill_one(self) -> bool:
        """SIGKILL a worker in the middle of a stream and start a replacement."""
        victims = [w for w in self.live if w.streaming()]
        if not victims:
            return False
        w = self.rng.choice(victims)
        w.proc.kill()
        w.proc.join()
        w.read()
        w.fate = "killed"
        self.spawn()
        return True

    def kill_times(self, t0: float) -> list[float]:
        """Kill times spread over the middle of the run: kill_rate × clients per minute, at
        least 1."""
        duration = self.stop_at - t0
        if self.args.kill_rate <= 0:
            return []
        n = max(1, round(self.args.kill_rate * self.args.clients * duration / 60))
        return sorted(t0 + duration * self.rng.uniform(0.1, 0.85) for _ in range(n))

    def run(self) -> int:
        """Run until ``stop_at``, then let the workers finish; returns the number of kills."""
        t0 = time.time()
        for _ in range(self.args.clients):
            self.spawn()
        pending, kills = self.kill_times(t0), 0
        while time.time() < self.stop_at:
            self.poll()
            if pending and time.time() >= pending[0] and self.kill_one():
                pending.pop(0)
                kills += 1
            time.sleep(0.05)
        self.finish(self.stop_at + self.args.request_timeout + 30)
        return kills

    def finish(self, deadline: float) -> None:
        while self.live and time.time() < deadline:
            self.poll()
            time.sleep(0.1)
        for w in self.live:  # still running past every request's timeout: hung
            w.proc.kill()
            w.proc.join()
            w.read()
            w.fate = "hung"

    def stop_all(self) -> None:
        for w in self.live:
            w.proc.kill()
            w.proc.join()


# ------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """A ``python -m radixrt.cli launch`` subprocess; ready once it prints "radixrt ready"."""

    def __init__(self, args, workdir: Path) -> None:
        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "radixrt.cli",
            "launch",
            "--port",
            str(port),
            "--http-port",
            "0",
        ]
        if args.model == "tiny":
            from radixrt.testing import tiny_model_path

            cmd += ["--model", tiny_model_path("llama"), "--dtype", "float32"]
        elif args.model != "default":
            cmd += ["--model", args.model]
        if args.max_total_tokens:
            cmd += ["--max-total-tokens", str(args.max_total_tokens)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        self.log_path = workdir / "server.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(args.ready_timeout):
            self.stop()
            raise RuntimeError(f"the server printed no ready line; see {self.log_path}")
        self.returncode: int | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("radixrt ready"):
                self.ready.set()

    def stop(self) -> int | None:
        """SIGTERM (a graceful drain), SIGKILL after a minute; the launcher's exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def log_tail(self, n: int = 20) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[-n:]


def is_local(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return address.startswith("ipc://") or host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "*")


def server_rss_mb(info: dict, address: str) -> float | None:
    """Summed VmRSS (MiB) of the server's processes and their children; None when not local."""
    if not is_local(address) or "pids" not in info:
        return None
    from radixrt.testing import process_tree

    total_kb = 0
    for pid in process_tree({int(p) for p in info["pids"].values()}):
        try:
            with open(f"/proc/{pid}/status") as f:
                total_kb += next(
                    (int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0
                )
        except OSError:
            pass
    return total_kb / 1024


def wait_idle(client, timeout: float) -> dict:
    """server_info once running == waiting == 0 (and, a few seconds more, in_flight == 0)."""
    deadline = time.monotonic() + timeout
    info = client.server_info()
    while (info["running"] or info["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.25)
        info = client.server_info()
    settle = min(deadline, time.monotonic() + 5)
    while info.get("in_flight") and time.monotonic() < settle:
        time.sleep(0.25)
        info = client.server_info()
    return info


def idle_info(client, timeout: float) -> dict:
    """``wait_idle``, or {"error": ...} when the server does not answer."""
    from radixrt.client import ServerError

    try:
        return wait_idle(client, timeout)
    except (TimeoutError, ServerError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def server_accounting(before: dict, after: dict, summary: dict) -> dict:
    """Requests the scheduler finished during the run against the client-side outcomes.

    Every completed or aborted request finished there; a killed or lost one may have (the
    server aborts it) or not (refused, or never received). So ``consistent`` is
    completed + aborted <= finished <= that + killed + lost. Meaningful only when no other
    client used the server meanwhile."""
    finished = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("finished_")}
    total, low = sum(finished.values()), summary["completed"] + summary["aborted"]
    high = low + summary["killed"] + summary["lost"]
    return {
        "finished": finished,
        "finished_total": total,
        "client_range": [low, high],
        "consistent": low <= total <= high,
    }


def kv_check(info: dict) -> dict:
    if "error" in info:
        return {"ok": False, "error": info["error"]}
    idle = info["running"] == 0 and info["waiting"] == 0
    ok = (
        idle
        and info["protected_tokens"] == 0
        and info["free_slots"] + info["evictable_tokens"] == info["kv_slots"]
    )
    keys = (
        "running",
        "waiting",
        "in_flight",
        "kv_slots",
        "free_slots",
        "evictable_tokens",
        "protected_tokens",
        "cache_tokens",
        "evicted_tokens",
    )
    return {"ok": ok, **{k: info.get(k) for k in keys}}


# ---------------------------------------------------------------- report


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(recs: list[dict], elapsed: float) -> dict:
    counts = {o: sum(r["outcome"] == o for r in recs) for o in OUTCOMES}
    errors: dict[str, int] = {}
    for r in recs:
        if r["outcome"] == "errored":
            errors[r["code"]] = errors.get(r["code"], 0) + 1
    done = [r for r in recs if r["outcome"] == "completed"]
    lat = [r["latency"] for r in done]
    ttft = [r["ttft"] for r in done if r.get("stream") and "ttft" in r]
    tried = [r for r in recs if r.get("abort")]
    unexpected = [
        r for r in recs if r["outcome"] == "errored" and r.get("expected_error") != r["code"]
    ]
    wrong_success = [r for r in recs if r.get("expected_error") and r["outcome"] != "errored"]
    return {
        "sent": len(recs),
        **counts,
        "errors_by_code": errors,
        "unexpected_errors": len(unexpected) + len(wrong_success),
        "abort_attempts": len(tried),
        "abort_too_late": sum(r["outcome"] == "completed" for r in tried),
        "aborted_unrequested": sum(r["outcome"] == "aborted" and not r.get("abort") for r in recs),
        "streamed": sum(bool(r.get("stream")) for r in recs),
        "chat_turns": sum(r.get("kind") == "chat" for r in recs),
        "elapsed_s": elapsed,
        "request_throughput": len(done) / elapsed if elapsed else 0.0,
        "output_tokens": sum(r.get("tokens", 0) for r in done),
        "latency_p50_ms": 1e3 * percentile(lat, 50),
        "latency_p99_ms": 1e3 * percentile(lat, 99),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
    }


def print_table(result: dict) -> None:
    s, kv = result["summary"], result["kv_idle"]
    rss = result["server_rss_mb"]
    rows = (
        [("requests sent", s["sent"])]
        + [(o, s[o]) for o in OUTCOMES]
        + [
            (
                "errors by code",
                ", ".join(f"{k}={v}" for k, v in sorted(s["errors_by_code"].items())) or "-",
            ),
            ("unexpected errors", s["unexpected_errors"]),
            ("abort attempts / too late", f"{s['abort_attempts']} / {s['abort_too_late']}"),
            ("aborted, not requested", s["aborted_unrequested"]),
            (
                "workers started / killed / crashed / hung",
                "{started} / {killed} / {crashed} / {hung}".format(**result["workers"]),
            ),
            ("latency p50 / p99 (ms)", f"{s['latency_p50_ms']:.1f} / {s['latency_p99_ms']:.1f}"),
            ("TTFT p50 / p99 (ms, streamed)", f"{s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f}"),
            ("completed req/s", f"{s['request_throughput']:.1f}"),
            (
                "server finished (client range)",
                "{finished_total} ({client_range[0]}..{client_range[1]})".format(
                    **result["server_accounting"]
                ),
            ),
            (
                "server RSS before / after (MiB)",
                "n/a" if rss["before"] is None else f"{rss['before']:.0f} / {rss['after']:.0f}",
            ),
            (
                "idle KV: free + evictable / slots",
                f"{kv.get('free_slots')} + {kv.get('evictable_tokens')} / {kv.get('kv_slots')}",
            ),
            (
                "idle KV: protected / in_flight",
                f"{kv.get('protected_tokens')} / {kv.get('in_flight')}",
            ),
            ("idle KV invariant", "ok" if kv["ok"] else "VIOLATED"),
            ("verdict", "PASS" if result["passed"] else "FAIL"),
        ]
    )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for r in result["lost_requests"][:20]:
        print(
            f"LOST {r['rid']} kind={r.get('kind')} stream={r.get('stream')} abort={r.get('abort')} "
            f"{r.get('reason')}"
        )


# ------------------------------------------------------------------ main


def soak(args, workdir: Path) -> dict:
    from radixrt.client import Client

    server = None if args.server else OwnServer(args, workdir)
    address = args.server or server.address
    fleet = None
    try:
        with Client(address, timeout=60, **api_key_kwargs(args)) as client:
            before = client.server_info()
            rss = {"before": server_rss_mb(before, address)}
            t0 = time.time()
            fleet = Fleet(args, address, workdir, t0 + args.duration)
            kills = fleet.run()
            elapsed = time.time() - t0
            idle = idle_info(client, args.idle_timeout)
            rss["after"] = server_rss_mb(idle, address)
    finally:
        if fleet is not None:
            fleet.stop_all()
        server_died = server is not None and server.proc.poll() is not None
        server_rc = server.stop() if server is not None else None
    result = build_result(fleet, kills, elapsed, before, idle, rss)
    result.update(server_exit_code=server_rc, server_died=server_died)
    result["passed"] = result["passed"] and not server_died
    if server is not None and not result["passed"]:
        result["server_log_tail"] = server.log_tail()
    return result


def build_result(
    fleet: Fleet, kills: int, elapsed: float, before: dict, idle: dict, rss: dict[str, float | None]
) -> dict:
    recs = [r for w in fleet.workers for r in w.outcomes()]
    summary = summarize(recs, elapsed)
    kv = kv_check(idle)
    fates = [w.fate for w in fleet.workers]
    rss_before, rss_after = rss["before"], rss["after"]
    return {
        "summary": summary,
        "kv_idle": kv,
        "server_rss_mb": {
            "before": rss_before,
            "after": rss_after,
            "growth": None if None in (rss_before, rss_after) else rss_after - rss_before,
        },
        "workers": {
            "started": len(fates),
            "killed": kills,
            "crashed": fates.count("crashed"),
            "hung": fates.count("hung"),
        },
        "journal_anomalies": [a for w in fleet.workers for a in w.anomalies][:50],
        "lost_requests": [r for r in recs if r["outcome"] == "lost"][:50],
        "server_accounting": server_accounting(before, idle, summary),
        "server_hit_rate": idle.get("hit_rate"),
        "passed": summary["lost"] == 0 and kv["ok"] and summary["completed"] > 0,
    }


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=None, help="tcp://HOST:PORT (default: launch one)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--short", action="store_true", help="about 60 s, 8 clients (CI)")
    mode.add_argument("--long", action="store_true", help="10 minutes, 16 clients (a manual run)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of load")
    ap.add_argument(
        "--clients", type=int, default=None, help="client processes (default 8; --long 16)"
    )
    ap.add_argument("--concurrency", type=int, default=2, help="request loops per client")
    ap.add_argument("--abort-fraction", type=float, default=0.10)
    ap.add_argument(
        "--kill-rate",
        type=float,
        default=0.05,
        help="fraction of the clients SIGKILLed per minute (at least one kill when > 0)",
    )
    ap.add_argument(
        "--invalid-fraction", type=float, default=0.02, help="requests the server must refuse"
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="no reply nor error within this many seconds: lost",
    )
    ap.add_argument(
        "--idle-timeout", type=float, default=60.0, help="wait this long for an idle server"
    )
    ap.add_argument(
        "--api-key", default=None, help="pass api_key= to the clients (and to an own server)"
    )
    ap.add_argument("--model", default="tiny", help="own server: tiny | default | a model path")
    ap.add_argument(
        "--max-total-tokens", type=int, default=8192, help="own server's KV pool (0: its default)"
    )
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workdir", default=None, help="journals and logs (default: a temporary folder)"
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default bench/results/soak-<mode>.json)"
    )
    args = ap.parse_args(argv)
    args.mode = "short" if args.short else "long" if args.long else "custom"
    preset = PRESETS.get(args.mode, {"duration": 60.0, "clients": 8})
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="radixrt-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = soak(args, workdir)
    out = Path(args.out) if args.out else RESULTS / f"soak-{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    out.write_text(json.dumps({"config": config, "result": result}, indent=2) + "\n")
    print_table(result)
    print(f"wrote {out} (journals in {workdir})")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
