"""The TokenizerManager process: the server's front door.

A ZeroMQ ROUTER on tcp://HOST:PORT. For each request it checks the API key,
tokenizes (applying the chat template to ``messages``), validates against the
limits, assigns a server rid and pushes a ``TokenizedRequest`` to the
Scheduler; text deltas from the Detokenizer are routed back by client
identity, streamed or gathered into one ``GenerateOutput``. Every bad input
gets an ``ErrorReply``; nothing a client sends can stop the loop.

- Vanished clients: the ROUTER is ``ROUTER_MANDATORY``, so a reply to a client
  that went away fails with EHOSTUNREACH and that client's requests are
  aborted (their KV is freed). Clients with work in flight are sent a ``Ping``
  when the socket monitor reports a disconnect and every ``PROBE_S`` seconds
  (the disconnect event may arrive before the peer's pipe is gone).
- Settings: ``args.server``, the ``radixrt.config.ServerConfig``
  (``args``: a ``radixrt.server.spawn_args.FrontArgs``).
- Limits (``radixrt launch --help``): frames over ``max_message_bytes`` get
  ``too_large`` (ZeroMQ drops a connection that sends a frame over four times
  that, unread, so memory stays bounded); prompts over ``max_prompt_tokens``
  get ``prompt_too_long``; ``max_new_tokens`` over ``max_new_tokens_limit`` and
  more than ``max_requests_per_client`` requests in flight on one connection
  get ``limit_exceeded``.
- Who may connect: with ``api_key`` (one key, or several separated by commas)
  every message must carry one of them, else ``unauthorized``;
  ``isolate_by_api_key`` prefixes each request's ``cache_salt`` with a hash of
  its key, so tenants never share cached prefixes. With ``curve_keys`` the
  socket is a CurveZMQ server (``server.key_secret`` in that folder).
- Drain: SIGUSR1 (sent by the launcher on SIGTERM) makes new requests fail
  with ``shutting_down``; running ones finish, or are aborted once
  ``grace_period`` seconds have passed; then ``Drained`` goes to the launcher
  (once every HTTP response is written, too).
- HTTP (``http_port`` > 0): the OpenAI and SGLang endpoints of
  ``radixrt.server.http`` run in this process, on the same asyncio loop
  as the sockets, sharing the request table, tokenizer, limits and keys. An
  HTTP request is a ``ClientReq`` with a ``sink`` (an asyncio queue that
  receives ``(index, TextDelta | RequestError)``) instead of a ZeroMQ
  identity; its "client", for the in-flight limit, is its API key, or its
  peer address without one.
- Metrics: every answered request is observed in ``metrics``
  (``radixrt.server.metrics``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import hmac
import itertools
import os
import signal
import socket
import time

import msgspec
import zmq

from radixrt import grammar
from radixrt.config import ServerConfig
from radixrt.grammar import GrammarError
from radixrt.output import cached_tokens_details
from radixrt.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    AbortRid,
    BatchTextOut,
    ControlReply,
    ControlRequest,
    Drained,
    ErrorCode,
    ErrorReply,
    GenerateOutput,
    GenerateReply,
    GenerateRequest,
    Hello,
    HelloReply,
    KVEventBatch,
    KVSnapshot,
    Ping,
    ReplicaDown,
    ReplyBatch,
    RidError,
    SchedulerReady,
    StreamChunk,
    TextDelta,
    TokenizedRequest,
    classify_bad_frame,
    decode,
    encode,
)
from radixrt.sampling import SamplingParams
from radixrt.server.common import (
    POLL_MS,
    exit_if_orphaned,
    pull,
    push,
    replica_name,
    report_ready,
    run_child,
)
from radixrt.server.controls import Gather, split_id, sub_id
from radixrt.server.metrics import ServerMetrics
from radixrt.server.routing import Replica, Router
from radixrt.server.spawn_args import FrontArgs

CONTROL_KINDS = ("server_info", "flush_cache", "health", "kv_snapshot")
SCHEDULER_START_TIMEOUT_S = 600
PROBE_S = 2.0
HARD_SIZE_FACTOR = 4  # ZMQ_MAXMSGSIZE = this × max_message_bytes


class _ReqIdOnly(msgspec.Struct):
    """Reads just the req_id of a frame too large to decode in full."""

    req_id: str = ""


def curve_server_keys(folder: str) -> tuple[bytes, bytes]:
    """(public, secret) from ``folder/server.key_secret`` (made by ``radixrt curve-keygen``)."""
    import zmq.auth

    path = os.path.join(folder, "server.key_secret")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--curve-keys: no {path} (create it with `radixrt curve-keygen {folder}`)"
        )
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"--curve-keys: {path} holds no secret key")
    return public, secret


class RequestError(Exception):
    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status  # the HTTP status, where the code alone does not decide it


class ClientReq:
    """One request in flight: who asked, and what it has produced so far."""

    __slots__ = (
        "identity",
        "req_id",
        "stream",
        "texts",
        "token_ids",
        "logprobs",
        "sink",
        "index",
        "arrived",
        "last_token_at",
        "generated",
    )

    def __init__(
        self,
        identity: bytes,
        req_id: str,
        stream: bool,
        sink: asyncio.Queue | None = None,
        index: int = 0,
    ) -> None:
        self.identity, self.req_id, self.stream = identity, req_id, stream
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None
        self.sink, self.index = sink, index  # HTTP: the handler's queue, and this choice's index
        self.arrived = time.monotonic()
        self.last_token_at: float | None = None
        self.generated = 0


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
    def __init__(self, args: FrontArgs, ctx: zmq.Context) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.server: ServerConfig = args.server
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        grammar.preload()  # requests with a json_schema, regex or ebnf are parsed here
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, HARD_SIZE_FACTOR * self.server.max_message_bytes)
        self.api_keys = self.server.api_keys  # derived once: checked on every message
        if self.server.curve_keys is not None:
            public, secret = curve_server_keys(self.server.curve_keys)
            self.router.curve_publickey, self.router.curve_secretkey = public, secret
            self.router.curve_server = True
        self.router.bind(f"tcp://{self.server.host}:{self.server.port}")
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.from_detok = pull(ctx, args.addrs.front)
        self.replicas = [Replica(i, push(ctx, a)) for i, a in enumerate(args.addrs.schedulers)]
        self.routing = Router(self.server, self.replicas)
        self.events_in, self.events_out = kv_event_sockets(ctx, args, self.server)
        self.limits: dict = {}
        self.reqs: dict[str, ClientReq] = {}  # server rid -> state
        self.rids: dict[tuple[bytes, str], str] = {}  # (identity, req_id) -> rid
        self.gathers: dict[str, Gather] = {}  # qid -> a control request awaiting replicas
        self.counter = itertools.count()
        self.in_flight: collections.Counter[bytes] = collections.Counter()  # identity -> requests
        self.next_probe = 0.0
        self.ready_sock: zmq.Socket | None = None  # to the launcher (Drained)
        self.drain_requested = False
        self.drain_deadline: float | None = None
        self.drain_aborted = 0
        self.drained = False
        self.wake: asyncio.Event | None = None  # set to run pump() now
        self.metrics = ServerMetrics()
        self.http_open = 0  # HTTP responses not yet fully written
        port = self.server.http_port
        self.http_sock = http_socket(self.server.host, port) if port else None

    # ------------------------------------------------------------ loop

    def wait_for_scheduler(self) -> None:
        """Wait until every replica reported its limits."""
        deadline = time.monotonic() + SCHEDULER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            exit_if_orphaned(self.args.parent_pid)
            if self.from_detok.poll(POLL_MS):
                msg = decode(self.from_detok.recv())
                if isinstance(msg, SchedulerReady):
                    self.on_replica_up(msg)
                    if all(r.up for r in self.replicas):
                        return
        raise TimeoutError("the scheduler did not report its limits")

    def on_replica_up(self, msg: SchedulerReady) -> None:
        replica = self.replicas[msg.replica]
        replica.up, replica.info = True, msg.info
        replica.mirror.reset()  # a fresh process: an empty tree, events from seq 1
        self.limits = self.limits or msg.info

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
            from radixrt.server.http import serve_http

            tasks.append(serve_http(self, self.http_sock))
        await asyncio.gather(*tasks)

    async def socket_loop(self) -> None:
        """Wake when a ZeroMQ socket has something (their FDs signal edges), or every POLL_MS."""
        loop = asyncio.get_running_loop()
        socks = tuple(s for s in (self.from_detok, self.router, self.monitor, self.events_in) if s)
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
        exit_if_orphaned(self.args.parent_pid)
        if self.events_in is not None:  # first: the requests routed next see the trees as of now
            self.drain(self.events_in, lambda frames: self.on_kv_events(frames[0]))
        self.drain(self.from_detok, lambda frames: self.on_backend(frames[0]))
        self.drain(self.router, self.on_client)
        if self.drain(self.monitor, lambda frames: None):
            self.ping_clients()
        if time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + PROBE_S
            self.ping_clients()
        if self.drain_requested:
            self.step_drain()

    # ----------------------------------------------------------- drain

    def on_drain_signal(self, *_) -> None:
        self.drain_requested = True
        if self.wake is not None:
            self.wake.set()

    def step_drain(self) -> None:
        """Advance the SIGTERM drain: wait, abort what outlives the grace period, report."""
        now = time.monotonic()
        if self.drain_deadline is None:
            self.drain_deadline = now + self.server.grace_period
        if self.drained:
            return
        if not self.reqs and not self.http_open:
            self.drained = True
            if self.ready_sock is not None:
                self.ready_sock.send(encode(Drained(aborted=self.drain_aborted)))
        elif now >= self.drain_deadline and not self.drain_aborted:
            self.drain_aborted = len(self.reqs)
            for rid in self.reqs:
                self.to_replica(rid, AbortRid(rid=rid))

    @staticmethod
    def drain(sock: zmq.Socket, handle) -> int:
        """Handle up to 1024 messages (bounded, so neither side starves the other); how many."""
        for n in range(1024):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            handle(frames)
        return 1024

    def reply(self, identity: bytes, msg: msgspec.Struct) -> None:
        try:
            self.router.send_multipart([identity, encode(msg)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.drop_client(identity)

    def ping_clients(self) -> None:
        """Probe every client with work in flight; the ones that left get dropped."""
        identities = {st.identity for st in self.reqs.values() if st.sink is None} | {
            g.identity for g in self.gathers.values() if g.identity is not None
        }
        for identity in identities:
            self.reply(identity, Ping())

    def error(self, identity: bytes, req_id: str, code: str, message: str) -> None:
        self.reply(identity, ErrorReply(req_id=req_id, code=code, message=message))

    def drop_client(self, identity: bytes) -> None:
        """The client is gone: abort its requests (frees their KV) and forget them."""
        for key in [k for k in self.rids if k[0] == identity]:
            self.abort_rid(self.rids[key])
        for qid in [q for q, g in self.gathers.items() if g.identity == identity]:
            del self.gathers[qid]

    # -------------------------------------------------- client messages

    def on_client(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            return self.error(identity, "", ErrorCode.MALFORMED, "a message is exactly one frame")
        limit = self.server.max_message_bytes
        if len(frames[1]) > limit:
            try:
                req_id = msgspec.msgpack.decode(frames[1], type=_ReqIdOnly).req_id
            except (msgspec.DecodeError, msgspec.ValidationError):
                req_id = ""
            return self.error(
                identity,
                req_id,
                ErrorCode.TOO_LARGE,
                f"a {len(frames[1])}-byte message; the server accepts at most {limit} bytes",
            )
        try:
            msg = decode(frames[1])
        except Exception:  # any undecodable frame is the sender's problem, never the loop's
            try:
                return self.error(identity, *classify_bad_frame(frames[1]))
            except Exception as e:
                return self.error(
                    identity, "", ErrorCode.MALFORMED, f"undecodable message ({type(e).__name__})"
                )
        try:
            self.dispatch(identity, msg)
        except RequestError as e:
            self.error(identity, getattr(msg, "req_id", ""), e.code, str(e))
        except Exception as e:  # a bug must not take the front door down
            self.error(
                identity, getattr(msg, "req_id", ""), ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"
            )

    def dispatch(self, identity: bytes, msg) -> None:
        if self.api_keys and not self.authorized(getattr(msg, "api_key", None)):
            raise RequestError(ErrorCode.UNAUTHORIZED, "a valid API key is required (api_key=...)")
        if isinstance(msg, GenerateRequest):
            self.generate(identity, msg)
        elif isinstance(msg, AbortRequest):
            self.abort(identity, msg)
        elif isinstance(msg, ControlRequest):
            self.control(identity, msg)
        elif isinstance(msg, Hello):
            if msg.version != PROTOCOL_VERSION:
                raise RequestError(
                    ErrorCode.VERSION_MISMATCH,
                    f"client protocol {msg.version}, server protocol {PROTOCOL_VERSION}",
                )
            self.reply(
                identity, HelloReply(req_id=msg.req_id, version=PROTOCOL_VERSION, info=self.info())
            )
        else:
            raise RequestError(
                ErrorCode.UNKNOWN_MESSAGE, f"{type(msg).__name__} is not a client request"
            )

    def authorized(self, key: str | None) -> bool:
        given = (key or "").encode()
        return any(hmac.compare_digest(given, k) for k in self.api_keys)

    def generate(self, identity: bytes, msg: GenerateRequest) -> None:
        self.check_admission(identity, msg.req_id)
        try:
            sp = SamplingParams.from_dict(msg.sampling_params or {})
        except GrammarError as e:
            raise RequestError(ErrorCode.INVALID_GRAMMAR, str(e)) from None
        except (ValueError, TypeError) as e:
            raise RequestError(ErrorCode.INVALID_REQUEST, f"invalid sampling params: {e}") from None
        sp = self.limit_new_tokens(sp, "max_new_tokens" in (msg.sampling_params or {}))
        self.admit(
            identity,
            msg.req_id,
            self.tokenize(msg),
            sp,
            api_key=msg.api_key,
            logprob_start_len=msg.logprob_start_len,
            stream=msg.stream,
            routing_key=msg.routing_key,
        )

    def check_admission(self, identity: bytes, req_id: str, count: int = 1) -> None:
        """Raise unless ``count`` new requests from this client may start now."""
        if self.drain_requested:
            raise RequestError(
                ErrorCode.SHUTTING_DOWN, "the server is shutting down; no new requests"
            )
        if (identity, req_id) in self.rids:
            raise RequestError(ErrorCode.DUPLICATE_RID, f"request {req_id!r} is already in flight")
        per_client = self.server.max_requests_per_client
        if self.in_flight[identity] + count > per_client:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"this client has {self.in_flight[identity]} "
                f"requests in flight; the limit is {per_client}",
                status=429,
            )

    def limit_new_tokens(self, sp: SamplingParams, given: bool) -> SamplingParams:
        """Apply ``max_new_tokens_limit``: a default yields to it, an explicit value over it is
        refused."""
        limit = self.server.max_new_tokens_limit
        if not given:
            sp.max_new_tokens = min(sp.max_new_tokens, limit)
        if sp.max_new_tokens > limit:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"max_new_tokens {sp.max_new_tokens} is over the server's limit of {limit}",
            )
        return sp

    def admit(
        self,
        identity: bytes,
        req_id: str,
        ids: list[int],
        sp: SamplingParams,
        *,
        api_key: str | None,
        logprob_start_len: int | None = None,
        stream: bool = False,
        sink: asyncio.Queue | None = None,
        index: int = 0,
        routing_key: str | None = None,
    ) -> str:
        """Validate and send one request to the scheduler (after ``check_admission``); its rid."""
        if self.server.isolate_by_api_key:
            tenant = hashlib.sha256(f"{api_key}\0{sp.cache_salt or ''}".encode()).hexdigest()
            sp = dataclasses.replace(sp, cache_salt=f"tenant:{tenant[:32]}")
        ids = self.validate(ids)
        start = logprob_start_len
        if start is not None and not 1 <= start < len(ids):
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"logprob_start_len {start} is outside "
                f"[1, {len(ids)}) for a {len(ids)}-token prompt",
            )
        if not self.routing.up:
            raise RequestError(ErrorCode.UNAVAILABLE, "no replica is serving", status=503)
        replica = self.routing.choose(ids, sp.cache_salt, routing_key)
        rid = str(next(self.counter))
        self.rids[(identity, req_id)] = rid
        self.reqs[rid] = ClientReq(identity, req_id, stream, sink, index)
        self.in_flight[identity] += 1
        self.routing.routed(rid, replica, ids, sp.cache_salt)
        replica.send(
            encode(
                TokenizedRequest(
                    rid=rid,
                    input_ids=ids,
                    sampling_params=sp,
                    logprob_start_len=start,
                    stream=stream,
                )
            )
        )
        return rid

    def to_replica(self, rid: str, msg: msgspec.Struct) -> None:
        """Send ``msg`` to the replica running ``rid`` (nothing if it is gone)."""
        replica = self.routing.replica_of(rid)
        if replica is not None and replica.up:
            replica.send(encode(msg))

    def abort_rid(self, rid: str) -> None:
        """Abort a request this process still tracks (an HTTP client went away); its KV is freed."""
        replica = self.routing.replica_of(rid)
        if self.forget(rid) is not None and replica is not None and replica.up:
            replica.send(encode(AbortRid(rid=rid)))

    def control_async(self, kind: str, replica: int = 0) -> asyncio.Future:
        """Send a control request to the replicas; the future gets the combined ``data`` (or a
        RequestError)."""
        fut = asyncio.get_running_loop().create_future()

        def deliver(result: dict | ErrorReply) -> None:
            if not fut.done():
                fut.set_result(
                    RequestError(result.code, result.message)
                    if isinstance(result, ErrorReply)
                    else {**self.info(), **result}
                    if kind == "server_info"
                    else result
                )

        self.fan_out(kind, deliver, replica=replica)
        return fut

    def fan_out(self, kind: str, deliver, identity: bytes | None = None, replica: int = 0) -> None:
        """Send control request ``kind`` to every replica that is up (``kv_snapshot``: to
        ``replica``); ``deliver`` gets the answer (see ``radixrt.server.controls``)."""
        ups = {r.index for r in self.routing.up}
        targets = {replica} & ups if kind == "kv_snapshot" else ups
        if not targets:
            why = f"replica {replica} is not serving" if kind == "kv_snapshot" else "no replica"
            code = ErrorCode.UNAVAILABLE
            return deliver(ErrorReply(req_id="", code=code, message=f"{kind}: {why}"))
        qid = f"q{next(self.counter)}"
        self.gathers[qid] = Gather(kind, targets, deliver, identity)
        for i in targets:
            self.replicas[i].send(encode(ControlRequest(req_id=sub_id(qid, i), kind=kind)))

    def tokenize(self, msg: GenerateRequest) -> list[int]:
        given = [x is not None for x in (msg.prompt, msg.input_ids, msg.messages)]
        if sum(given) != 1:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, "pass exactly one of prompt, input_ids, messages"
            )
        if msg.input_ids is not None:
            return list(msg.input_ids)
        return self.tokenizer.encode(
            msg.prompt if msg.messages is None else self.chat_prompt(msg.messages)
        )

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> str:
        """The chat template applied to messages, ending with the assistant's turn."""
        template_kwargs.setdefault("add_generation_prompt", True)
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
        except Exception as e:  # a template error is the request's fault
            raise RequestError(ErrorCode.INVALID_REQUEST, f"chat template failed: {e}") from None

    def validate(self, ids: list[int]) -> list[int]:
        limits = self.limits
        if not ids:
            raise RequestError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        cap = self.server.max_prompt_tokens
        if cap is not None and len(ids) > cap:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens; the server accepts at most {cap}",
            )
        if len(ids) >= limits["max_context"]:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens; the context is {limits['max_context']} tokens",
            )
        if len(ids) >= limits["kv_slots"]:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens; the KV pool holds {limits['kv_slots']}",
            )
        vocab = limits["vocab_size"]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, f"token ids outside [0, {vocab}): {bad[:5]}"
            )
        return ids

    def abort(self, identity: bytes, msg: AbortRequest) -> None:
        rid = self.rids.get((identity, msg.target))
        if rid is None:
            raise RequestError(ErrorCode.UNKNOWN_RID, f"no request {msg.target!r} in flight")
        self.to_replica(rid, AbortRid(rid=rid))
        self.reply(identity, ControlReply(req_id=msg.req_id, data={"ok": True}))

    def control(self, identity: bytes, msg: ControlRequest) -> None:
        if msg.kind not in CONTROL_KINDS:
            raise RequestError(
                ErrorCode.UNKNOWN_MESSAGE, f"control kind must be one of {CONTROL_KINDS}"
            )
        if msg.kind == "kv_snapshot" and not 0 <= msg.replica < len(self.replicas):
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"replica {msg.replica} does not exist (dp_size {len(self.replicas)})",
            )
        req_id, kind = msg.req_id, msg.kind

        def deliver(result: dict | ErrorReply) -> None:
            if isinstance(result, ErrorReply):
                return self.error(identity, req_id, result.code, result.message)
            data = {**self.info(), **result} if kind == "server_info" else result
            self.reply(identity, ControlReply(req_id=req_id, data=data))

        self.fan_out(kind, deliver, identity, msg.replica)

    def info(self) -> dict:
        pids = {
            "launcher": os.getppid(),
            "tokenizer_manager": os.getpid(),
            **self.args.pids,
            **{replica_name(r.index): r.info["scheduler_pid"] for r in self.replicas if r.up},
        }
        names = (
            "max_prompt_tokens",
            "max_new_tokens_limit",
            "max_requests_per_client",
            "max_message_bytes",
        )
        limits = {k: getattr(self.server, k) for k in names}
        return {
            **self.limits,
            **limits,
            "version": PROTOCOL_VERSION,
            "pids": pids,
            "in_flight": len(self.reqs),
            "draining": self.drain_requested,
            "dp_size": len(self.replicas),
            "replicas_up": [r.index for r in self.replicas if r.up],
            "load_balance_method": self.server.load_balance_method,
        }

    # ------------------------------------------------- backend messages

    def on_backend(self, data: bytes) -> None:
        msg = decode(data)
        if isinstance(msg, BatchTextOut):
            self.on_text_batch(msg)
        elif isinstance(msg, RidError):
            self.to_replica(msg.rid, AbortRid(rid=msg.rid))  # frees its KV if it still runs
            self.fail(msg.rid, msg.code, msg.message)
        elif isinstance(msg, (ControlReply, ErrorReply)):
            self.on_control_reply(msg)
        elif isinstance(msg, ReplicaDown):
            self.on_replica_down(msg)
        elif isinstance(msg, SchedulerReady):
            self.on_replica_up(msg)

    def fail(self, rid: str, code: str, message: str) -> None:
        """Answer request ``rid`` with an error and forget it."""
        st = self.forget(rid)
        if st is not None and st.sink is not None:
            st.sink.put_nowait((st.index, RequestError(code, message)))
        elif st is not None:
            self.error(st.identity, st.req_id, code, message)

    def on_replica_down(self, msg: ReplicaDown) -> None:
        """Fail the replica's requests, answer controls without it, route around it."""
        why = f"replica {msg.replica} exited (code {msg.exitcode})"
        for rid in self.routing.down(msg.replica):
            self.fail(rid, ErrorCode.REPLICA_FAILED, f"{why} while running this request")
        for qid, gather in list(self.gathers.items()):
            if gather.drop(msg.replica):
                del self.gathers[qid]

    def on_kv_events(self, data: bytes) -> None:
        """A replica's event batch: into its mirror (a gap asks for a snapshot); forwarded to
        the outside subscribers."""
        if self.events_out is not None:
            self.events_out.send(data)
        batch = decode(data)
        if not isinstance(batch, KVEventBatch) or not 0 <= batch.replica < len(self.replicas):
            return
        replica = self.replicas[batch.replica]
        if replica.up and replica.mirror.on_batch(batch):
            self.fan_out("kv_snapshot", lambda r: self.on_snapshot(replica, r), None, replica.index)

    def on_snapshot(self, replica: Replica, result: dict | ErrorReply) -> None:
        if isinstance(result, dict) and replica.up:
            replica.mirror.on_snapshot(msgspec.convert(result["snapshot"], KVSnapshot))

    def forget(self, rid: str) -> ClientReq | None:
        st = self.reqs.pop(rid, None)
        self.routing.finished(rid)
        if st is not None:
            self.rids.pop((st.identity, st.req_id), None)
            self.in_flight[st.identity] -= 1
            if not self.in_flight[st.identity]:
                del self.in_flight[st.identity]
        return st

    def on_text_batch(self, batch: BatchTextOut) -> None:
        """Reply to each client once per step: one message, or a ReplyBatch of several; an HTTP
        request's deltas go to its sink."""
        replies: dict[bytes, list] = {}
        now = time.monotonic()
        for item in batch.items:
            st = self.reqs.get(item.rid)
            if st is None:  # client gone
                continue
            self.routing.started(item.rid)
            self.observe(st, item, now)
            if st.sink is not None:
                if item.finish_reason is not None:
                    self.forget(item.rid)
                st.sink.put_nowait((st.index, item))
                continue
            reply = self.on_delta(st, item)
            if reply is not None:
                replies.setdefault(st.identity, []).append(reply)
        for identity, items in replies.items():
            self.reply(identity, items[0] if len(items) == 1 else ReplyBatch(items=items))

    def observe(self, st: ClientReq, item: TextDelta, now: float) -> None:
        """Metrics of one delta: first token, token gaps, the request's end. A streamed request's
        gaps are measured here as its deltas arrive; an unstreamed one's single delta carries the
        scheduler's time of its first token (the same monotonic clock), and its mean gap after
        it."""
        n = len(item.token_ids)
        if n and st.last_token_at is None:
            first = item.first_token_at if not st.stream and item.first_token_at else now
            self.metrics.on_first_token(first - st.arrived)
            if n > 1:
                self.metrics.on_tokens(now - first, n - 1)
        elif n:
            self.metrics.on_tokens(now - st.last_token_at, n)
        if n:
            st.last_token_at = now
        st.generated += n
        if item.finish_reason is not None:
            self.metrics.on_finish(
                item.finish_reason,
                item.prompt_tokens,
                item.cached_tokens,
                st.generated,
                now - st.arrived,
            )

    def on_delta(self, st: ClientReq, item: TextDelta) -> StreamChunk | GenerateReply | None:
        done = item.finish_reason is not None
        if done:
            self.forget(item.rid)
        if st.stream:
            return StreamChunk(
                req_id=st.req_id,
                text=item.text,
                token_ids=item.token_ids,
                logprobs=item.logprobs,
                finish_reason=item.finish_reason,
                prompt_tokens=item.prompt_tokens,
                cached_tokens=item.cached_tokens,
                cached_tokens_details=cached_tokens_details(item.cached_tokens, item.cached_below),
                top_logprobs=item.top_logprobs,
            )
        st.texts.append(item.text)
        st.token_ids.extend(item.token_ids)
        if item.logprobs is not None:
            st.logprobs = (st.logprobs or []) + item.logprobs
        if not done:
            return None
        out = GenerateOutput(
            rid=st.req_id,
            text="".join(st.texts),
            token_ids=st.token_ids,
            prompt_tokens=item.prompt_tokens,
            cached_tokens=item.cached_tokens,
            cached_tokens_details=cached_tokens_details(item.cached_tokens, item.cached_below),
            finish_reason=item.finish_reason,
            logprobs=st.logprobs,
            prompt_logprobs=item.prompt_logprobs,
            top_logprobs=item.top_logprobs,
            prompt_top_logprobs=item.prompt_top_logprobs,
        )
        return GenerateReply(req_id=st.req_id, output=out)

    def on_control_reply(self, msg: ControlReply | ErrorReply) -> None:
        qid, replica = split_id(msg.req_id)
        gather = self.gathers.get(qid)
        if gather is not None and replica is not None and gather.reply(replica, msg):
            del self.gathers[qid]


def kv_event_sockets(
    ctx: zmq.Context, args: FrontArgs, server: ServerConfig
) -> tuple[zmq.Socket | None, zmq.Socket | None]:
    """(a SUB connected to every replica's KV events, a PUB re-publishing them on
    ``kv_events_endpoint``); None where not wanted."""
    sub = pub = None
    if args.addrs.kv_events:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for addr in args.addrs.kv_events:
            sub.connect(addr)
    if server.kv_events_endpoint is not None:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(server.kv_events_endpoint)
    return sub, pub


def run_tokenizer_manager(args: FrontArgs) -> None:
    def main(ctx: zmq.Context, ready: zmq.Socket) -> None:
        tm = TokenizerManager(args, ctx)
        tm.ready_sock = ready
        signal.signal(signal.SIGUSR1, tm.on_drain_signal)  # until the event loop takes it over
        tm.wait_for_scheduler()
        report_ready(ready, "tokenizer_manager", tm.info())
        tm.run()

    run_child("tokenizer_manager", args, main)
