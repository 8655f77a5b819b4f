"""Clients of a ``radixrt launch`` server: ``Client`` (sync) and ``AsyncClient``.

Both speak ``radixrt.protocol`` over a ZeroMQ DEALER and handshake on connect
(``Hello`` with ``PROTOCOL_VERSION``). Every request carries a client-chosen
``req_id``; replies are dispatched by it, so one client can have many requests
in flight (the sync client runs a receiver thread that owns the socket).

``encode`` returns embeddings as ``radixrt.Engine.encode`` does.
``generate`` returns a ``GenerateOutput``, or with ``stream=True`` an iterator
of ``StreamChunk`` (``text`` and ``token_ids`` deltas; the last chunk has
``finish_reason``, ``prompt_tokens``, ``cached_tokens`` and ``cached_tokens_details``).
The rid to pass to ``abort`` is ``output.rid`` / ``stream.rid`` (or choose it with ``rid=``).
Server errors raise ``ServerError`` (``.code`` is an ``ErrorCode``); a timeout
raises ``TimeoutError`` and aborts the request on the server.

Security: ``api_key=`` (default ``$RADIXRT_API_KEY``) is sent with every
message; ``curve_server_key=`` (the server's public key: Z85 text, or the path
of its ``server.key`` from ``radixrt curve-keygen``) encrypts the connection
with CurveZMQ under a fresh client key pair.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixrt.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ControlRequest,
    ErrorReply,
    GenerateOutput,
    GenerateRequest,
    Hello,
    KVSnapshot,
    ReplyBatch,
    StreamChunk,
    decode,
    encode,
)
from radixrt.sampling import SamplingParams


class ServerError(RuntimeError):
    """An ``ErrorReply`` from the server."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


def _params_dict(sp: SamplingParams | dict | None) -> dict | None:
    if sp is None or isinstance(sp, dict):
        return sp
    return sp.to_dict()


def _generate_request(
    req_id: str,
    prompt,
    sampling_params,
    input_ids,
    messages,
    stream: bool,
    routing_key: str | None = None,
) -> GenerateRequest:
    return GenerateRequest(
        req_id=req_id,
        prompt=prompt,
        input_ids=list(map(int, input_ids)) if input_ids is not None else None,
        messages=list(messages) if messages is not None else None,
        sampling_params=_params_dict(sampling_params),
        stream=stream,
        routing_key=routing_key,
    )


def _embedding(out: GenerateOutput) -> dict:
    """An embedding request's output as ``Engine.encode`` gives it."""
    meta = {"id": out.rid, "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens}
    return {"embedding": out.embedding, "meta_info": meta}


def _batch_items(prompts, input_ids, messages) -> list[dict]:
    given = [
        (k, v)
        for k, v in (("prompt", prompts), ("input_ids", input_ids), ("messages", messages))
        if v is not None
    ]
    if len(given) != 1:
        raise ValueError("pass exactly one of prompts, input_ids, messages")
    key, values = given[0]
    return [{key: v} for v in values]


def _unbatch(msg) -> list:
    """The replies in one frame; messages without a req_id (Ping) are dropped."""
    if isinstance(msg, ReplyBatch):
        return msg.items
    return [msg] if getattr(msg, "req_id", "") else []


def _check(msg) -> Any:
    if isinstance(msg, ErrorReply):
        raise ServerError(msg.code, msg.message)
    return msg


def _connect(ctx: zmq.Context, address: str, curve_server_key: str | bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:
        sock.curve_serverkey = _load_public_key(curve_server_key)
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(address)
    return sock


def _load_public_key(key: str | bytes) -> bytes:
    """A Z85 public key as given, or read from a key file."""
    if isinstance(key, str) and os.path.isfile(key):
        import zmq.auth

        return zmq.auth.load_certificate(key)[0]
    key = key.encode() if isinstance(key, str) else key
    if len(key) != 40:
        raise ValueError(
            "curve_server_key must be a 40-character Z85 public key or a key file path"
        )
    return key


class _Ids:
    def __init__(self) -> None:
        self.prefix = uuid.uuid4().hex[:12]
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}-{next(self.counter)}"


class Client:
    """Synchronous client; thread-safe. ``Client("tcp://127.0.0.1:30000", timeout=60)``."""

    def __init__(
        self,
        address: str,
        timeout: float | None = 60.0,
        *,
        api_key: str | None = None,
        curve_server_key: str | bytes | None = None,
    ) -> None:
        self.address, self.timeout = address, timeout
        self.api_key = api_key if api_key is not None else os.environ.get("RADIXRT_API_KEY") or None
        self._ids = _Ids()
        self._ctx = zmq.Context()
        self._sock = _connect(self._ctx, address, curve_server_key)
        wake = f"inproc://radixrt-client-{id(self)}-{os.getpid()}"
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(wake)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(wake)
        self._out_lock = threading.Lock()
        self._pending: dict[str, queue.Queue] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._io_loop, name="radixrt-client", daemon=True)
        self._thread.start()
        try:
            self.info = self._call(Hello(version=PROTOCOL_VERSION, req_id=self._ids())).info
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------- API

    def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: list[dict] | None = None,
        stream: bool = False,
        rid: str | None = None,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> GenerateOutput | Stream:
        """``routing_key``: requests sharing one go to the same data-parallel replica."""
        req = _generate_request(
            rid or self._ids(), prompt, sampling_params, input_ids, messages, stream, routing_key
        )
        q = self._send(req)
        if stream:
            return Stream(self, req.req_id, q, self._timeout(timeout))
        return self._result(req.req_id, q, self._deadline(timeout))

    def generate_batch(
        self,
        prompts: Sequence[str] | None = None,
        sampling_params: SamplingParams | dict | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        messages: Sequence[list[dict]] | None = None,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> list[GenerateOutput]:
        """All requests go out at once; outputs come back in order."""
        sent = []
        for item in _batch_items(prompts, input_ids, messages):
            req = _generate_request(
                self._ids(),
                item.get("prompt"),
                sampling_params,
                item.get("input_ids"),
                item.get("messages"),
                False,
                routing_key,
            )
            sent.append((req.req_id, self._send(req)))
        deadline = self._deadline(timeout)
        return [self._result(req_id, q, deadline) for req_id, q in sent]

    def score(
        self,
        prefix_ids: Sequence[int],
        continuations: Sequence[Sequence[int]],
        timeout: float | None = None,
        *,
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> list[tuple[float, int]]:
        """(summed log-likelihood, token count) of each continuation after ``prefix_ids``.

        The prefix is prefilled (and cached, under ``cache_salt``) first; the
        continuations then go out together as prefill-only requests scoring from
        ``len(prefix_ids)``, all to the prefix's replica (under ``routing_key``, or a
        fresh one).
        """
        prefix = list(map(int, prefix_ids))
        conts = [list(map(int, c)) for c in continuations]
        sp = {"max_new_tokens": 0, "cache_salt": cache_salt}
        key = routing_key or f"score-{uuid.uuid4().hex}"
        self.generate(input_ids=prefix, sampling_params=sp, timeout=timeout, routing_key=key)
        sent = []
        for c in conts:
            req = _generate_request(self._ids(), None, sp, prefix + c, None, False, key)
            req.logprob_start_len = len(prefix)
            sent.append((req.req_id, self._send(req)))
        deadline = self._deadline(timeout)
        outs = [self._result(req_id, q, deadline) for req_id, q in sent]
        return [(sum(o.prompt_logprobs or ()), len(c)) for o, c in zip(outs, conts)]

    def encode(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> dict | list[dict]:
        """Each prompt's embedding, as ``radixrt.Engine.encode`` gives it (``{"embedding",
        "meta_info"}``; one dict for a str prompt, else a list), pooled by the server's
        ``embedding_pooling``. All prompts go out at once."""
        prompts = [prompt] if isinstance(prompt, str) else prompt
        sp = {"max_new_tokens": 0, "cache_salt": cache_salt}
        sent = []
        for item in _batch_items(prompts, input_ids, None):
            req = _generate_request(
                self._ids(), item.get("prompt"), sp, item.get("input_ids"), None, False
            )
            req.embed = True
            sent.append((req.req_id, self._send(req)))
        deadline = self._deadline(timeout)
        outs = [_embedding(self._result(req_id, q, deadline)) for req_id, q in sent]
        return outs[0] if isinstance(prompt, str) else outs

    def abort(self, rid: str) -> None:
        self._call(AbortRequest(req_id=self._ids(), target=rid))

    def server_info(self) -> dict[str, Any]:
        return self._control("server_info")

    def flush_cache(self) -> None:
        self._control("flush_cache")

    def health(self) -> bool:
        return bool(self._control("health").get("ok"))

    def kv_snapshot(self, replica: int = 0) -> KVSnapshot:
        """Replica ``replica``'s whole radix tree, consistent with its KV event ``seq``."""
        msg = ControlRequest(req_id=self._ids(), kind="kv_snapshot", replica=replica)
        return msgspec.convert(self._call(msg).data["snapshot"], KVSnapshot)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._out_lock:
            self._outbox.send(b"")
        self._thread.join(5.0)
        self._outbox.close(0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------- plumbing

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _deadline(self, timeout: float | None) -> float | None:
        t = self._timeout(timeout)
        return None if t is None else time.monotonic() + t

    def _send(self, msg, expect_reply: bool = True) -> queue.Queue | None:
        if self._closed:
            raise RuntimeError("the client is closed")
        q = None
        if expect_reply:
            q = self._pending[msg.req_id] = queue.Queue()
        if self.api_key is not None:
            msg.api_key = self.api_key
        with self._out_lock:
            self._outbox.send(encode(msg))
        return q

    def _wait(self, req_id: str, q: queue.Queue, deadline: float | None):
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return q.get(timeout=left)
        except queue.Empty:
            self._pending.pop(req_id, None)
            raise TimeoutError(f"no reply to {req_id!r} in time") from None

    def _result(self, req_id: str, q: queue.Queue, deadline: float | None) -> GenerateOutput:
        try:
            msg = _check(self._wait(req_id, q, deadline))
        except TimeoutError:
            self._abort_quietly(req_id)
            raise
        finally:
            self._pending.pop(req_id, None)
        return msg.output

    def _abort_quietly(self, rid: str) -> None:
        if not self._closed:
            self._send(AbortRequest(req_id=self._ids(), target=rid), expect_reply=False)

    def _call(self, msg):
        q = self._send(msg)
        try:
            return _check(self._wait(msg.req_id, q, self._deadline(None)))
        finally:
            self._pending.pop(msg.req_id, None)

    def _control(self, kind: str) -> dict:
        return self._call(ControlRequest(req_id=self._ids(), kind=kind)).data

    def _io_loop(self) -> None:
        """Move frames between the callers (through the inbox) and the server socket.

        Sends never block: a DEALER with no server connected yet (or a CURVE
        handshake that never completes) would block ``send`` for good, so
        frames wait in a backlog until the socket reports room (POLLOUT).
        """
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        backlog: collections.deque[bytes] = collections.deque()
        polling_out = False
        try:
            while True:
                events = dict(poller.poll())
                if self._inbox in events:
                    data = self._inbox.recv()
                    if not data:
                        return
                    backlog.append(data)
                if events.get(self._sock, 0) & zmq.POLLIN:
                    for msg in _unbatch(decode(self._sock.recv())):
                        q = self._pending.get(msg.req_id)
                        if q is not None:
                            q.put(msg)
                while backlog:
                    try:
                        self._sock.send(backlog[0], zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    backlog.popleft()
                if polling_out != bool(backlog):
                    polling_out = bool(backlog)
                    poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if polling_out else 0))
        finally:
            self._sock.close(0)
            self._inbox.close(0)


class Stream:
    """Iterator of ``StreamChunk``s of request ``rid``; leaving it early aborts the request."""

    def __init__(self, client: Client, rid: str, q: queue.Queue, timeout: float | None) -> None:
        self.client, self.rid, self._q, self._timeout = client, rid, q, timeout
        self.finished = False

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while not self.finished:
                deadline = None if self._timeout is None else time.monotonic() + self._timeout
                chunk = _check(self.client._wait(self.rid, self._q, deadline))
                self.finished = chunk.finish_reason is not None
                yield chunk
        except ServerError:
            self.finished = True
            raise
        finally:
            self.client._pending.pop(self.rid, None)
            if not self.finished:
                self.client._abort_quietly(self.rid)


class AsyncClient:
    """asyncio client (zmq.asyncio). Use ``async with AsyncClient(addr) as c`` or
    ``await c.connect()``."""

    def __init__(
        self,
        address: str,
        timeout: float | None = 60.0,
        *,
        api_key: str | None = None,
        curve_server_key: str | bytes | None = None,
    ) -> None:
        self.address, self.timeout = address, timeout
        self.api_key = api_key if api_key is not None else os.environ.get("RADIXRT_API_KEY") or None
        self._ids = _Ids()
        self._ctx = zmq.asyncio.Context()
        self._sock = _connect(self._ctx, address, curve_server_key)
        self._pending: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.info: dict[str, Any] = {}

    async def connect(self) -> AsyncClient:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
            self.info = (await self._call(Hello(version=PROTOCOL_VERSION, req_id=self._ids()))).info
        return self

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: list[dict] | None = None,
        stream: bool = False,
        rid: str | None = None,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> GenerateOutput | AsyncStream:
        """A GenerateOutput; with ``stream=True`` an ``AsyncStream`` to ``async for`` over."""
        await self.connect()
        req = _generate_request(
            rid or self._ids(), prompt, sampling_params, input_ids, messages, stream, routing_key
        )
        q = await self._send(req)
        timeout = self.timeout if timeout is None else timeout
        if stream:
            return AsyncStream(self, req.req_id, q, timeout)
        try:
            return _check(await asyncio.wait_for(q.get(), timeout)).output
        except TimeoutError:
            await self._abort_quietly(req.req_id)
            raise TimeoutError(f"no reply to {req.req_id!r} in time") from None
        finally:
            self._pending.pop(req.req_id, None)

    async def generate_batch(
        self,
        prompts: Sequence[str] | None = None,
        sampling_params: SamplingParams | dict | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        messages: Sequence[list[dict]] | None = None,
        routing_key: str | None = None,
    ) -> list[GenerateOutput]:
        items = _batch_items(prompts, input_ids, messages)
        return list(
            await asyncio.gather(
                *(
                    self.generate(sampling_params=sampling_params, routing_key=routing_key, **item)
                    for item in items
                )
            )
        )

    async def abort(self, rid: str) -> None:
        await self._call(AbortRequest(req_id=self._ids(), target=rid))

    async def server_info(self) -> dict[str, Any]:
        return (await self._call(ControlRequest(req_id=self._ids(), kind="server_info"))).data

    async def flush_cache(self) -> None:
        await self._call(ControlRequest(req_id=self._ids(), kind="flush_cache"))

    async def health(self) -> bool:
        return bool(
            (await self._call(ControlRequest(req_id=self._ids(), kind="health"))).data.get("ok")
        )

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _send(self, msg, expect_reply: bool = True) -> asyncio.Queue | None:
        q = None
        if expect_reply:
            q = self._pending[msg.req_id] = asyncio.Queue()
        if self.api_key is not None:
            msg.api_key = self.api_key
        await self._sock.send(encode(msg))
        return q

    async def _abort_quietly(self, rid: str) -> None:
        await self._send(AbortRequest(req_id=self._ids(), target=rid), expect_reply=False)

    async def _call(self, msg):
        q = await self._send(msg)
        try:
            return _check(await asyncio.wait_for(q.get(), self.timeout))
        except TimeoutError:
            raise TimeoutError(f"no reply to {msg.req_id!r} in time") from None
        finally:
            self._pending.pop(msg.req_id, None)

    async def _read_loop(self) -> None:
        while True:
            for msg in _unbatch(decode(await self._sock.recv())):
                q = self._pending.get(msg.req_id)
                if q is not None:
                    q.put_nowait(msg)


class AsyncStream:
    """Async iterator of ``StreamChunk``s of request ``rid``."""

    def __init__(
        self, client: AsyncClient, rid: str, q: asyncio.Queue, timeout: float | None
    ) -> None:
        self.client, self.rid, self._q, self._timeout = client, rid, q, timeout
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        try:
            while not self.finished:
                try:
                    chunk = _check(await asyncio.wait_for(self._q.get(), self._timeout))
                except TimeoutError:
                    raise TimeoutError(f"no chunk of {self.rid!r} in time") from None
                except Exception:
                    self.finished = True
                    raise
                self.finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self.client._pending.pop(self.rid, None)
            if not self.finished:
                await self.client._abort_quietly(self.rid)
