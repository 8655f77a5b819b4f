"""HTTP bodies of the OpenAI API and of SGLang's native API, as msgspec structs.

Contract:
- Request bodies decode strictly with ``decode_body``: a field of the wrong
  type, or a field the API does not define, is an ``ApiError`` (400) naming
  the field. OpenAI fields that radixrt cannot honour (penalties, logit
  bias) are accepted at their
  neutral values only; any other value is a 400 that says so
  (``check_neutral``). SGLang's own request fields, which its router
  (``sglang-router``) writes into every body it forwards, are accepted the
  same way: at their defaults, or where they change nothing here (logging
  hints, reasoning separation without a reasoning parser).
- With ``--reasoning-parser``, a chat answer's ``message.reasoning_content`` (a stream's
  ``delta.reasoning_content``) holds the reasoning; the field is absent where there is none.
  Fields whose valid shapes msgspec cannot express as
  one union (a completion ``prompt``, SGLang's ``text``/``input_ids``)
  arrive as ``Any`` and are checked by the handlers.
- Response bodies are structs too, encoded with one ``msgspec.json``
  encoder (``encode``). ``Usage.prompt_tokens_details.cached_tokens`` is
  always present, 0 included.
- ``ApiError(status, message, code, param)`` is every error the HTTP front
  answers, rendered as OpenAI's ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from radixrt import grammar
from radixrt.protocol import ErrorCode

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# How each error code of the ZeroMQ protocol answers over HTTP.
STATUS_OF_CODE = {
    ErrorCode.MALFORMED: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_GRAMMAR: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.LIMIT_EXCEEDED: 400,
    ErrorCode.UNKNOWN_RID: 404,
    ErrorCode.DUPLICATE_RID: 400,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.BUSY: 400,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.REPLICA_FAILED: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNKNOWN_MESSAGE: 404,
    ErrorCode.VERSION_MISMATCH: 400,
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def from_code(
        cls, code: str, message: str, param: str | None = None, status: int | None = None
    ) -> ApiError:
        """The error for a ZeroMQ error code (``status``: where the code alone does not decide
        it)."""
        return cls(status or STATUS_OF_CODE.get(code, 500), message, code, param)


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Strict):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}}``, or SGLang's ``{"type": "structural_tag", "format": {...}}``."""

    type: str
    json_schema: dict[str, Any] | None = None
    format: dict[str, Any] | None = None


def constraint_fields(body: Any) -> dict[str, Any]:
    """The SamplingParams constraint fields of a chat or completions body (response_format,
    regex, ebnf); 400 for a response_format radixrt does not know."""
    fields: dict[str, Any] = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        fields["json_schema"] = grammar.JSON_OBJECT
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ApiError(
                400,
                "response_format of type 'json_schema' needs json_schema.schema (an object)",
                ErrorCode.INVALID_REQUEST,
                "response_format",
            )
        fields["json_schema"] = spec["schema"]
    elif fmt is not None and fmt.type == "structural_tag":
        if not isinstance(fmt.format, dict):
            raise ApiError(
                400,
                "response_format of type 'structural_tag' needs format (an object)",
                ErrorCode.INVALID_REQUEST,
                "response_format",
            )
        fields["structural_tag"] = {"type": "structural_tag", "format": fmt.format}
    elif fmt is not None and fmt.type != "text":
        raise ApiError(
            400,
            f"response_format type {fmt.type!r} is not supported "
            "('text', 'json_object', 'json_schema' or 'structural_tag')",
            ErrorCode.INVALID_REQUEST,
            "response_format",
        )
    for name in ("regex", "ebnf"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return fields


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class _Sampling(_Strict, kw_only=True):
    """The sampling fields that chat and completions share (OpenAI's, then SGLang's and vLLM's)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, and SGLang's regex and ebnf
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    # accepted at their neutral values only
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    best_of: int | None = None
    no_stop_trim: bool = False
    return_hidden_states: bool = False


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # with --reasoning-parser: SGLang's reasoning split (false: the reasoning stays in content),
    # its streaming in one piece (stream_reasoning false), and vLLM's bound on its tokens
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    thinking_token_budget: int | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class GenerateReqInput(_Strict):
    """SGLang's ``POST /generate``: one of ``text`` / ``input_ids``, each one prompt or a list."""

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    stream: bool = False
    rid: Any = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    model: str | None = None
    # logging hints: accepted at any value, they change nothing in the answer
    log_metrics: bool = True
    no_logs: bool = False
    # accepted at their neutral values only
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False


GENERATE_NEUTRAL = {
    "return_hidden_states": (False,),
    "return_entropy": (False,),
    "return_bytes": (False,),
    "background": (False,),
}


def refuse_unsupported(body: Any, neutral: dict[str, tuple]) -> None:
    """400 naming the first field of ``body`` whose value is not among its ``neutral`` ones."""
    for name, ok in neutral.items():
        value = getattr(body, name, None)
        if value not in ok:
            raise ApiError(
                400,
                f"{name}={value!r} is not supported by this server",
                ErrorCode.INVALID_REQUEST,
                name,
            )


def check_neutral(body: _Sampling) -> None:
    """400 for OpenAI (and SGLang) fields set to something radixrt does not do."""
    neutral = {
        "frequency_penalty": (None, 0.0),
        "presence_penalty": (None, 0.0),
        "repetition_penalty": (None, 1.0),
        "min_tokens": (None, 0),
        "logit_bias": (None, {}),
        "modalities": (None, ["text"]),
        "no_stop_trim": (False,),
        "return_hidden_states": (False,),
    }
    refuse_unsupported(body, neutral)
    if body.best_of not in (None, body.n):
        raise ApiError(
            400,
            f"best_of={body.best_of} is not supported (only best_of == n)",
            ErrorCode.INVALID_REQUEST,
            "best_of",
        )
    if getattr(body, "suffix", None):
        raise ApiError(400, "suffix is not supported", ErrorCode.INVALID_REQUEST, "suffix")


# ------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # With --speculative-algorithm: the choices' verifications, draft and accepted tokens
    # (SGLang's meta_info names; absent without speculation).
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    # with --reasoning-parser (absent where there is none)
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: None = None


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed tool call: ``id``, ``type`` and ``function.name`` in its first."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    content: str | None = None
    role: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "radixrt"
    quantization: str | None = None  # gguf, q8_0, q4_0, q4_k; None: the model's own weights


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


# ------------------------------------------------------------ encoding

_encoder = msgspec.json.Encoder()
_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)|unknown field `([A-Za-z_][A-Za-z0-9_]*)`$")


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def error_body(err: ApiError) -> bytes:
    return encode(
        ErrorResponse(
            ErrorBody(err.message, ERROR_TYPES.get(err.status, "server_error"), err.param, err.code)
        )
    )


def decode_body(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """The body as ``cls``; ApiError(400) naming the field for anything else."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        match = _PATH.search(str(e))
        raise ApiError(
            400,
            f"invalid request body: {e}",
            ErrorCode.INVALID_REQUEST,
            (match.group(1) or match.group(2)) if match else None,
        ) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", ErrorCode.MALFORMED) from None
