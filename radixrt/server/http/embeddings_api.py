"""OpenAI's ``POST /v1/embeddings``, and vLLM's ``POST /tokenize`` and ``POST /detokenize``.

Embeddings: ``input`` is a string, a list of strings, a list of token ids or a list of
lists of token ids; each becomes one embedding request (``FrontApi.submit(embed=True)``),
whose answer is its prompt's final hidden state (after the final norm: what the LM head
reads), float32, pooled by the server's ``embedding_pooling`` (the last token's, or the mean
over the prompt's tokens), not normalized. ``encoding_format`` "float" gives the values as
JSON numbers (each the float32 value exactly), "base64" their little-endian float32 bytes (as
OpenAI's SDK decodes them). ``dimensions`` is refused: the model's hidden size is the only
one (no Matryoshka truncation). ``usage`` counts the prompts' tokens, and, as every usage
here, the cached ones.

Tokenize: ``prompt`` (tokenized with the tokenizer's special tokens unless
``add_special_tokens`` is false) or ``messages`` (the chat template applied, with
``add_generation_prompt`` / ``continue_final_message`` / ``chat_template_kwargs``; special
tokens added on top only with ``add_special_tokens`` true), answered with ``tokens``,
``count`` and ``max_model_len``. Detokenize: ``tokens`` (each in the vocabulary) to
``prompt``, special tokens kept.

A field the endpoint cannot honour is a 400 naming it.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.front_api import FrontApi, RequestError
from radixrt.server.http import schemas as api
from radixrt.server.http.context import HttpContext
from radixrt.server.http.jobs import MAX_CHOICES, Prompt, json_response
from radixrt.server.http.openai_api import RESERVED_TEMPLATE_KWARGS, OpenAIApi

# The admission errors a prompt itself causes (empty, too long, ids outside the vocabulary).
INPUT_ERRORS = (ErrorCode.INVALID_REQUEST, ErrorCode.PROMPT_TOO_LONG)


class EmbeddingRequest(api._Strict):
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: a string input's tokens include BOS etc.


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: api.PromptTokensDetails


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(api._Strict):
    """vLLM's tokenize request: its completion form (``prompt``) or its chat form
    (``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[api.ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(api._Strict):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _invalid(message: str, param: str) -> api.ApiError:
    return api.ApiError(400, message, ErrorCode.INVALID_REQUEST, param)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as the answer gives it: the values, or base64 of their little-endian
    float32 bytes."""
    if encoding_format == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


class EmbeddingsApi:
    """``/v1/embeddings``."""

    def __init__(self, http: HttpContext, front: FrontApi) -> None:
        self.http, self.front = http, front  # the HTTP plumbing, and the front process

    def input_ids(self, body: EmbeddingRequest) -> list[list[int]]:
        """The token ids of each input (400 naming ``input`` for any other shape, or an input
        with no tokens)."""
        x = body.input
        if isinstance(x, str):
            x = [x]
        if isinstance(x, list) and x and all(isinstance(s, str) for s in x):
            ids = [self.front.encode(s, body.add_special_tokens) for s in x]
        elif _is_ids(x):
            ids = [x]
        elif isinstance(x, list) and x and all(_is_ids(p) for p in x):
            ids = x
        else:
            raise _invalid(
                "input must be a non-empty string, a list of strings, a list of token ids or "
                "a list of lists of token ids (none empty)",
                "input",
            )
        empty = [i for i, p in enumerate(ids) if not p]
        if empty:
            raise _invalid(f"input[{empty[0]}] has no tokens", "input")
        if len(ids) > MAX_CHOICES:
            raise _invalid(f"{len(ids)} inputs in one request; at most {MAX_CHOICES}", "input")
        return ids

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None:
            size = self.front.model.get("hidden_size")
            raise _invalid(
                f"dimensions is not supported: this model's embeddings have its hidden size "
                f"({size}) and no shorter form (no Matryoshka truncation)",
                "dimensions",
            )

    async def embeddings(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, EmbeddingRequest)
        self.http.check_model(body.model)
        self.check_dimensions(body.dimensions)
        sp = SamplingParams(max_new_tokens=0)
        prompts = [Prompt(ids, sp, embed=True) for ids in self.input_ids(body)]
        try:
            job = await self.http.run_job(request, key, prompts, False, None)
        except RequestError as e:
            if e.code not in INPUT_ERRORS:
                raise
            raise api.ApiError.from_code(e.code, f"input: {e}", "input", e.status) from None
        data = []
        for i, c in enumerate(job.choices):
            if c.embedding is None:
                raise api.ApiError(500, f"input[{i}] got no embedding", ErrorCode.INTERNAL)
            data.append(
                EmbeddingData(index=i, embedding=encode_vector(c.embedding, body.encoding_format))
            )
        tokens = sum(c.prompt_tokens for c in job.choices)
        cached = api.PromptTokensDetails(sum(c.cached_tokens for c in job.choices))
        usage = EmbeddingUsage(tokens, tokens, cached)
        model = body.model or self.http.model_name
        return json_response(EmbeddingResponse(data=data, model=model, usage=usage))


class TokenizeApi:
    """``/tokenize`` and ``/detokenize``."""

    def __init__(self, http: HttpContext, front: FrontApi) -> None:
        self.http, self.front = http, front

    async def tokenize(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, TokenizeRequest)
        self.http.check_model(body.model)
        if body.return_token_strs:
            raise _invalid("return_token_strs is not supported", "return_token_strs")
        if body.tools:
            raise _invalid("tools are not supported by /tokenize", "tools")
        if (body.prompt is None) == (body.messages is None):
            raise _invalid("pass exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.front.encode(body.prompt, special)
        else:
            special = bool(body.add_special_tokens)
            ids = self.front.encode(self.chat_text(body), special)
        limit = self.front.model["max_context"]
        return json_response(TokenizeResponse(ids, len(ids), limit))

    def chat_text(self, body: TokenizeRequest) -> str:
        """The chat template applied to the request's messages."""
        messages = []
        for i, m in enumerate(body.messages):
            if m.role == "tool" or m.tool_calls:
                raise _invalid("tool messages and tool calls are not supported", "messages")
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": OpenAIApi.message_text(m.content, i)})
        if not messages:
            raise _invalid("messages is empty", "messages")
        kwargs = dict(body.chat_template_kwargs or {})
        bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise _invalid(f"chat_template_kwargs may not set {bad}", "chat_template_kwargs")
        kwargs["add_generation_prompt"] = body.add_generation_prompt
        if body.continue_final_message:
            kwargs.update(continue_final_message=True, add_generation_prompt=False)
        return self.front.chat_prompt(messages, **kwargs)

    async def detokenize(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, DetokenizeRequest)
        self.http.check_model(body.model)
        vocab = self.front.model["vocab_size"]
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise _invalid(f"token ids outside [0, {vocab}): {bad[:5]}", "tokens")
        return json_response(DetokenizeResponse(self.front.decode(body.tokens)))
