"""The HTTP front: OpenAI's API, SGLang's native API and Prometheus metrics.

It runs inside the TokenizerManager process, on its asyncio loop (uvicorn,
Starlette), so an HTTP request costs no process hop more than a ZeroMQ one:
a handler tokenizes, validates and admits its requests through the
TokenizerManager (``check_admission`` / ``admit``), then reads their text
deltas from its own queue (a ``Job``).

Endpoints:
- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
  (OpenAI's shapes; streams are Server-Sent Events ending in ``data: [DONE]``);
- ``POST /generate``, ``GET /get_model_info``, ``GET /get_server_info``,
  ``POST /flush_cache`` (SGLang's);
- ``GET /health`` (200 serving, 503 draining) and ``GET /metrics``, which
  answer without an API key; everything else needs ``Authorization: Bearer
  KEY`` when the server has ``--api-key``.

Every error is an OpenAI error object with its status (see
``openai_protocol.ApiError``); nothing a client sends gets a stack trace or
stops the server. A client that disconnects before its answer is complete
has its requests aborted (their KV is freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from typing import Any, AsyncIterator

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixrt.protocol import ErrorCode, TextDelta
from radixrt.sampling import SamplingParams
from radixrt.server import openai_protocol as api
from radixrt.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixrt.server.tokenizer_manager import RequestError, TokenizerManager

log = logging.getLogger(__name__)

MAX_CHOICES = 128          # n, or prompts × n, in one request
CONTROL_TIMEOUT_S = 30.0
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"
_GONE = object()  # queued by a Job's watcher when its client disconnects
# apply_chat_template arguments a request's chat_template_kwargs may not set
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "return_dict", "return_tensors",
                                      "add_generation_prompt", "continue_final_message", "chat_template",
                                      "tools", "documents", "padding", "truncation", "max_length",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})
SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> OpenAI field


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


class Choice:
    """What one engine request has produced so far."""

    __slots__ = ("texts", "token_ids", "logprobs", "top_logprobs", "finish_reason", "prompt_tokens",
                 "cached_tokens", "prompt_logprobs", "prompt_top_logprobs")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.finish_reason: str | None = None
        self.prompt_tokens = self.cached_tokens = 0
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list | None = None

    def add(self, d: TextDelta) -> None:
        self.texts.append(d.text)
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs or ())
        self.top_logprobs.extend(d.top_logprobs or ())
        self.finish_reason = d.finish_reason
        self.prompt_tokens, self.cached_tokens = d.prompt_tokens, d.cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs

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

    def __init__(self, front: HttpFront, request: Request, api_key: str | None, stream: bool) -> None:
        self.front, self.tm, self.request = front, front.tm, request
        self.api_key, self.stream = api_key, stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.choices: list[Choice] = []
        self.unfinished: set[int] = set()
        self.watcher: asyncio.Task | None = None
        client = api_key if api_key is not None else (request.client.host if request.client else "?")
        self.identity = b"http\0" + client.encode()
        self.key = f"h{next(self._ids)}"

    def start(self, prompts: list[Prompt]) -> None:
        if not prompts:
            raise api.ApiError(400, "no prompt given", ErrorCode.INVALID_REQUEST, "prompt")
        if len(prompts) > MAX_CHOICES:
            raise api.ApiError(400, f"{len(prompts)} choices in one request; at most {MAX_CHOICES}",
                               ErrorCode.INVALID_REQUEST, "n")
        self.tm.check_admission(self.identity, f"{self.key}:0", count=len(prompts))
        try:
            for i, p in enumerate(prompts):
                self.rids.append(self.tm.admit(self.identity, f"{self.key}:{i}", p.ids, p.params,
                                               api_key=self.api_key, logprob_start_len=p.logprob_start_len,
                                               stream=self.stream, sink=self.queue, index=i))
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
            raise api.ApiError(item.status or api.STATUS_OF_CODE.get(item.code, 500), str(item), item.code)
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
        for i in self.unfinished:
            self.tm.abort_rid(self.rids[i])
        self.unfinished.clear()
        if self.watcher is not None:
            self.watcher.cancel()


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


class HttpFront:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self.model_name = tm.args.get("served_model_name") or tm.limits["model_name"]
        self.created = int(time.time())
        self.token_texts: dict[int, str] = {}
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.authed(self.models), methods=["GET"]),
            Route("/v1/chat/completions", self.authed(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self.authed(self.completions), methods=["POST"]),
            Route("/generate", self.authed(self.generate), methods=["POST"]),
            Route("/get_model_info", self.authed(self.model_info), methods=["GET"]),
            Route("/model_info", self.authed(self.model_info), methods=["GET"]),
            Route("/get_server_info", self.authed(self.server_info), methods=["GET"]),
            Route("/server_info", self.authed(self.server_info), methods=["GET"]),
            Route("/flush_cache", self.authed(self.flush_cache), methods=["POST", "GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self.on_http_exception,
                                                                Exception: self.on_exception})

    # ------------------------------------------------------------ plumbing

    async def on_http_exception(self, request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
                       exc.status_code, str(exc.detail))
        return error_response(api.ApiError(exc.status_code, message, "not_found" if exc.status_code == 404
                                           else ErrorCode.INVALID_REQUEST))

    async def on_exception(self, request: Request, exc: Exception) -> Response:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return error_response(api.ApiError(500, f"internal error: {type(exc).__name__}", ErrorCode.INTERNAL))

    def authed(self, handler):
        """``handler(request, api_key)`` behind the API key check, with errors as OpenAI error objects."""
        async def endpoint(request: Request) -> Response:
            try:
                key = self.check_key(request)
                return await handler(request, key)
            except api.ApiError as e:
                return error_response(e)
            except RequestError as e:
                return error_response(api.ApiError(e.status or api.STATUS_OF_CODE.get(e.code, 500), str(e),
                                                   e.code))
            except ClientGone:
                return Response(status_code=499)
        return endpoint

    def check_key(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else None
        if self.tm.api_keys and not self.tm.authorized(key):
            raise api.ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                               ErrorCode.UNAUTHORIZED)
        return key

    async def read(self, request: Request, cls: type) -> Any:
        """The JSON body as ``cls``, refused past ``max_message_bytes`` before it is all read."""
        limit = self.tm.max_message_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise api.ApiError(413 if length.isdigit() else 400, f"a body of {length} bytes; the server "
                               f"accepts at most {limit}", ErrorCode.TOO_LARGE)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise api.ApiError(413, f"the body is over the server's limit of {limit} bytes",
                                   ErrorCode.TOO_LARGE)
            parts.append(part)
        return api.decode_body(b"".join(parts), cls)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise api.ApiError(404, f"the model {name!r} does not exist; this server serves "
                               f"{self.model_name!r}", "model_not_found", "model")

    async def control(self, kind: str) -> dict:
        try:
            data = await asyncio.wait_for(self.tm.control_async(kind), CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise api.ApiError(503, f"the scheduler did not answer {kind}", ErrorCode.INTERNAL) from None
        if isinstance(data, RequestError):
            raise data
        return data

    def token_text(self, token: int) -> str:
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tm.tokenizer.decode([token])
        return text

    async def run_job(self, request: Request, key: str | None, prompts: list[Prompt], stream: bool,
                      render_stream) -> Response:
        """Admit prompts; answer with the stream ``render_stream(job, first)`` makes, or with the
        finished choices (``render_stream`` None: the caller renders ``job.choices``)."""
        job = Job(self, request, key, stream)
        job.start(prompts)
        self.tm.http_open += 1
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                job.close()
                self.tm.http_open -= 1

        try:
            if not stream:
                await job.collect()
                return job
            first = await job.next()  # errors before the first token still get their status
        except BaseException:
            close()
            raise
        finally:
            if not stream:
                close()
        return SSEResponse(render_stream(job, first), close)

    # ---------------------------------------------------------- sampling

    def sampling(self, body: api._Sampling, max_tokens: int | None, default_max: int, logprobs: bool,
                 top_logprobs: int, index: int) -> SamplingParams:
        seed = body.seed
        if seed is not None and index:
            seed = seed + index if seed + index < 2**63 else seed - index
        fields = dict(max_new_tokens=default_max if max_tokens is None else max_tokens,
                      temperature=1.0 if body.temperature is None else body.temperature,
                      top_p=1.0 if body.top_p is None else body.top_p,
                      top_k=-1 if body.top_k is None else body.top_k,
                      min_p=0.0 if body.min_p is None else body.min_p,
                      stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                      seed=seed, logprobs=logprobs, top_logprobs=top_logprobs, cache_salt=body.cache_salt)
        return self.make_params(fields, given=max_tokens is not None)

    def make_params(self, fields: dict, given: bool) -> SamplingParams:
        try:
            sp = SamplingParams(**fields)
        except (ValueError, TypeError) as e:
            message = str(e)
            param = message.split(" ", 1)[0].removeprefix("SamplingParams.")
            param = SAMPLING_NAMES.get(param, param)
            raise api.ApiError(400, message.replace("SamplingParams.max_new_tokens", "max_tokens"),
                               ErrorCode.INVALID_REQUEST, param if param.isidentifier() else None) from None
        return self.tm.limit_new_tokens(sp, given)

    def default_max_tokens(self, prompt_len: int) -> int:
        """A chat request without max_tokens may fill the context (within the server's limit)."""
        room = self.tm.limits["max_context"] - prompt_len
        limit = self.tm.args.get("max_new_tokens_limit")
        return max(1, min(room, limit) if limit is not None else room)

    @staticmethod
    def check_n(n: int) -> None:
        if not 1 <= n <= MAX_CHOICES:
            raise api.ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", ErrorCode.INVALID_REQUEST, "n")

    # ------------------------------------------------------------ health

    async def health(self, request: Request) -> Response:
        if self.tm.drain_requested:
            return error_response(api.ApiError(503, "the server is shutting down", ErrorCode.SHUTTING_DOWN))
        return Response(b"", status_code=200)

    async def metrics(self, request: Request) -> Response:
        try:
            stats = await self.control("server_info")
        except (api.ApiError, RequestError):
            stats = {}
        return Response(self.tm.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request, key: str | None) -> Response:
        card = api.ModelCard(id=self.model_name, created=self.created, root=self.tm.limits["model"],
                             max_model_len=self.tm.limits["max_context"])
        return json_response(api.ModelList(data=[card]))

    async def model_info(self, request: Request, key: str | None) -> Response:
        path = self.tm.limits["model"]
        return json_response({"model_path": path, "tokenizer_path": path, "is_generation": True,
                              "served_model_name": self.model_name, "preferred_sampling_params": None,
                              "weight_version": "default", "has_image_understanding": False,
                              "has_audio_understanding": False, "max_context_length": self.tm.limits["max_context"]})

    async def server_info(self, request: Request, key: str | None) -> Response:
        data = await self.control("server_info")
        state = {**data, "avg_spec_accept_length": None,
                 "last_gen_throughput": data.get("output_tokens", 0) / data["decode_forward_s"]
                 if data.get("decode_forward_s") else 0.0}
        args = {k: v for k, v in self.tm.args.items()
                if isinstance(v, (str, int, float, bool, type(None))) and not k.endswith("_addr")
                and k not in ("api_key", "parent_pid", "debug_faults")}
        return json_response({**args, "model_path": data["model"], "served_model_name": self.model_name,
                              "internal_states": [state], "version": "radixrt"})

    async def flush_cache(self, request: Request, key: str | None) -> Response:
        await self.control("flush_cache")
        return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")

    # -------------------------------------------------------------- chat

    def chat_ids(self, body: api.ChatCompletionRequest) -> list[int]:
        messages = []
        for i, m in enumerate(body.messages):
            if m.role == "tool" or m.tool_calls:
                raise api.ApiError(400, "tool messages and tool calls are not supported",
                                   ErrorCode.INVALID_REQUEST, "messages")
            messages.append({"role": "system" if m.role == "developer" else m.role,
                             "content": self.message_text(m.content, i)})
        if not messages:
            raise api.ApiError(400, "messages is empty", ErrorCode.INVALID_REQUEST, "messages")
        kwargs = dict(body.chat_template_kwargs or {})
        bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise api.ApiError(400, f"chat_template_kwargs may not set {bad}", ErrorCode.INVALID_REQUEST,
                               "chat_template_kwargs")
        if body.continue_final_message:
            kwargs.update(continue_final_message=True, add_generation_prompt=False)
        else:
            kwargs["add_generation_prompt"] = body.add_generation_prompt
        return self.tm.tokenizer.encode(self.tm.chat_prompt(messages, **kwargs))

    @staticmethod
    def message_text(content: str | list | None, i: int) -> str:
        if content is None or isinstance(content, str):
            return content or ""
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise api.ApiError(400, f"messages[{i}]: only text content parts are supported "
                                   f"(got type {part.get('type')!r})", ErrorCode.INVALID_REQUEST, "messages")
            texts.append(part["text"])
        return "\n".join(texts)

    async def chat_completions(self, request: Request, key: str | None) -> Response:
        body = await self.read(request, api.ChatCompletionRequest)
        self.check_model(body.model)
        api.check_neutral(body)
        self.check_n(body.n)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise api.ApiError(400, "max_tokens and max_completion_tokens differ", ErrorCode.INVALID_REQUEST,
                               "max_completion_tokens")
        if body.top_logprobs is not None and not body.logprobs:
            raise api.ApiError(400, "top_logprobs needs logprobs=true", ErrorCode.INVALID_REQUEST, "top_logprobs")
        ids = self.chat_ids(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompts = [Prompt(ids, self.sampling(body, max_tokens, self.default_max_tokens(len(ids)), body.logprobs,
                                             body.top_logprobs or 0, i))
                   for i in range(body.n)]
        meta = (f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), body.model or self.model_name)
        result = await self.run_job(request, key, prompts, body.stream,
                                    lambda job, first: self.chat_stream(job, first, body, meta))
        if body.stream:
            return result
        choices = [api.ChatChoice(i, api.AssistantMessage(c.text), c.finish_reason,
                                  self.chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                                  if body.logprobs else None)
                   for i, c in enumerate(result.choices)]
        return json_response(api.ChatCompletion(meta[0], meta[1], meta[2], choices,
                                                self.usage(result.choices, body.n)))

    async def chat_stream(self, job: Job, first, body: api.ChatCompletionRequest, meta) -> AsyncIterator[bytes]:
        opts = body.stream_options or api.StreamOptions()
        started: set[int] = set()
        item = first
        try:
            while True:
                index, d = item
                if d.text or d.finish_reason is not None or index not in started or d.token_ids and body.logprobs:
                    delta = api.ChatDelta(content=d.text, role=None if index in started else "assistant")
                    started.add(index)
                    lp = self.chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs) if body.logprobs else None
                    choice = api.ChatChunkChoice(index, delta, d.finish_reason, lp)
                    usage = self.usage(job.choices, body.n) if opts.continuous_usage_stats else None
                    yield sse(api.ChatCompletionChunk(meta[0], meta[1], meta[2], [choice], usage))
                if job.finished:
                    break
                item = await job.next()
        except api.ApiError as e:
            yield b"data: " + api.error_body(e) + b"\n\n"
        if opts.include_usage:
            yield sse(api.ChatCompletionChunk(meta[0], meta[1], meta[2], [], self.usage(job.choices, body.n)))
        yield DONE

    def chat_logprobs(self, ids: list[int], lps: list[float] | None, tops: list | None) -> api.ChoiceLogprobs:
        content = []
        for j, (token, lp) in enumerate(zip(ids, lps or ())):
            top = []
            if tops:
                for t, tlp in zip(*tops[j]):
                    text = self.token_text(t)
                    top.append(api.TopLogprob(text, tlp, list(text.encode())))
            text = self.token_text(token)
            content.append(api.TokenLogprob(text, lp, list(text.encode()), top))
        return api.ChoiceLogprobs(content)

    @staticmethod
    def usage(choices: list[Choice], n: int) -> api.Usage:
        """Prompt and cached tokens once per prompt (the n choices of one share it), completion
        tokens of every choice."""
        prompt = cached = 0
        for start in range(0, len(choices), n):
            group = choices[start:start + n]
            prompt += max(c.prompt_tokens for c in group)
            cached += max(c.cached_tokens for c in group)
        completion = sum(len(c.token_ids) for c in choices)
        return api.Usage(prompt, completion, prompt + completion, api.PromptTokensDetails(cached))

    # ------------------------------------------------------- completions

    def completion_prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """(ids, text) of each prompt: a string, strings, token ids, or lists of token ids."""
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)
        if isinstance(prompt, str):
            return [(self.tm.tokenizer.encode(prompt), prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [(self.tm.tokenizer.encode(p), p) for p in prompt]
            if is_ids(prompt):
                return [(prompt, None)]
            if all(is_ids(p) for p in prompt):
                return [(p, None) for p in prompt]
        raise api.ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list "
                           "of lists of token ids (none empty)", ErrorCode.INVALID_REQUEST, "prompt")

    async def completions(self, request: Request, key: str | None) -> Response:
        body = await self.read(request, api.CompletionRequest)
        self.check_model(body.model)
        api.check_neutral(body)
        self.check_n(body.n)
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise api.ApiError(400, f"logprobs must be in [0, 20], got {body.logprobs}",
                               ErrorCode.INVALID_REQUEST, "logprobs")
        want_lp = body.logprobs is not None
        prompts = []
        for ids, text in self.completion_prompts(body.prompt):
            start = 1 if body.echo and want_lp and len(ids) > 1 else None
            for j in range(body.n):
                sp = self.sampling(body, body.max_tokens, 16, want_lp, body.logprobs or 0, j)
                prompts.append(Prompt(ids, sp, start, text))
        meta = (f"cmpl-{secrets.token_hex(12)}", int(time.time()), body.model or self.model_name)
        result = await self.run_job(request, key, prompts, body.stream,
                                    lambda job, first: self.completion_stream(job, first, body, prompts, meta))
        if body.stream:
            return result
        choices = []
        for i, (c, p) in enumerate(zip(result.choices, prompts)):
            head = self.echo_text(p) if body.echo else ""
            lp = self.completion_logprobs(c, p, body.echo) if want_lp else None
            choices.append(api.CompletionChoice(i, head + c.text, c.finish_reason, lp))
        return json_response(api.Completion(meta[0], meta[1], meta[2], choices, self.usage(result.choices, body.n)))

    def echo_text(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.tm.tokenizer.decode(p.ids)

    async def completion_stream(self, job: Job, first, body: api.CompletionRequest, prompts: list[Prompt],
                                meta) -> AsyncIterator[bytes]:
        opts = body.stream_options or api.StreamOptions()
        started: set[int] = set()
        offsets = [0] * len(prompts)
        sent = [0] * len(prompts)  # tokens whose logprobs went out
        item = first
        try:
            while True:
                index, d = item
                c, p = job.choices[index], prompts[index]
                text = d.text
                if body.echo and index not in started:
                    text = self.echo_text(p) + text
                if text or d.finish_reason is not None or index not in started:
                    lp = None
                    if body.logprobs is not None:
                        lp = self.completion_logprobs(c, p, body.echo and index not in started, sent[index],
                                                      offsets[index])
                        offsets[index] += sum(len(t) for t in lp.tokens)
                        sent[index] = len(c.token_ids)
                    started.add(index)
                    usage = self.usage(job.choices, body.n) if opts.continuous_usage_stats else None
                    chunk = api.Completion(meta[0], meta[1], meta[2], [api.CompletionChoice(index, text,
                                                                                           d.finish_reason, lp)],
                                           usage)
                    yield sse(chunk)
                if job.finished:
                    break
                item = await job.next()
        except api.ApiError as e:
            yield b"data: " + api.error_body(e) + b"\n\n"
        if opts.include_usage:
            yield sse(api.Completion(meta[0], meta[1], meta[2], [], self.usage(job.choices, body.n)))
        yield DONE

    def completion_logprobs(self, c: Choice, p: Prompt, echo: bool, since: int = 0,
                            offset: int = 0) -> api.CompletionLogprobs:
        """Logprobs of c's tokens from ``since`` on, after the prompt's when ``echo`` (the
        prompt's first token has none); text offsets counted from ``offset``."""
        ids: list[int] = []
        lps: list[float | None] = []
        tops: list = []
        if echo:
            rest = len(p.ids) - 1
            ids += p.ids
            lps += [None, *(c.prompt_logprobs or [None] * rest)]
            tops += [None, *(c.prompt_top_logprobs or [None] * rest)]
        ids += c.token_ids[since:]
        lps += c.logprobs[since:]
        tops += c.top_logprobs[since:] or [None] * (len(c.token_ids) - since)
        tokens = [self.token_text(t) for t in ids]
        text_offset, pos = [], offset
        for t in tokens:
            text_offset.append(pos)
            pos += len(t)
        top_dicts = [None if top is None else {self.token_text(t): lp for t, lp in zip(*top)} for top in tops]
        return api.CompletionLogprobs(tokens, lps, top_dicts, text_offset)

    # -------------------------------------------------- SGLang /generate

    def sglang_params(self, raw: Any, body: api.GenerateReqInput) -> SamplingParams:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise api.ApiError(400, "sampling_params must be an object (or a list of them, one per prompt)",
                               ErrorCode.INVALID_REQUEST, "sampling_params")
        fields = dict(raw)
        neutral = {"n": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                   "no_stop_trim": False, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                   "repetition_penalty": 1.0, "min_new_tokens": 0}
        for name, value in neutral.items():
            if name in fields and fields.pop(name) != value:
                raise api.ApiError(400, f"sampling_params.{name}={raw[name]!r} is not supported by this server",
                                   ErrorCode.INVALID_REQUEST, "sampling_params")
        if "sampling_seed" in fields:
            fields["seed"] = fields.pop("sampling_seed")
        known = set(SamplingParams.__dataclass_fields__) - {"logprobs", "top_logprobs"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise api.ApiError(400, f"unknown sampling_params {unknown}", ErrorCode.INVALID_REQUEST,
                               "sampling_params")
        fields.update(logprobs=body.return_logprob, top_logprobs=body.top_logprobs_num if body.return_logprob else 0)
        return self.make_params(fields, given="max_new_tokens" in fields)

    def sglang_prompts(self, body: api.GenerateReqInput) -> tuple[list[Prompt], bool]:
        """The prompts of a /generate body, and whether it was a batch."""
        if (body.text is None) == (body.input_ids is None):
            raise api.ApiError(400, "pass exactly one of text and input_ids", ErrorCode.INVALID_REQUEST, "text")
        if body.text is not None:
            batch = isinstance(body.text, list)
            texts = body.text if batch else [body.text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise api.ApiError(400, "text must be a string or a non-empty list of strings",
                                   ErrorCode.INVALID_REQUEST, "text")
            ids = [self.tm.tokenizer.encode(t) for t in texts]
        else:
            x = body.input_ids
            batch = isinstance(x, list) and bool(x) and all(isinstance(p, list) for p in x)
            ids = x if batch else [x]
            if not all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in ids):
                raise api.ApiError(400, "input_ids must be a list of token ids or a list of such lists",
                                   ErrorCode.INVALID_REQUEST, "input_ids")
        raw = body.sampling_params
        per = raw if isinstance(raw, list) else [raw] * len(ids)
        if len(per) != len(ids):
            raise api.ApiError(400, f"{len(per)} sampling_params for {len(ids)} prompts", ErrorCode.INVALID_REQUEST,
                               "sampling_params")
        start = None
        if body.return_logprob and body.logprob_start_len >= 0:
            start = max(1, body.logprob_start_len)
        return [Prompt(p, self.sglang_params(r, body), start if start is not None and start < len(p) else None)
                for p, r in zip(ids, per)], batch

    async def generate(self, request: Request, key: str | None) -> Response:
        body = await self.read(request, api.GenerateReqInput)
        prompts, batch = self.sglang_prompts(body)
        t0 = time.monotonic()
        result = await self.run_job(request, key, prompts, body.stream,
                                    lambda job, first: self.generate_stream(job, first, body, prompts, t0))
        if body.stream:
            return result
        outs = [self.sglang_output(i, result, p, body, t0) for i, p in enumerate(prompts)]
        return json_response(outs if batch else outs[0])

    def sglang_output(self, index: int, job: Job, p: Prompt, body: api.GenerateReqInput, t0: float) -> dict:
        c = job.choices[index]
        reason = c.finish_reason
        finish = None
        if reason == "length":
            finish = {"type": "length", "length": len(c.token_ids)}
        elif reason == "stop":
            finish = {"type": "stop", "matched": c.token_ids[-1] if c.token_ids else None}
        elif reason is not None:
            finish = {"type": reason, "message": None}
        meta = {"id": job.rids[index], "finish_reason": finish, "prompt_tokens": len(p.ids),
                "completion_tokens": len(c.token_ids), "cached_tokens": c.cached_tokens,
                "e2e_latency": time.monotonic() - t0}
        if body.return_logprob:
            text = body.return_text_in_logprobs
            meta["output_token_logprobs"] = [[lp, t, self.token_text(t) if text else None]
                                             for lp, t in zip(c.logprobs, c.token_ids)]
            meta["output_top_logprobs"] = [[[lp, t, self.token_text(t) if text else None] for t, lp in zip(*top)]
                                           for top in c.top_logprobs] if body.top_logprobs_num else []
            if p.logprob_start_len is not None:
                tail = p.ids[p.logprob_start_len:]
                first = [[None, p.ids[0], None]] if body.logprob_start_len == 0 else []
                meta["input_token_logprobs"] = first + [[lp, t, self.token_text(t) if text else None]
                                                        for lp, t in zip(c.prompt_logprobs or (), tail)]
        return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta, "index": index}

    async def generate_stream(self, job: Job, first, body: api.GenerateReqInput, prompts: list[Prompt],
                              t0: float) -> AsyncIterator[bytes]:
        item = first
        try:
            while True:
                index, d = item
                yield sse(self.sglang_output(index, job, prompts[index], body, t0))
                if job.finished:
                    break
                item = await job.next()
        except api.ApiError as e:
            yield b"data: " + api.error_body(e) + b"\n\n"
        yield DONE


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the TokenizerManager's process owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def serve_http(tm: TokenizerManager, sock) -> None:
    front = HttpFront(tm)
    config = uvicorn.Config(front.app, lifespan="off", log_level="warning", access_log=False,
                            loop="none", timeout_keep_alive=30)
    await _QuietServer(config).serve(sockets=[sock])
