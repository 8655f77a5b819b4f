"""What every HTTP endpoint shares: ``HttpContext``.

It holds the ``FrontApi`` and the served model's name, and does what each
handler needs before and after its own work: the API key check, reading a
body within ``max_message_bytes``, refusing another model's name, building
``SamplingParams`` (errors named by the OpenAI field), the default
``max_tokens``, token texts, running a ``Job`` and control requests (with a
timeout).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request

from radixrt.grammar import GrammarError
from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.front_api import FrontApi, RequestError
from radixrt.server.http import schemas as api
from radixrt.server.http.jobs import Job, Prompt, SSEResponse

CONTROL_TIMEOUT_S = 30.0
SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> OpenAI field


class HttpContext:
    def __init__(self, front: FrontApi) -> None:
        self.front = front
        self.model_name = front.server.served_model_name or front.model["model_name"]
        self.created = int(time.time())
        self.token_texts: dict[int, str] = {}

    def check_key(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else None
        if not self.front.authorized(key):
            raise api.ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                ErrorCode.UNAUTHORIZED,
            )
        return key

    async def read(self, request: Request, cls: type) -> Any:
        """The JSON body as ``cls``, refused past ``max_message_bytes`` before it is all read."""
        limit = self.front.server.max_message_bytes
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
            data = await asyncio.wait_for(self.front.control(kind), CONTROL_TIMEOUT_S)
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
            text = self.token_texts[token] = self.front.decode([token])
        return text

    async def run_job(
        self, request: Request, key: str | None, prompts: list[Prompt], stream: bool, render_stream
    ) -> Job | SSEResponse:
        """Admit prompts. Unstreamed: wait for every choice and return the Job (the caller renders
        ``job.choices``). Streamed: wait for the first delta, so that a request failing before its
        first token still gets its HTTP status, then stream ``render_stream(job, first)``."""
        job = Job(self.front, request, key, stream)
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
        return self.front.limit_new_tokens(sp, given)

    def default_max_tokens(self, prompt_len: int) -> int:
        """A chat request without max_tokens may fill the context (within the server's limit)."""
        room = self.front.model["max_context"] - prompt_len
        return max(1, min(room, self.front.server.max_new_tokens_limit))
