"""``radixrt launch``: start the three server processes and supervise them.

Children are started with the "spawn" method (torch and fork do not mix) and
get one dict each: the ipc addresses, the launcher's pid and the
``ServerConfig`` (a frozen dataclass, pickled by spawn). The launcher waits
until every child reports ready on an ipc PULL socket, prints exactly one
ready line, then watches:

- SIGTERM drains: the TokenizerManager (told by SIGUSR1) refuses new requests
  with "shutting_down", lets running ones finish for up to ``grace_period``
  seconds, aborts what is left, and reports ``Drained``; the launcher then
  stops everything and exits 0 after a clean drain, 1 when requests had to
  be aborted. A second SIGTERM, or SIGINT, stops everything at once (exit 0).
- A child that dies stops the rest (exit 1).

Children die with the launcher (PR_SET_PDEATHSIG and a parent-pid check).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time

import zmq

from radixrt.config import EngineConfig, ServerConfig
from radixrt.protocol import Drained, ProcessFailed, ProcessReady, decode
from radixrt.server.common import POLL_MS

READY_TIMEOUT_S = 600
STOP_GRACE_S = 3.0
DRAIN_SLACK_S = 10.0  # past the grace period, how long to wait for the abort replies


class Launcher:
    def __init__(self, config: EngineConfig, server: ServerConfig) -> None:
        self.config, self.server = config, server
        self.tmpdir = tempfile.mkdtemp(prefix=f"radixrt-{os.getpid()}-")  # ipc sockets
        self.addrs = {
            name: f"ipc://{self.tmpdir}/{name}"
            for name in ("scheduler_addr", "detokenizer_addr", "tokenizer_addr", "ready_addr")
        }
        self.ctx = zmq.Context()
        self.ready = self.ctx.socket(zmq.PULL)
        self.ready.setsockopt(zmq.LINGER, 0)
        self.ready.bind(self.addrs["ready_addr"])
        self.procs: dict[str, multiprocessing.Process] = {}
        self.ready_printed = False
        self.stop_signal: int | None = None  # stop at once
        self.drain_signal = False  # a first SIGTERM once ready: drain
        self.draining_since: float | None = None
        self.drain_announced = False

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self.start()
            info = self.wait_ready()
            if info is None:
                return 0 if self.stop_signal is not None else 1
            self.ready_printed = True
            server = self.server
            host = f"[{server.host}]" if ":" in server.host else server.host
            where = f"tcp://{host}:{server.port}"
            if server.http_port:
                where += f" and http://{host}:{server.http_port}"
            linears = info.get("kernels", {}).get("linear", {})
            if linears:  # which path each weight shape runs (stderr: stdout has the ready line)
                shapes = ", ".join(f"{shape}: {path}" for shape, path in linears.items())
                print(f"radixrt: linear kernels: {shapes}", file=sys.stderr, flush=True)
            if "attention" in info:
                print(f"radixrt: attention: {info['attention']}", file=sys.stderr, flush=True)
            print(
                f"radixrt ready on {where} (model {info['model_name']}, "
                f"{info['kv_slots']} KV slots)",
                flush=True,
            )
            return self.supervise()
        finally:
            self.shutdown()

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGTERM and self.ready_printed and not self.drain_signal:
            self.drain_signal = True  # announced by supervise(); the drain itself starts now,
            self.start_drain()  # not when the poll below next wakes (up to POLL_MS later)
        else:
            self.stop_signal = signum

    def start(self) -> None:
        from radixrt.server.detokenizer import run_detokenizer
        from radixrt.server.scheduler_process import run_scheduler_process
        from radixrt.server.tokenizer_manager import run_tokenizer_manager

        mp = multiprocessing.get_context("spawn")
        base = {**self.addrs, "parent_pid": os.getpid(), "server": self.server}
        self._spawn(
            mp,
            "scheduler",
            run_scheduler_process,
            {**base, "engine": dataclasses.asdict(self.config)},
        )
        from radixrt.model.loader import resolve_model_path

        base["model_path"] = resolve_model_path(self.config.model)
        self._spawn(mp, "detokenizer", run_detokenizer, base)
        pids = {name: p.pid for name, p in self.procs.items()}
        self._spawn(mp, "tokenizer_manager", run_tokenizer_manager, {**base, "pids": pids})

    def _spawn(self, mp, name: str, target, args: dict) -> None:
        proc = mp.Process(target=target, args=(args,), name=f"radixrt-{name}", daemon=True)
        proc.start()
        self.procs[name] = proc

    def wait_ready(self) -> dict | None:
        """The scheduler's info once every child is ready; None on failure or a signal."""
        pending, info = set(self.procs), {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while pending:
            if self.stop_signal is not None or self.dead_child() or time.monotonic() > deadline:
                if time.monotonic() > deadline:
                    print("radixrt: error: the server did not start in time", file=sys.stderr)
                return None
            if not self.ready.poll(200):
                continue
            msg = decode(self.ready.recv())
            if isinstance(msg, ProcessFailed):
                print(f"radixrt: error: {msg.role} failed to start:\n{msg.error}", file=sys.stderr)
                return None
            if isinstance(msg, ProcessReady):
                pending.discard(msg.role)
                if msg.role == "scheduler":
                    info = msg.info
        return info

    def dead_child(self) -> str | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return name
        return None

    def supervise(self) -> int:
        while self.stop_signal is None:
            if self.drain_signal and not self.drain_announced:
                self.drain_announced = True
                print(
                    f"radixrt: SIGTERM: draining (grace period {self.server.grace_period} s; "
                    "a second SIGTERM stops at once)",
                    file=sys.stderr,
                    flush=True,
                )
            if (
                self.draining_since is not None
                and time.monotonic()
                > self.draining_since + self.server.grace_period + DRAIN_SLACK_S
            ):
                print("radixrt: error: the drain did not finish; stopping", file=sys.stderr)
                return 1
            dead = self.dead_child()
            if dead is not None:
                print(
                    f"radixrt: error: the {dead} process exited "
                    f"(code {self.procs[dead].exitcode}); shutting down",
                    file=sys.stderr,
                )
                return 1
            if self.ready.poll(POLL_MS):  # signals set flags; seen within a second
                msg = decode(self.ready.recv())
                if isinstance(msg, ProcessFailed):
                    print(f"radixrt: error: {msg.role} failed:\n{msg.error}", file=sys.stderr)
                    return 1
                if isinstance(msg, Drained):
                    if msg.aborted:
                        print(
                            f"radixrt: grace period over; aborted {msg.aborted} running requests",
                            file=sys.stderr,
                        )
                        return 1
                    print("radixrt: drained; stopping", file=sys.stderr, flush=True)
                    return 0
        return 0

    def start_drain(self) -> None:
        self.draining_since = time.monotonic()
        os.kill(self.procs["tokenizer_manager"].pid, signal.SIGUSR1)

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self.ready.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
