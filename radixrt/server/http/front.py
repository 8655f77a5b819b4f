"""The HTTP server: routes, API keys, bodies, errors, and the endpoints that only read state.

``HttpFront`` runs on the TokenizerManager's asyncio loop (uvicorn with
Starlette); ``OpenAIApi`` and ``SGLangApi`` handle the generating endpoints.
``/health`` and ``/metrics`` answer without an API key. ``/get_load`` answers SGLang's
router (``sglang-router``), which reads ``num_tokens`` from it for its ``power_of_two`` policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixrt.grammar import GrammarError
from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.http import protocol as api
from radixrt.server.http.jobs import (
    ClientGone,
    Job,
    Prompt,
    SSEResponse,
    error_response,
    json_response,
)
from radixrt.server.http.openai_api import OpenAIApi
from radixrt.server.http.sglang_api import SGLangApi
from radixrt.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixrt.server.tokenizer_manager import RequestError, TokenizerManager

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 30.0
SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> OpenAI field


class HttpFront:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self.model_name = tm.server.served_model_name or tm.limits["model_name"]
        self.created = int(time.time())
        self.token_texts: dict[int, str] = {}
        self.openai, self.sglang = OpenAIApi(self), SGLangApi(self)
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.authed(self.models), methods=["GET"]),
            Route(
                "/v1/chat/completions", self.authed(self.openai.chat_completions), methods=["POST"]
            ),
            Route("/v1/completions", self.authed(self.openai.completions), methods=["POST"]),
            Route("/generate", self.authed(self.sglang.generate), methods=["POST"]),
            Route("/get_model_info", self.authed(self.model_info), methods=["GET"]),
            Route("/model_info", self.authed(self.model_info), methods=["GET"]),
            Route("/get_server_info", self.authed(self.server_info), methods=["GET"]),
            Route("/server_info", self.authed(self.server_info), methods=["GET"]),
            Route("/flush_cache", self.authed(self.flush_cache), methods=["POST", "GET"]),
            Route("/get_load", self.authed(self.get_load), methods=["GET"]),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                HTTPException: self.on_http_exception,
                Exception: self.on_exception,
            },
        )

    # ------------------------------------------------------------ plumbing

    async def on_http_exception(self, request: Request, exc: HTTPException) -> Response:
        message = {
            404: f"no route {request.method} {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error_response(
            api.ApiError(
                exc.status_code,
                message,
                "not_found" if exc.status_code == 404 else ErrorCode.INVALID_REQUEST,
            )
        )

    async def on_exception(self, request: Request, exc: Exception) -> Response:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return error_response(
            api.ApiError(500, f"internal error: {type(exc).__name__}", ErrorCode.INTERNAL)
        )

    def authed(self, handler):
        """``handler(request, api_key)`` behind the API key check, with errors as OpenAI error
        objects."""

        async def endpoint(request: Request) -> Response:
            try:
                key = self.check_key(request)
                return await handler(request, key)
            except api.ApiError as e:
                return error_response(e)
            except RequestError as e:
                return error_response(api.ApiError.from_code(e.code, str(e), status=e.status))
            except ClientGone:
                return Response(status_code=499)

        return endpoint

    def check_key(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else None
        if self.tm.api_keys and not self.tm.authorized(key):
            raise api.ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                ErrorCode.UNAUTHORIZED,
            )
        return key

    async def read(self, request: Request, cls: type) -> Any:
        """The JSON body as ``cls``, refused past ``max_message_bytes`` before it is all read."""
        limit = self.tm.server.max_message_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise api.ApiError(
                413 if length.isdigit() else 400,
                f"a body of {length} bytes; the server accepts at most {limit}",
                ErrorCode.TOO_LARGE,
            )
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise api.ApiError(
                    413,
                    f"the body is over the server's limit of {limit} bytes",
                    ErrorCode.TOO_LARGE,
                )
            parts.append(part)
        return api.decode_body(b"".join(parts), cls)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise api.ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "model_not_found",
                "model",
            )

    async def control(self, kind: str) -> dict:
        try:
            data = await asyncio.wait_for(self.tm.control_async(kind), CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise api.ApiError(
                503, f"the scheduler did not answer {kind}", ErrorCode.INTERNAL
            ) from None
        if isinstance(data, RequestError):
            raise data
        return data

    def token_text(self, token: int) -> str:
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tm.tokenizer.decode([token])
        return text

    async def run_job(
        self, request: Request, key: str | None, prompts: list[Prompt], stream: bool, render_stream
    ) -> Job | SSEResponse:
        """Admit prompts. Unstreamed: wait for every choice and return the Job (the caller renders
        ``job.choices``). Streamed: wait for the first delta, so that a request failing before its
        first token still gets its HTTP status, then stream ``render_stream(job, first)``."""
        job = Job(self.tm, request, key, stream)
        job.start(prompts)
        try:
            if not stream:
                await job.collect()
                job.close()
                return job
            first = await job.next()
        except BaseException:
            job.close()
            raise
        return SSEResponse(render_stream(job, first), job.close)

    def make_params(self, fields: dict, given: bool) -> SamplingParams:
        try:
            sp = SamplingParams(**fields)
        except (ValueError, TypeError) as e:
            message = str(e)
            param = message.split(" ", 1)[0].removeprefix("SamplingParams.").rstrip(":")
            param = SAMPLING_NAMES.get(param, param)
            raise api.ApiError(
                400,
                message.replace("SamplingParams.max_new_tokens", "max_tokens"),
                ErrorCode.INVALID_GRAMMAR
                if isinstance(e, GrammarError)
                else ErrorCode.INVALID_REQUEST,
                param if param.isidentifier() else None,
            ) from None
        return self.tm.limit_new_tokens(sp, given)

    def default_max_tokens(self, prompt_len: int) -> int:
        """A chat request without max_tokens may fill the context (within the server's limit)."""
        room = self.tm.limits["max_context"] - prompt_len
        return max(1, min(room, self.tm.server.max_new_tokens_limit))

    # ------------------------------------------------------------ health

    async def health(self, request: Request) -> Response:
        """200 with no body while every replica serves; 200 with a JSON detail when some are
        down; 503 while draining or when none serves."""
        if self.tm.drain_requested:
            return error_response(
                api.ApiError(503, "the server is shutting down", ErrorCode.SHUTTING_DOWN)
            )
        replicas = self.tm.replicas
        up = [r.index for r in replicas if r.up]
        if not up:
            return error_response(api.ApiError(503, "no replica is serving", ErrorCode.UNAVAILABLE))
        if len(up) < len(replicas):
            down = [r.index for r in replicas if not r.up]
            detail = f"serving on {len(up)} of {len(replicas)} replicas; down: {down}"
            return json_response(
                {"status": "degraded", "detail": detail, "replicas_up": up, "replicas_down": down}
            )
        return Response(b"", status_code=200)

    async def metrics(self, request: Request) -> Response:
        try:
            stats = await self.control("server_info")
        except (api.ApiError, RequestError):
            stats = {}
        views = [
            {
                "replica": r.index,
                "up": r.up,
                "routed": r.routed,
                "waiting_tokens": r.waiting_tokens,
                "mirror_tokens": r.mirror.tree.num_tokens,
            }
            for r in self.tm.replicas
        ]
        return Response(self.tm.metrics.render(stats, views), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request, key: str | None) -> Response:
        card = api.ModelCard(
            id=self.model_name,
            created=self.created,
            root=self.tm.limits["model"],
            max_model_len=self.tm.limits["max_context"],
        )
        return json_response(api.ModelList(data=[card]))

    async def model_info(self, request: Request, key: str | None) -> Response:
        path = self.tm.limits["model"]
        return json_response(
            {
                "model_path": path,
                "tokenizer_path": path,
                "is_generation": True,
                "served_model_name": self.model_name,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "max_context_length": self.tm.limits["max_context"],
            }
        )

    async def server_info(self, request: Request, key: str | None) -> Response:
        data = await self.control("server_info")
        states = [
            {
                **{k: v for k, v in data.items() if k != "replicas"},
                **replica,
                "avg_spec_accept_length": None,
                "last_gen_throughput": replica.get("output_tokens", 0) / replica["decode_forward_s"]
                if replica.get("decode_forward_s")
                else 0.0,
            }
            for replica in data.get("replicas") or [data]
        ]
        args = {
            k: v
            for k, v in dataclasses.asdict(self.tm.server).items()
            if k not in ("api_key", "debug_faults")
        }
        return json_response(
            {
                **args,
                "model_path": data["model"],
                "served_model_name": self.model_name,
                "internal_states": states,
                "version": "radixrt",
            }
        )

    async def get_load(self, request: Request, key: str | None) -> Response:
        return json_response(worker_loads(await self.control("server_info")))

    async def flush_cache(self, request: Request, key: str | None) -> Response:
        await self.control("flush_cache")
        return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")


def worker_loads(info: dict) -> list[dict]:
    """SGLang's ``/get_load`` body from a ``server_info`` answer: one entry per data-parallel
    replica that serves (``dp_rank``: its index) with ``num_reqs`` (running and waiting),
    ``num_waiting_reqs`` and ``num_tokens``: the KV slots running requests hold (neither free
    nor an evictable cached prefix) plus the prompt tokens of the waiting requests, which they
    will need. Every figure is an integer (the router drops a load it cannot read as one)."""
    return [replica_load(r) for r in info.get("replicas") or [info]]


def replica_load(info: dict) -> dict:
    held = info["kv_slots"] - info["free_slots"] - info["evictable_tokens"]
    return {
        "dp_rank": int(info.get("replica", 0)),
        "num_reqs": int(info["running"] + info["waiting"]),
        "num_waiting_reqs": int(info["waiting"]),
        "num_tokens": int(held + info.get("waiting_tokens", 0)),
    }


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the TokenizerManager's process owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def serve_http(tm: TokenizerManager, sock) -> None:
    front = HttpFront(tm)
    config = uvicorn.Config(
        front.app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        loop="none",
        timeout_keep_alive=30,
    )
    await _QuietServer(config).serve(sockets=[sock])
