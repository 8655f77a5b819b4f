"""The HTTP application: routes, API keys, errors, and the endpoints that only read state.

``build_app`` routes each endpoint to its handler: ``OpenAIApi``, ``ResponsesApi`` and
``SGLangApi`` handle the generating endpoints, ``EmbeddingsApi`` and
``TokenizeApi`` (``embeddings_api``) ``/v1/embeddings``, ``/tokenize`` and
``/detokenize``, ``InfoApi`` those that read
state or send a control request; all share one ``HttpContext`` over the
``FrontApi`` the TokenizerManager hands ``serve_http``, which runs it on that
process's asyncio loop (uvicorn). ``/health`` and ``/metrics`` answer without
an API key. ``/get_load`` answers SGLang's router (``sglang-router``), which
reads ``num_tokens`` from it for its ``power_of_two`` policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixrt.protocol import ErrorCode
from radixrt.server.front_api import FrontApi, RequestError
from radixrt.server.http import schemas as api
from radixrt.server.http.context import HttpContext
from radixrt.server.http.embeddings_api import EmbeddingsApi, TokenizeApi
from radixrt.server.http.jobs import ClientGone, error_response, json_response
from radixrt.server.http.openai_api import OpenAIApi
from radixrt.server.http.responses_api import ResponsesApi
from radixrt.server.http.sglang_api import SGLangApi
from radixrt.server.http.tools import ResponsesToolCalls
from radixrt.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)

Handler = Callable[[Request, "str | None"], Awaitable[Response]]


def build_app(front: FrontApi) -> Starlette:
    """The Starlette application of every endpoint, over ``front``."""
    http = HttpContext(front)
    openai, sglang, info = OpenAIApi(http, front), SGLangApi(http, front), InfoApi(http, front)
    responses = ResponsesApi(http, front, tool_calls=ResponsesToolCalls(front.server))
    embeddings, tokens = EmbeddingsApi(http, front), TokenizeApi(http, front)

    def authed(handler: Handler):
        return with_key(http, handler)

    routes = [
        Route("/health", info.health, methods=["GET"]),
        Route("/metrics", info.metrics, methods=["GET"]),
        Route("/v1/models", authed(info.models), methods=["GET"]),
        Route("/v1/chat/completions", authed(openai.chat_completions), methods=["POST"]),
        Route("/v1/completions", authed(openai.completions), methods=["POST"]),
        Route("/v1/responses", authed(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", authed(responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", authed(responses.delete), methods=["DELETE"]),
        Route("/v1/embeddings", authed(embeddings.embeddings), methods=["POST"]),
        Route("/tokenize", authed(tokens.tokenize), methods=["POST"]),
        Route("/detokenize", authed(tokens.detokenize), methods=["POST"]),
        Route("/generate", authed(sglang.generate), methods=["POST"]),
        Route("/get_model_info", authed(info.model_info), methods=["GET"]),
        Route("/model_info", authed(info.model_info), methods=["GET"]),
        Route("/get_server_info", authed(info.server_info), methods=["GET"]),
        Route("/server_info", authed(info.server_info), methods=["GET"]),
        Route("/flush_cache", authed(info.flush_cache), methods=["POST", "GET"]),
        Route("/get_load", authed(info.get_load), methods=["GET"]),
    ]
    handlers = {HTTPException: on_http_exception, Exception: on_exception}
    return Starlette(routes=routes, exception_handlers=handlers)


def with_key(http: HttpContext, handler: Handler):
    """``handler(request, api_key)`` behind the API key check, with errors as OpenAI error
    objects."""

    async def endpoint(request: Request) -> Response:
        try:
            key = http.check_key(request)
            return await handler(request, key)
        except api.ApiError as e:
            return error_response(e)
        except RequestError as e:
            return error_response(api.ApiError.from_code(e.code, str(e), status=e.status))
        except ClientGone:
            return Response(status_code=499)

    return endpoint


async def on_http_exception(request: Request, exc: HTTPException) -> Response:
    message = {
        404: f"no route {request.method} {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    code = "not_found" if exc.status_code == 404 else ErrorCode.INVALID_REQUEST
    return error_response(api.ApiError(exc.status_code, message, code))


async def on_exception(request: Request, exc: Exception) -> Response:
    log.exception("HTTP %s %s failed", request.method, request.url.path)
    return error_response(
        api.ApiError(500, f"internal error: {type(exc).__name__}", ErrorCode.INTERNAL)
    )


class InfoApi:
    """``/health``, ``/metrics``, the model and server info, ``/get_load``, ``/flush_cache``."""

    def __init__(self, http: HttpContext, front: FrontApi) -> None:
        self.http, self.front = http, front  # the HTTP plumbing, and the front process

    async def health(self, request: Request) -> Response:
        """200 with no body while every replica serves; 200 with a JSON detail when some are
        down; 503 while draining or when none serves."""
        status = self.front.status()
        if status.draining:
            return error_response(
                api.ApiError(503, "the server is shutting down", ErrorCode.SHUTTING_DOWN)
            )
        up, down = list(status.replicas_up), list(status.replicas_down)
        if not up:
            return error_response(api.ApiError(503, "no replica is serving", ErrorCode.UNAVAILABLE))
        if down:
            detail = f"serving on {len(up)} of {len(up) + len(down)} replicas; down: {down}"
            return json_response(
                {"status": "degraded", "detail": detail, "replicas_up": up, "replicas_down": down}
            )
        return Response(b"", status_code=200)

    async def metrics(self, request: Request) -> Response:
        try:
            stats = await self.http.control("server_info")
        except (api.ApiError, RequestError):
            stats = {}
        return Response(self.front.metrics(stats), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request, key: str | None) -> Response:
        card = api.ModelCard(
            id=self.http.model_name,
            created=self.http.created,
            root=self.front.model["model"],
            max_model_len=self.front.model["max_context"],
            quantization=self.front.model.get("quantization"),
        )
        return json_response(api.ModelList(data=[card]))

    async def model_info(self, request: Request, key: str | None) -> Response:
        path = self.front.model["model"]
        return json_response(
            {
                "model_path": path,
                "tokenizer_path": path,
                "is_generation": True,
                "served_model_name": self.http.model_name,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "max_context_length": self.front.model["max_context"],
            }
        )

    async def server_info(self, request: Request, key: str | None) -> Response:
        data = await self.http.control("server_info")
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
            for k, v in dataclasses.asdict(self.front.server).items()
            if k not in ("api_key", "debug_faults")
        }
        return json_response(
            {
                **args,
                "model_path": data["model"],
                "served_model_name": self.http.model_name,
                "internal_states": states,
                "version": "radixrt",
            }
        )

    async def get_load(self, request: Request, key: str | None) -> Response:
        return json_response(worker_loads(await self.http.control("server_info")))

    async def flush_cache(self, request: Request, key: str | None) -> Response:
        await self.http.control("flush_cache")
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


async def serve_http(front: FrontApi, sock) -> None:
    """Serve the HTTP API on the listening socket ``sock`` until cancelled."""
    config = uvicorn.Config(
        build_app(front),
        lifespan="off",
        log_level="warning",
        access_log=False,
        loop="none",
        timeout_keep_alive=30,
    )
    await _QuietServer(config).serve(sockets=[sock])
