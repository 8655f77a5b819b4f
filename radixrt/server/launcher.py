"""``radixrt launch``: start the server processes and supervise them.

The processes: the TokenizerManager (the front), the Detokenizer, and one
Scheduler per data-parallel replica (``dp_size``; replica i pinned to its own
block of CPUs, or GPU i).

Children are started with the "spawn" method (torch and fork do not mix) and
get one frozen dataclass each (``radixrt.server.spawn_args``: the ipc
addresses, the launcher's pid, the ``ServerConfig`` and the role's own
settings; a replica's ``EngineConfig`` as an object; pickled by spawn). The launcher waits
until every child reports ready on an ipc PULL socket, prints exactly one
ready line, then watches:

- SIGTERM drains: the TokenizerManager (told by SIGUSR1) refuses new requests
  with "shutting_down", lets running ones finish for up to ``grace_period``
  seconds, aborts what is left, and reports ``Drained``; the launcher then
  stops everything and exits 0 after a clean drain, 1 when requests had to
  be aborted. A second SIGTERM, or SIGINT, stops everything at once (exit 0).
- A replica that dies is announced (``ReplicaDown``, through the Detokenizer,
  so the front fails its requests and stops routing to it) and restarted with
  ``dp_restart``; without it the rest serve on, and the launcher says so.
  When no replica is left, or another child dies, everything stops (exit 1).

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
from radixrt.protocol import Drained, ProcessFailed, ProcessReady, ReplicaDown, decode, encode
from radixrt.server.common import POLL_MS, replica_index, replica_name
from radixrt.server.spawn_args import (
    Addresses,
    ChildArgs,
    DetokenizerArgs,
    FrontArgs,
    SchedulerArgs,
)

READY_TIMEOUT_S = 600
STOP_GRACE_S = 3.0
DRAIN_SLACK_S = 10.0  # past the grace period, how long to wait for the abort replies


class Launcher:
    def __init__(self, config: EngineConfig, server: ServerConfig) -> None:
        self.config, self.server = config, server
        self.tmpdir = tempfile.mkdtemp(prefix=f"radixrt-{os.getpid()}-")  # ipc sockets
        self.addrs = Addresses.in_folder(self.tmpdir, server.dp_size, server.kv_events)
        self.ctx = zmq.Context()
        self.ready = self.ctx.socket(zmq.PULL)
        self.ready.setsockopt(zmq.LINGER, 0)
        self.ready.bind(self.addrs.ready)
        self.procs: dict[str, multiprocessing.Process] = {}
        self.ready_printed = False
        self.stop_signal: int | None = None  # stop at once
        self.drain_signal = False  # a first SIGTERM once ready: drain
        self.draining_since: float | None = None
        self.drain_announced = False
        self.to_detok: zmq.Socket | None = None
        self.failed_start: set[int] = set()  # replicas not restarted again
        self.mp = multiprocessing.get_context("spawn")

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
            if "weights" in info:  # each role's type and paths, the bytes held against the file's
                print(f"radixrt: weights: {weights_line(info)}", file=sys.stderr, flush=True)
            if "attention" in info:
                print(f"radixrt: attention: {info['attention']}", file=sys.stderr, flush=True)
            if "decode_chain" in info:
                print(f"radixrt: decode chain: {info['decode_chain']}", file=sys.stderr, flush=True)
            if "exact_outputs_detail" in info:
                print(
                    f"radixrt: outputs: {info['exact_outputs_detail']}", file=sys.stderr, flush=True
                )
            n = server.dp_size
            slots = f"{n} replicas × {info['kv_slots']}" if n > 1 else f"{info['kv_slots']}"
            print(
                f"radixrt ready on {where} (model {info['model_name']}, {slots} KV slots)",
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
        from radixrt.server.tokenizer_manager import run_tokenizer_manager

        for i in range(self.server.dp_size):
            self.spawn_replica(i)
        from radixrt.model.default_model import resolve_model_path

        model_path = resolve_model_path(self.config.model, self.config.dtype)
        detok = DetokenizerArgs(**self.child(), model_path=model_path)
        self._spawn("detokenizer", run_detokenizer, detok)
        pids = {name: p.pid for name, p in self.procs.items()}
        front = FrontArgs(**self.child(), model_path=model_path, pids=pids)
        self._spawn("tokenizer_manager", run_tokenizer_manager, front)
        self.to_detok = self.ctx.socket(zmq.PUSH)  # ReplicaDown notices
        self.to_detok.setsockopt(zmq.LINGER, 0)
        self.to_detok.connect(self.addrs.detokenizer)

    def child(self) -> dict:
        """The fields every child's arguments share (``ChildArgs``)."""
        return {"parent_pid": os.getpid(), "addrs": self.addrs, "server": self.server}

    def spawn_replica(self, replica: int) -> None:
        """Start replica ``replica``'s scheduler process (also to restart one)."""
        from radixrt.server.scheduler_process import run_scheduler_process

        device = replica_device(self.config.device, replica, self.server.dp_size)
        args = SchedulerArgs(
            **self.child(),
            engine=dataclasses.replace(self.config, device=device),
            replica=replica,
            threads=self.server.replica_threads,
            cpus=replica_cpus(replica, self.server),
        )
        self._spawn(replica_name(replica), run_scheduler_process, args)

    def _spawn(self, name: str, target, args: ChildArgs) -> None:
        proc = self.mp.Process(target=target, args=(args,), name=f"radixrt-{name}", daemon=True)
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
            if dead is not None and not self.replica_died(dead):
                return 1
            if self.ready.poll(POLL_MS):  # signals set flags; seen within a second
                msg = decode(self.ready.recv())
                if isinstance(msg, ProcessFailed):
                    print(f"radixrt: error: {msg.role} failed:\n{msg.error}", file=sys.stderr)
                    if replica_index(msg.role) is None:
                        return 1
                    self.failed_start.add(replica_index(msg.role))
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

    def replica_died(self, name: str) -> bool:
        """Handle a dead child: a replica is restarted (``dp_restart``) or left out while others
        serve; True when the server goes on."""
        code = self.procs[name].exitcode
        replica = replica_index(name)
        alive = [n for n, p in self.procs.items() if replica_index(n) is not None and p.is_alive()]
        restart = (
            replica is not None
            and self.server.dp_restart
            and self.draining_since is None
            and replica not in self.failed_start
        )
        if replica is None or not (alive or restart):
            print(
                f"radixrt: error: the {name} process exited (code {code}); shutting down",
                file=sys.stderr,
            )
            return False
        self.to_detok.send(encode(ReplicaDown(replica=replica, exitcode=code, restarting=restart)))
        del self.procs[name]
        n = self.server.dp_size
        if restart:
            print(
                f"radixrt: error: replica {replica} exited (code {code}); restarting it",
                file=sys.stderr,
                flush=True,
            )
            self.spawn_replica(replica)
        else:
            print(
                f"radixrt: error: replica {replica} exited (code {code}); serving on "
                f"{len(alive)} of {n} replicas",
                file=sys.stderr,
                flush=True,
            )
        return True

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
        if self.to_detok is not None:
            self.to_detok.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def replica_device(device: str, replica: int, dp_size: int) -> str:
    """Replica i's device: with several replicas on GPUs, GPU i (counted from a given cuda:N)."""
    if dp_size == 1 or device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind == "auto":
        import torch

        if not torch.cuda.is_available():
            return device
    return f"cuda:{int(index or 0) + replica}"


def replica_cpus(replica: int, server: ServerConfig) -> tuple[int, ...] | None:
    """The CPUs replica i is pinned to (a block of ``replica_threads`` each); None with one
    replica, or when the blocks would not fit the CPUs this process may use."""
    if server.dp_size == 1:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    t = server.replica_threads
    if t * server.dp_size > len(cpus):
        return None
    return tuple(cpus[replica * t : (replica + 1) * t])


def weights_line(info: dict) -> str:
    """server_info's weights in one line: quantization, MiB held and in the files, each role."""
    kind = info.get("quantization") or "unquantized"
    roles = ", ".join(f"{role}: {what}" for role, what in info["weights"].items())
    held, files = info["weight_bytes"] / 2**20, info["weight_file_bytes"] / 2**20
    return f"{kind}, {held:.1f} MiB held (files {files:.1f} MiB); {roles}"
