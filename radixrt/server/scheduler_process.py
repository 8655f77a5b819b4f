"""The Scheduler process: the Engine's Scheduler loop behind sockets.

Loop: read every pending message (non-blocking while there is work, blocking
up to ``POLL_MS`` when idle), then run one ``Scheduler.step()``, then send the
new token ids of every streamed request that produced some, and the whole
output of every request that finished, to the Detokenizer as one
``BatchTokenOut`` (``radixrt.output.OutputTracker``: a non-streamed request
costs nothing downstream until it finishes). Control replies and per-request errors
travel the same way, so the TokenizerManager sees them in order.

A request the Scheduler failed (finish_reason "error": a fault in its own
step, or in the forward pass of its batch) is answered with
``RidError(code=INTERNAL)`` instead of a final ``TokenDelta``. After
``max_forward_failures`` consecutive failed forward passes the process
errors out every request it still holds, says why on stderr and exits
non-zero (the launcher then stops the server) instead of spinning.
``debug_faults`` arms test-only faults (``radixrt.server.faults``).

Data parallelism: the process is replica ``args.replica`` (its outputs and
ready report say which; ``radixrt.server.spawn_args.SchedulerArgs``), runs
``args.threads`` compute threads pinned to ``args.cpus``, and, given
``args.kv_events_addr``, publishes its radix
tree's events there on a PUB socket: one ``KVEventBatch`` per loop turn that
changed the tree, numbered 1, 2, ... A ``kv_snapshot`` control request first
publishes what is pending, then answers with the whole tree as a
``KVSnapshot`` of that sequence number.

Stopping: SIGTERM (the launcher stopping the server) ends the loop between two
turns, never inside a step; the Engine shuts down, so the storage tier writes
every block it queued (with ``write_back``, the host tier's blocks too), and
the process exits 0. The launcher kills it if that takes more than its stop
grace (``radixrt.server.launcher.STOP_GRACE_S``). Before the loop starts, SIGTERM
exits at once (``radixrt.server.common.setup_child``).
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys

import msgspec
import torch
import zmq

from radixrt.output import OutputTracker
from radixrt.protocol import (
    AbortRid,
    BatchTokenOut,
    ControlReply,
    ControlRequest,
    ErrorCode,
    ErrorReply,
    KVEventBatch,
    KVSnapshot,
    RidError,
    SchedulerReady,
    TokenizedRequest,
    decode,
    encode,
)
from radixrt.quant.gguf_model import model_name
from radixrt.sampling import make_generator
from radixrt.scheduler.req import Req
from radixrt.server import faults
from radixrt.server.common import (
    POLL_MS,
    exit_if_orphaned,
    pull,
    push,
    replica_name,
    report_ready,
    run_child,
)
from radixrt.server.spawn_args import SchedulerArgs

EVENT_HWM = 10_000  # event batches queued per subscriber


class RepeatedForwardFailure(RuntimeError):
    """The forward pass failed ``max_forward_failures`` times in a row."""


class SchedulerProcess:
    def __init__(self, args: SchedulerArgs, ctx: zmq.Context) -> None:
        from radixrt.engine import Engine

        self.args = args
        self.replica = args.replica
        if args.cpus:
            os.sched_setaffinity(0, args.cpus)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.engine = Engine(args.engine)
        self.scheduler = self.engine.scheduler
        server = args.server
        self.max_waiting = server.max_waiting_requests
        self.max_forward_failures = server.max_forward_failures
        armed = faults.parse(server.debug_faults)
        if armed is not None:
            faults.install_in_scheduler(self.scheduler, armed)
        self.recv = pull(ctx, args.scheduler_addr)
        self.send = push(ctx, args.addrs.detokenizer)
        self.outputs = OutputTracker()  # every request this process still answers for
        self.events = EventPublisher(ctx, args.kv_events_addr, self.replica, self.scheduler)
        # What exists now (the model, the tokenizer, the libraries) lives as long as this
        # process: out of the collector's generations, a full collection in the middle of a
        # step walks only what serving made since.
        gc.collect()
        gc.freeze()

    def info(self) -> dict:
        eng = self.engine
        return {
            "model": eng.model_path,
            "model_name": model_name(eng.model_path),
            "kv_slots": self.scheduler.kv_capacity,
            "max_context": eng.runner.max_context,
            "vocab_size": eng.model_config.vocab_size,
            "page_size": eng.config.page_size,
            "max_waiting_requests": self.max_waiting,
            "dtype": eng.config.dtype,
            "kernels": eng.runner.kernels.describe(),
            **eng.runner.weights_info,
            "attention_backend": eng.runner.attn_backend.name,
            "attention": eng.runner.attn_backend.describe(),
            "decode_chain": eng.runner.decode_chain_info,
            "embedding_pooling": eng.config.embedding_pooling,
            "hidden_size": eng.model_config.hidden_size,
            **self.scheduler.spec.describe(),
            **eng.runner.exactness.info(),
            "replica": self.replica,
            "scheduler_pid": os.getpid(),
            "gc_frozen_objects": gc.get_freeze_count(),
            "threads": torch.get_num_threads(),
            "device": str(eng.runner.device),
        }

    def loop(self) -> None:
        """Serve until SIGTERM, then stop cleanly (``stop``)."""
        self.send.send(encode(SchedulerReady(info=self.info(), replica=self.replica)))
        sigterm = Sigterm()
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        poller.register(sigterm.fileno(), zmq.POLLIN)
        while not sigterm.received:
            exit_if_orphaned(self.args.parent_pid)
            ready = dict(poller.poll(POLL_MS if self.scheduler.idle else 0))
            if sigterm.fileno() in ready:
                sigterm.clear()  # the wake-up bytes of any handled signal
            if self.recv in ready:
                self.drain()
            if not self.scheduler.idle:
                self.scheduler.step()
            self.events.publish()
            self.emit()
            if self.scheduler.forward_failures >= self.max_forward_failures:
                self.give_up()
        self.stop()

    def stop(self) -> None:
        """Shut the engine down (its storage tier writes what it queued) and exit 0."""
        self.engine.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def give_up(self) -> None:
        """Error out every request still held, say why on stderr, and raise (exit 1)."""
        sched = self.scheduler
        why = (
            f"the forward pass failed {sched.forward_failures} times in a row "
            f"(max_forward_failures {self.max_forward_failures}); last error: "
            f"{sched.last_forward_error}"
        )
        for rid in self.outputs.rids():
            self.send.send(
                encode(
                    RidError(rid=rid, code=ErrorCode.INTERNAL, message=f"scheduler stopping: {why}")
                )
            )
        print(f"radixrt: error: scheduler: {why}; exiting", file=sys.stderr, flush=True)
        raise RepeatedForwardFailure(why)  # run_child reports it and exits 1

    def drain(self) -> None:
        while True:
            try:
                data = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(decode(data))

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedRequest):
            self.add(msg)
        elif isinstance(msg, AbortRid):
            try:
                self.scheduler.abort(msg.rid)
            except KeyError:
                pass  # finished already; its finish is on the way
        elif isinstance(msg, ControlRequest):
            self.control(msg)

    def add(self, msg: TokenizedRequest) -> None:
        if self.max_waiting is not None and len(self.scheduler.waiting) >= self.max_waiting:
            self.send.send(
                encode(
                    RidError(
                        rid=msg.rid,
                        code=ErrorCode.OVERLOADED,
                        message=f"server overloaded: {self.max_waiting} requests waiting",
                    )
                )
            )
            return
        sp = msg.sampling_params
        gen = make_generator(sp.seed) if sp.seed is not None else None
        req = Req(
            msg.rid,
            msg.input_ids,
            sp,
            self.engine.model_config.eos_token_ids,
            gen,
            msg.logprob_start_len,
            pooling=self.engine.config.embedding_pooling if msg.embed else None,
        )
        self.scheduler.add_request(req, arrived_at=msg.sent_at or None)
        self.outputs.add(req, stream=msg.stream)

    def control(self, msg: ControlRequest) -> None:
        if msg.kind == "server_info":
            data = {**self.info(), **self.scheduler.get_stats()}
        elif msg.kind == "flush_cache":
            if not self.scheduler.flush_cache():
                self.send.send(
                    encode(
                        ErrorReply(
                            req_id=msg.req_id,
                            code=ErrorCode.BUSY,
                            message="flush_cache needs an idle server",
                        )
                    )
                )
                return
            data = {"ok": True}
        elif msg.kind == "health":
            data = {"ok": True}
        elif msg.kind == "kv_snapshot":
            data = {"snapshot": msgspec.to_builtins(self.events.snapshot())}
        else:
            self.send.send(
                encode(
                    ErrorReply(
                        req_id=msg.req_id,
                        code=ErrorCode.UNKNOWN_MESSAGE,
                        message=f"unknown control request {msg.kind!r}",
                    )
                )
            )
            return
        self.send.send(encode(ControlReply(req_id=msg.req_id, data=data)))

    def emit(self) -> None:
        """Send what every tracked request produced since the last emit (unstreamed ones: once,
        when they finish)."""
        items, errors = [], []
        for req, delta in self.outputs.collect():
            if req.finish_reason == "error":
                errors.append(
                    RidError(
                        rid=req.rid,
                        code=req.error_code or ErrorCode.INTERNAL,
                        message=req.error or "internal error",
                    )
                )
            else:
                items.append(delta)
        if items:
            self.send.send(encode(BatchTokenOut(items=items, replica=self.replica)))
        for err in errors:
            self.send.send(encode(err))


class Sigterm:
    """SIGTERM sets ``received`` and makes ``fileno()`` readable, so a poll that includes it
    wakes at once (``signal.set_wakeup_fd``). Create it in the main thread."""

    def __init__(self) -> None:
        self.received = False
        self._read, self._write = socket.socketpair()
        for sock in (self._read, self._write):
            sock.setblocking(False)
        signal.set_wakeup_fd(self._write.fileno())
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def fileno(self) -> int:
        return self._read.fileno()

    def clear(self) -> None:
        """Read the wake-up bytes waiting (so the poll sleeps again)."""
        try:
            while self._read.recv(64):
                pass
        except BlockingIOError:
            pass


class EventPublisher:
    """The replica's KV events on a PUB socket (nothing without an address)."""

    def __init__(self, ctx: zmq.Context, addr: str | None, replica: int, scheduler) -> None:
        self.replica, self.tree, self.seq = replica, scheduler.kv.tree, 0
        self.page_size, self.window = self.tree.page_size, self.tree.window
        self.sock = None
        if addr is not None:
            self.sock = ctx.socket(zmq.PUB)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, EVENT_HWM)  # past it, subscribers see a gap
            self.sock.bind(addr)
            self.tree.start_recording()

    def publish(self) -> None:
        if self.sock is None:
            return
        events = self.tree.take_events()
        if events:
            self.seq += 1
            batch = KVEventBatch(
                replica=self.replica,
                seq=self.seq,
                events=events,
                page_size=self.page_size,
                window=self.window,
            )
            self.sock.send(encode(batch))

    def snapshot(self) -> KVSnapshot:
        """The whole tree, after publishing what is pending (so it matches ``seq``)."""
        self.publish()
        return KVSnapshot(
            replica=self.replica,
            seq=self.seq,
            events=self.tree.snapshot_events(),
            page_size=self.page_size,
            window=self.window,
        )


def run_scheduler_process(args: SchedulerArgs) -> None:
    role = replica_name(args.replica)

    def main(ctx: zmq.Context, ready: zmq.Socket) -> None:
        proc = SchedulerProcess(args, ctx)
        report_ready(ready, role, proc.info())
        proc.loop()

    run_child(role, args, main)
