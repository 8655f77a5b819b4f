"""The engine requests behind one HTTP request (``Job``) and how an answer goes out.

A ``Job`` admits all of its requests through the ``FrontApi`` or none,
then yields their text deltas in arrival order from one queue; a watcher
task queues ``_GONE`` when the client disconnects, and ``close()`` aborts
whatever has not finished. ``SSEResponse`` streams Server-Sent Events and
runs its ``on_close`` however the stream ends.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixrt.output import spec_counters
from radixrt.protocol import ErrorCode, TextDelta
from radixrt.sampling import SamplingParams
from radixrt.server.front_api import FrontApi, RequestError
from radixrt.server.http import schemas as api

MAX_CHOICES = 128  # n, or prompts × n, in one request
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DONE = b"data: [DONE]\n\n"
_GONE = object()  # queued by a Job's watcher when its client disconnects


class ClientGone(Exception):
    """The HTTP client disconnected."""


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(api.encode(obj), status_code=status, media_type="application/json")


def error_response(err: api.ApiError) -> Response:
    return Response(api.error_body(err), status_code=err.status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + api.encode(obj) + b"\n\n"


class Prompt(msgspec.Struct):
    """One engine request of an HTTP request: its ids, sampling and prompt scoring."""

    ids: list[int]
    params: SamplingParams
    logprob_start_len: int | None = None
    text: str | None = None  # the prompt's text, for echo
    embed: bool = False  # an embedding request (``FrontApi.submit``'s ``embed``)


class Choice:
    """What one engine request has produced so far."""

    __slots__ = (
        "texts",
        "token_ids",
        "logprobs",
        "top_logprobs",
        "finish_reason",
        "prompt_tokens",
        "cached_tokens",
        "cached_below",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "spec",
        "embedding",
    )

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.finish_reason: str | None = None
        self.prompt_tokens = self.cached_tokens = 0
        self.cached_below = (0, 0)  # of cached_tokens, loaded from the (host, storage) tier
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list | None = None
        self.spec: dict[str, int] = {}  # the speculative counters (``spec_counters``)
        self.embedding: list[float] | None = None  # an embedding request's, when it finished

    def add(self, d: TextDelta) -> None:
        self.texts.append(d.text)
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs or ())
        self.top_logprobs.extend(d.top_logprobs or ())
        self.finish_reason = d.finish_reason
        self.prompt_tokens, self.cached_tokens = d.prompt_tokens, d.cached_tokens
        self.cached_below = d.cached_below
        self.spec = spec_counters(d)
        if d.embedding is not None:
            self.embedding = d.embedding
        if d.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = (
                d.prompt_logprobs,
                d.prompt_top_logprobs,
            )

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Job:
    """The engine requests behind one HTTP request, and their deltas in arrival order.

    ``start`` admits them all or none; ``next()`` returns ``(index, TextDelta)``
    and raises ``ApiError`` for a request the server failed, ``ClientGone``
    when the client disconnected; ``close()`` aborts whatever has not
    finished (always call it).
    """

    _ids = itertools.count()

    def __init__(
        self, front: FrontApi, request: Request, api_key: str | None, stream: bool
    ) -> None:
        self.front, self.request = front, request
        self.api_key, self.stream = api_key, stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.choices: list[Choice] = []
        self.unfinished: set[int] = set()
        self.watcher: asyncio.Task | None = None
        self.open = False  # admitted and not closed
        client = (
            api_key if api_key is not None else (request.client.host if request.client else "?")
        )
        # ZeroMQ reserves identities that start with a zero byte for the five-byte ones it
        # generates, so no well-behaved ZeroMQ client shares this one.
        self.identity = b"\0http:" + client.encode()
        self.key = f"h{next(self._ids)}"

    def start(self, prompts: list[Prompt]) -> None:
        if not prompts:
            raise api.ApiError(400, "no prompt given", ErrorCode.INVALID_REQUEST, "prompt")
        if len(prompts) > MAX_CHOICES:
            raise api.ApiError(
                400,
                f"{len(prompts)} choices in one request; at most {MAX_CHOICES}",
                ErrorCode.INVALID_REQUEST,
                "n",
            )
        self.front.open_response(self.identity, f"{self.key}:0", len(prompts))
        self.open = True  # until close(), a drain waits for this answer to be written
        try:
            for i, p in enumerate(prompts):
                self.rids.append(
                    self.front.submit(
                        self.identity,
                        f"{self.key}:{i}",
                        p.ids,
                        p.params,
                        api_key=self.api_key,
                        logprob_start_len=p.logprob_start_len,
                        stream=self.stream,
                        sink=self.queue,
                        index=i,
                        embed=p.embed,
                    )
                )
                self.choices.append(Choice())
                self.unfinished.add(i)
        except Exception:
            self.close()
            raise
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait((None, _GONE))

    async def next(self) -> tuple[int, TextDelta]:
        index, item = await self.queue.get()
        if item is _GONE:
            raise ClientGone()
        if isinstance(item, RequestError):
            self.unfinished.discard(index)
            raise api.ApiError.from_code(item.code, str(item), status=item.status)
        self.choices[index].add(item)
        if item.finish_reason is not None:
            self.unfinished.discard(index)
        return index, item

    async def collect(self) -> list[Choice]:
        while self.unfinished:
            await self.next()
        return self.choices

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def close(self) -> None:
        """Abort what has not finished, stop watching the client; once, however the answer ended."""
        if not self.open:
            return
        self.open = False
        for i in self.unfinished:
            self.front.abort(self.rids[i])
        self.unfinished.clear()
        if self.watcher is not None:
            self.watcher.cancel()
        self.front.close_response()


async def sse_events(
    job: Job, first: tuple[int, TextDelta], render, tail=None
) -> AsyncIterator[bytes]:
    """A job's stream: ``render(index, delta)`` (a chunk, or None to send nothing) for each delta
    from ``first`` on; an error event if one of its requests failed; then ``tail()`` (a last
    chunk, or None) and ``[DONE]``."""
    item = first
    try:
        while True:
            chunk = render(*item)
            if chunk is not None:
                yield sse(chunk)
            if job.finished:
                break
            item = await job.next()
    except api.ApiError as e:
        yield b"data: " + api.error_body(e) + b"\n\n"
    last = tail() if tail is not None else None
    if last is not None:
        yield sse(last)
    yield DONE


class SSEResponse:
    """An ASGI response streaming ``chunks``; ``on_close`` runs however it ends."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close) -> None:
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, ClientGone):
            pass  # the client went away; on_close aborts what still runs
        finally:
            await self.chunks.aclose()
            self.on_close()
