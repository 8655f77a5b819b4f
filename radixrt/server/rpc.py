"""The front's ZeroMQ side: a ROUTER on tcp://HOST:PORT for ``radixrt.Client``.

A client's message is one frame of ``radixrt.protocol`` msgpack; each gets an
answer (a reply, a stream of chunks, or an ``ErrorReply``), and nothing a
client sends can stop the loop.

- Limits: frames over ``max_message_bytes`` get ``too_large`` (ZeroMQ drops a
  connection that sends a frame over ``HARD_SIZE_FACTOR`` times that, unread,
  so memory stays bounded); the rest is ``radixrt.server.admission``'s.
- Keys: with ``api_key`` every message must carry one (``unauthorized``);
  with ``curve_keys`` the socket is a CurveZMQ server (``server.key_secret``
  in that folder).
- Vanished clients: the ROUTER is ``ROUTER_MANDATORY``, so a reply to a client
  that went away fails with EHOSTUNREACH and that client's requests are
  aborted (their KV is freed). Clients with work in flight are sent a ``Ping``
  when the socket monitor reports a disconnect and every ``PROBE_S`` seconds
  (the disconnect event may arrive before the peer's pipe is gone).
"""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from radixrt.config import ServerConfig
from radixrt.grammar import GrammarError
from radixrt.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ControlReply,
    ControlRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    Hello,
    HelloReply,
    Ping,
    classify_bad_frame,
    decode,
    encode,
)
from radixrt.sampling import SamplingParams
from radixrt.server.common import handle_pending
from radixrt.server.controls import Controls
from radixrt.server.front import Front
from radixrt.server.front_api import RequestError
from radixrt.server.request_table import RequestTable

PROBE_S = 2.0
HARD_SIZE_FACTOR = 4  # ZMQ_MAXMSGSIZE = this × max_message_bytes


class _ReqIdOnly(msgspec.Struct):
    """Reads just the req_id of a frame too large to decode in full."""

    req_id: str = ""


class RpcServer:
    def __init__(
        self,
        ctx: zmq.Context,
        server: ServerConfig,
        front: Front,
        requests: RequestTable,
        controls: Controls,
    ) -> None:
        self.server, self.front = server, front
        self.requests, self.controls = requests, controls
        self.sock = router_socket(ctx, server)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.next_probe = 0.0

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        """The sockets ``poll`` reads: the ROUTER and its monitor."""
        return self.sock, self.monitor

    def poll(self) -> None:
        """Handle the clients' messages; probe clients on a disconnect, and when due."""
        handle_pending(self.sock, self.on_frames)
        if handle_pending(self.monitor, lambda frames: None):
            self.ping_clients()
        if time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + PROBE_S
            self.ping_clients()

    def reply(self, identity: bytes, msg: msgspec.Struct) -> None:
        """Send ``msg`` to a client; one that went away is dropped."""
        try:
            self.sock.send_multipart([identity, encode(msg)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.drop_client(identity)

    def error(self, identity: bytes, req_id: str, code: str, message: str) -> None:
        self.reply(identity, ErrorReply(req_id=req_id, code=code, message=message))

    def ping_clients(self) -> None:
        """Probe every client with work in flight; the ones that left get dropped."""
        for identity in self.requests.rpc_clients() | self.controls.clients():
            self.reply(identity, Ping())

    def drop_client(self, identity: bytes) -> None:
        """The client is gone: abort its requests (frees their KV) and forget them."""
        for rid in self.requests.rids_of(identity):
            self.front.abort(rid)
        self.controls.drop_client(identity)

    def on_frames(self, frames: list[bytes]) -> None:
        """One message from a client: checked, decoded, dispatched; every failure answered."""
        identity = frames[0]
        if len(frames) != 2:
            return self.error(identity, "", ErrorCode.MALFORMED, "a message is exactly one frame")
        limit = self.server.max_message_bytes
        if len(frames[1]) > limit:
            try:
                req_id = msgspec.msgpack.decode(frames[1], type=_ReqIdOnly).req_id
            except (msgspec.DecodeError, msgspec.ValidationError):
                req_id = ""
            message = f"a {len(frames[1])}-byte message; the server accepts at most {limit} bytes"
            return self.error(identity, req_id, ErrorCode.TOO_LARGE, message)
        try:
            msg = decode(frames[1])
        except Exception:  # any undecodable frame is the sender's problem, never the loop's
            try:
                return self.error(identity, *classify_bad_frame(frames[1]))
            except Exception as e:
                message = f"undecodable message ({type(e).__name__})"
                return self.error(identity, "", ErrorCode.MALFORMED, message)
        try:
            self.dispatch(identity, msg)
        except RequestError as e:
            self.error(identity, getattr(msg, "req_id", ""), e.code, str(e))
        except Exception as e:  # a bug must not take the front door down
            message = f"{type(e).__name__}: {e}"
            self.error(identity, getattr(msg, "req_id", ""), ErrorCode.INTERNAL, message)

    def dispatch(self, identity: bytes, msg: msgspec.Struct) -> None:
        if not self.front.authorized(getattr(msg, "api_key", None)):
            raise RequestError(ErrorCode.UNAUTHORIZED, "a valid API key is required (api_key=...)")
        if isinstance(msg, GenerateRequest):
            self.generate(identity, msg)
        elif isinstance(msg, AbortRequest):
            self.abort(identity, msg)
        elif isinstance(msg, ControlRequest):
            self.control(identity, msg)
        elif isinstance(msg, Hello):
            self.hello(identity, msg)
        else:
            raise RequestError(
                ErrorCode.UNKNOWN_MESSAGE, f"{type(msg).__name__} is not a client request"
            )

    def generate(self, identity: bytes, msg: GenerateRequest) -> None:
        self.front.check_admission(identity, msg.req_id)
        self.front.submit(
            identity,
            msg.req_id,
            self.prompt_ids(msg),
            self.sampling(msg),
            api_key=msg.api_key,
            logprob_start_len=msg.logprob_start_len,
            stream=msg.stream,
            routing_key=msg.routing_key,
            embed=msg.embed,
        )

    def sampling(self, msg: GenerateRequest) -> SamplingParams:
        """The request's sampling parameters, within the server's limit on new tokens."""
        raw = msg.sampling_params or {}
        try:
            sp = SamplingParams.from_dict(raw)
        except GrammarError as e:
            raise RequestError(ErrorCode.INVALID_GRAMMAR, str(e)) from None
        except (ValueError, TypeError) as e:
            raise RequestError(ErrorCode.INVALID_REQUEST, f"invalid sampling params: {e}") from None
        return self.front.limit_new_tokens(sp, "max_new_tokens" in raw)

    def prompt_ids(self, msg: GenerateRequest) -> list[int]:
        """The token ids of exactly one of ``prompt``, ``input_ids`` and ``messages``."""
        given = [x is not None for x in (msg.prompt, msg.input_ids, msg.messages)]
        if sum(given) != 1:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, "pass exactly one of prompt, input_ids, messages"
            )
        if msg.input_ids is not None:
            return list(msg.input_ids)
        if msg.messages is not None:
            return self.front.encode(self.front.chat_prompt(msg.messages))
        return self.front.encode(msg.prompt)

    def abort(self, identity: bytes, msg: AbortRequest) -> None:
        rid = self.requests.rid_of(identity, msg.target)
        if rid is None:
            raise RequestError(ErrorCode.UNKNOWN_RID, f"no request {msg.target!r} in flight")
        self.front.cancel(rid)
        self.reply(identity, ControlReply(req_id=msg.req_id, data={"ok": True}))

    def control(self, identity: bytes, msg: ControlRequest) -> None:
        fut = self.front.control(msg.kind, msg.replica, identity)
        fut.add_done_callback(lambda f: self.answer(identity, msg.req_id, f.result()))

    def answer(self, identity: bytes, req_id: str, result: dict | RequestError) -> None:
        """A control request's answer, to the client that asked."""
        if isinstance(result, RequestError):
            return self.error(identity, req_id, result.code, str(result))
        self.reply(identity, ControlReply(req_id=req_id, data=result))

    def hello(self, identity: bytes, msg: Hello) -> None:
        if msg.version != PROTOCOL_VERSION:
            raise RequestError(
                ErrorCode.VERSION_MISMATCH,
                f"client protocol {msg.version}, server protocol {PROTOCOL_VERSION}",
            )
        info = self.front.info()
        self.reply(identity, HelloReply(req_id=msg.req_id, version=PROTOCOL_VERSION, info=info))


def router_socket(ctx: zmq.Context, server: ServerConfig) -> zmq.Socket:
    """The clients' ROUTER, bound: replies to a vanished client fail (``ROUTER_MANDATORY``),
    no queue limits, frames over ``HARD_SIZE_FACTOR × max_message_bytes`` drop the
    connection, CurveZMQ with ``curve_keys``."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_SIZE_FACTOR * server.max_message_bytes)
    if server.curve_keys is not None:
        public, secret = curve_server_keys(server.curve_keys)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    sock.bind(f"tcp://{server.host}:{server.port}")
    return sock


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
