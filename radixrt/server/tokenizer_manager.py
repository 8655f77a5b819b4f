"""The TokenizerManager process: the server's front door.

It builds the front's roles and runs their loop; each role is a module:

- ``rpc``: the ZeroMQ ROUTER clients connect to (frames, keys, pings);
- ``http``: the OpenAI and SGLang endpoints (``http_port`` > 0), on the same
  asyncio loop, through the ``front_api.FrontApi`` interface;
- ``front``: the operations both share (admit, submit, abort, control, info);
- ``admission``: API keys, tokenizer and chat template, limits, validation;
- ``request_table``: the requests in flight, by rid and by client;
- ``replicas``: the replicas, the router, the KV-event mirrors;
- ``responses``: text deltas back to ZeroMQ clients and HTTP sinks, metrics;
- ``controls``: control requests fanned out to every replica;
- ``drain``: the SIGTERM drain (SIGUSR1 from the launcher).

A request from either side becomes a ``TokenizedRequest`` to one replica;
its text deltas come back from the Detokenizer as ``BatchTextOut`` and are
routed to the client. Every bad input gets an error answer; nothing a client
sends can stop the loop.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import zmq

from radixrt import grammar
from radixrt.protocol import (
    AbortRid,
    BatchTextOut,
    ControlReply,
    ErrorCode,
    ErrorReply,
    ReplicaDown,
    RidError,
    SchedulerReady,
    decode,
)
from radixrt.server.admission import Admission
from radixrt.server.common import (
    POLL_MS,
    exit_if_orphaned,
    handle_pending,
    pull,
    report_ready,
    run_child,
)
from radixrt.server.controls import Controls
from radixrt.server.drain import Drain
from radixrt.server.front import Front
from radixrt.server.metrics import ServerMetrics
from radixrt.server.replicas import ReplicaSet
from radixrt.server.request_table import RequestTable
from radixrt.server.responses import Responses
from radixrt.server.rpc import RpcServer
from radixrt.server.spawn_args import FrontArgs

SCHEDULER_START_TIMEOUT_S = 600


def http_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for the HTTP server, made before the process reports ready: a taken
    port fails start-up, and connections made once the ready line is out wait in its backlog."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class TokenizerManager:
    def __init__(self, args: FrontArgs, ctx: zmq.Context, launcher: zmq.Socket | None) -> None:
        from transformers import AutoTokenizer

        self.parent_pid, server = args.parent_pid, args.server
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        grammar.preload()  # requests with a json_schema, regex or ebnf are parsed here
        self.replicas = ReplicaSet(ctx, server, args.addrs)
        self.requests = RequestTable(self.replicas.router)
        self.drain = Drain(server.grace_period, self.requests, self.replicas, launcher)
        self.controls = Controls(self.replicas)
        metrics = ServerMetrics()
        self.front = Front(
            server,
            Admission(server, tokenizer, self.requests, self.drain),
            self.requests,
            self.replicas,
            self.controls,
            self.drain,
            metrics,
            args.pids,
        )
        self.rpc = RpcServer(ctx, server, self.front, self.requests, self.controls)
        self.responses = Responses(self.requests, metrics, self.rpc.reply)
        self.from_detok = pull(ctx, args.addrs.front)
        self.wake: asyncio.Event | None = None  # set to run pump() now
        self.http_sock = http_socket(server.host, server.http_port) if server.http_port else None

    def wait_for_scheduler(self) -> None:
        """Wait until every replica reported its limits."""
        deadline = time.monotonic() + SCHEDULER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            exit_if_orphaned(self.parent_pid)
            if self.from_detok.poll(POLL_MS):
                msg = decode(self.from_detok.recv())
                if isinstance(msg, SchedulerReady):
                    self.replicas.on_up(msg)
                    if self.replicas.all_up:
                        return
        raise TimeoutError("the scheduler did not report its limits")

    def run(self) -> None:
        """Serve until the process is stopped: the sockets, and HTTP when it is on."""
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        runner(self.serve())

    async def serve(self) -> None:
        tasks = [self.socket_loop()]
        if self.http_sock is not None:
            from radixrt.server.http.app import serve_http

            tasks.append(serve_http(self.front, self.http_sock))
        await asyncio.gather(*tasks)

    async def socket_loop(self) -> None:
        """Wake when a ZeroMQ socket has something (their FDs signal edges), or every POLL_MS."""
        loop = asyncio.get_running_loop()
        events = self.replicas.events_in
        socks = tuple(s for s in (self.from_detok, *self.rpc.sockets, events) if s is not None)
        wake = self.wake = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, self.on_drain_signal)
        for sock in socks:
            loop.add_reader(sock.getsockopt(zmq.FD), wake.set)
        while True:
            self.pump()
            wake.clear()
            if any(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN for sock in socks):
                await asyncio.sleep(0)  # more came in meanwhile; let the HTTP side run first
                continue
            try:
                await asyncio.wait_for(wake.wait(), POLL_MS / 1000)
            except TimeoutError:
                pass

    def pump(self) -> None:
        """Handle what the sockets hold, probe clients when due, advance a drain."""
        exit_if_orphaned(self.parent_pid)
        events = self.replicas.events_in
        if events is not None:  # first: the requests routed next see the trees as of now
            handle_pending(events, lambda frames: self.on_kv_events(frames[0]))
        handle_pending(self.from_detok, lambda frames: self.on_backend(frames[0]))
        self.rpc.poll()
        self.drain.step()

    def on_drain_signal(self, *_) -> None:
        self.drain.request()
        if self.wake is not None:
            self.wake.set()

    def on_backend(self, data: bytes) -> None:
        """A message from the Detokenizer: text, a request's failure, a control answer, a
        replica going down or (re)starting."""
        msg = decode(data)
        if isinstance(msg, BatchTextOut):
            self.responses.on_text_batch(msg)
        elif isinstance(msg, RidError):
            self.replicas.send(msg.rid, AbortRid(rid=msg.rid))  # frees its KV if it still runs
            self.responses.fail(msg.rid, msg.code, msg.message)
        elif isinstance(msg, (ControlReply, ErrorReply)):
            self.controls.on_reply(msg)
        elif isinstance(msg, ReplicaDown):
            self.on_replica_down(msg)
        elif isinstance(msg, SchedulerReady):
            self.replicas.on_up(msg)

    def on_replica_down(self, msg: ReplicaDown) -> None:
        """Fail the replica's requests, answer controls without it, route around it."""
        why = f"replica {msg.replica} exited (code {msg.exitcode})"
        for rid in self.replicas.on_down(msg.replica):
            self.responses.fail(rid, ErrorCode.REPLICA_FAILED, f"{why} while running this request")
        self.controls.on_replica_down(msg.replica)

    def on_kv_events(self, data: bytes) -> None:
        """A replica's event batch; a gap in it asks the replica for a snapshot."""
        replica = self.replicas.on_kv_events(data)
        if replica is not None:
            self.controls.fan_out(
                "kv_snapshot", lambda r: self.replicas.on_snapshot(replica, r), None, replica.index
            )


def run_tokenizer_manager(args: FrontArgs) -> None:
    def main(ctx: zmq.Context, ready: zmq.Socket) -> None:
        tm = TokenizerManager(args, ctx, ready)
        signal.signal(signal.SIGUSR1, tm.on_drain_signal)  # until the event loop takes it over
        tm.wait_for_scheduler()
        report_ready(ready, "tokenizer_manager", tm.front.info())
        tm.run()

    run_child("tokenizer_manager", args, main)
