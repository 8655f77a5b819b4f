"""Messages exchanged between radixrt components.

Contract:
- Every message is a ``msgspec.Struct`` tagged with a ``type`` field; the union
  of all of them is ``Message``. On every socket (clients ↔ TokenizerManager,
  between the server processes, children → launcher) a message is one frame of
  msgpack produced by ``encode`` and read back by ``decode`` (one encoder/decoder
  pair). Nothing is pickled.
- A client opens with ``Hello(version=PROTOCOL_VERSION)``; the server answers
  ``HelloReply`` with its info, or ``ErrorReply(code=VERSION_MISMATCH)``.
- When the server runs with an API key, every client message carries it in
  ``api_key``; one without it (or with a wrong one) gets
  ``ErrorReply(code=UNAUTHORIZED)`` and is otherwise ignored.
- Every client request carries a client-chosen ``req_id``; every reply to it
  carries the same ``req_id`` (the replies one scheduler step produces for one
  client may arrive together in a ``ReplyBatch``; a ``Ping`` probe has
  ``req_id == ""`` and is ignored). Errors are ``ErrorReply`` with one of the
  ``ErrorCode`` constants; an error about a frame that could not be decoded
  has ``req_id == ""``.
- Each scheduler replica may publish its radix tree's changes as numbered
  ``KVEventBatch``es (``KVStored``/``KVSplit``/``KVRemoved``/``KVWindow``/``KVCleared``) and
  answer a resync with a ``KVSnapshot``; ``radixrt.cache.mirror`` rebuilds the
  tree from them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixrt.sampling import SamplingParams

PROTOCOL_VERSION = 1


class ErrorCode:
    MALFORMED = "malformed"  # bytes that are not a message
    UNKNOWN_MESSAGE = "unknown_message"  # a message type the receiver does not handle
    VERSION_MISMATCH = "version_mismatch"
    INVALID_REQUEST = "invalid_request"  # bad sampling params, prompt fields, ids
    INVALID_GRAMMAR = "invalid_grammar"  # a json_schema, regex or ebnf that does not parse
    PROMPT_TOO_LONG = "prompt_too_long"
    UNKNOWN_RID = "unknown_rid"
    DUPLICATE_RID = "duplicate_rid"
    OVERLOADED = "overloaded"  # the waiting queue is full
    BUSY = "busy"  # e.g. flush_cache with running requests
    INTERNAL = "internal"  # a server fault while handling the request
    UNAUTHORIZED = "unauthorized"  # missing or wrong API key
    TOO_LARGE = "too_large"  # a message over the server's byte limit
    LIMIT_EXCEEDED = "limit_exceeded"  # max_new_tokens or in-flight requests over a limit
    SHUTTING_DOWN = "shutting_down"  # the server is draining; no new requests
    REPLICA_FAILED = "replica_failed"  # the replica running the request exited
    UNAVAILABLE = "unavailable"  # no replica is serving


class GenerateOutput(msgspec.Struct, kw_only=True):
    """The result of one generation request."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # "stop" | "length" | "abort"
    # Where cached_tokens were found: {"device": d, "host": h, "storage": s}, d + h + s ==
    # cached_tokens (h, s: loaded from the hierarchical cache's tiers; 0 without it).
    cached_tokens_details: dict[str, int] | None = None
    logprobs: list[float] | None = None
    # With logprob_start_len = k: log p(prompt[j] | prompt[:j]) for j in [k, prompt_tokens).
    prompt_logprobs: list[float] | None = None
    # With top_logprobs = n: per output token, the n most likely (ids, logprobs), descending.
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # With logprob_start_len and top_logprobs: the same for each position of prompt_logprobs.
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # Speculative decoding (SGLang's meta_info names): forwards that verified a draft of the
    # request, the draft tokens they verified and how many of those it accepted (every
    # verification also emits one token of its own).
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # An embedding request's (``embed``): its prompt's pooled final hidden state, float32 values.
    embedding: list[float] | None = None


class _Msg(msgspec.Struct, tag_field="type", kw_only=True):
    pass


# ------------------------------------------------------- client → server


class Hello(_Msg, tag="hello"):
    version: int
    req_id: str = ""
    api_key: str | None = None  # required when the server has --api-key


class GenerateRequest(_Msg, tag="generate"):
    """Exactly one of ``prompt``, ``input_ids``, ``messages``."""

    req_id: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    logprob_start_len: int | None = None  # score the prompt from this token on
    api_key: str | None = None  # required when the server has --api-key
    # Requests with the same key go to one data-parallel replica while any is in flight
    # (a program's forks, a batch sharing a prefix).
    routing_key: str | None = None
    # An embedding request: no tokens, the output's ``embedding`` (the server's
    # ``embedding_pooling``); its sampling_params count for cache_salt only.
    embed: bool = False


class AbortRequest(_Msg, tag="abort"):
    req_id: str
    target: str  # the req_id of the generate request to abort
    api_key: str | None = None  # required when the server has --api-key


class ControlRequest(_Msg, tag="control"):
    """``kind``: "server_info" | "flush_cache" | "health" | "kv_snapshot" (the tree of
    ``replica`` as a ``KVSnapshot``, in ``data["snapshot"]``)."""

    req_id: str
    kind: str
    api_key: str | None = None  # required when the server has --api-key
    replica: int = 0  # kv_snapshot: which data-parallel replica


# ------------------------------------------------------- server → client


class HelloReply(_Msg, tag="hello_reply"):
    req_id: str
    version: int
    info: dict[str, Any]


class StreamChunk(_Msg, tag="chunk"):
    """A streamed delta; the last one of a request has ``finish_reason`` set."""

    req_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] | None = None  # as GenerateOutput's
    # One (ids, logprobs) per token of token_ids, descending.
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    spec_verify_ct: int = 0  # the speculative counters so far, as GenerateOutput's
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class GenerateReply(_Msg, tag="result"):
    req_id: str
    output: GenerateOutput


class ReplyBatch(_Msg, tag="batch"):
    """Several replies to one client from one scheduler step, in one frame."""

    items: list[StreamChunk | GenerateReply]
    req_id: str = ""


class ControlReply(_Msg, tag="control_reply"):
    req_id: str
    data: dict[str, Any]


class Ping(_Msg, tag="ping"):
    """Server → client probe (clients ignore it): a send to a vanished client fails."""

    req_id: str = ""


class ErrorReply(_Msg, tag="error"):
    req_id: str
    code: str
    message: str


# ---------------------------------------------- between server processes


class TokenizedRequest(_Msg, tag="tokenized"):
    """TokenizerManager → Scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    logprob_start_len: int | None = None
    stream: bool = True  # False: the scheduler sends the output once, when it finishes
    embed: bool = False  # an embedding request (max_new_tokens 0), pooled by embedding_pooling
    sent_at: float = 0.0  # time.monotonic() when the front sent it (0: not given)


class AbortRid(_Msg, tag="abort_rid"):
    """TokenizerManager → Scheduler."""

    rid: str


class TokenDelta(msgspec.Struct, kw_only=True):
    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_below: tuple[int, int] = (0, 0)  # of cached_tokens, loaded from the (host, storage) tier
    stop: list[str] | None = None  # set on a request's first delta
    # The request's SamplingParams.skip_special_tokens; False: special tokens are text, but
    # for the stop token that ended the request (``ends_on_stop_token``, on the final delta).
    skip_special_tokens: bool = True
    ends_on_stop_token: bool = False
    prompt_logprobs: list[float] | None = None  # on the first delta of a scoring request
    # One (ids, logprobs) per token of token_ids, descending.
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None  # like prompt_logprobs
    first_token_at: float = 0.0  # on the first delta: time.monotonic() of the first token (0: none)
    # The request's speculative counters so far (as GenerateOutput's).
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None  # on an embedding request's final delta


class BatchTokenOut(_Msg, tag="batch_tokens"):
    """Scheduler → Detokenizer: the new tokens of one step."""

    items: list[TokenDelta]
    replica: int = 0


class TextDelta(msgspec.Struct, kw_only=True):
    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_below: tuple[int, int] = (0, 0)  # as TokenDelta's
    prompt_logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None
    first_token_at: float = 0.0
    spec_verify_ct: int = 0  # the speculative counters, as TokenDelta's
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None  # as TokenDelta's


class BatchTextOut(_Msg, tag="batch_text"):
    """Detokenizer → TokenizerManager."""

    items: list[TextDelta]


class RidError(_Msg, tag="rid_error"):
    """Scheduler → (Detokenizer) → TokenizerManager: request ``rid`` was refused."""

    rid: str
    code: str
    message: str


class SchedulerReady(_Msg, tag="scheduler_ready"):
    """Scheduler → (Detokenizer) → TokenizerManager, first message: model limits."""

    info: dict[str, Any]
    replica: int = 0


class ProcessReady(_Msg, tag="ready"):
    """Child → launcher."""

    role: str
    pid: int
    info: dict[str, Any] = {}


class Drained(_Msg, tag="drained"):
    """TokenizerManager → launcher: the SIGTERM drain is over (``aborted``: requests cut off)."""

    aborted: int = 0


class ProcessFailed(_Msg, tag="failed"):
    """Child → launcher, when start-up fails."""

    role: str
    pid: int
    error: str


class ReplicaDown(_Msg, tag="replica_down"):
    """Launcher → Detokenizer → TokenizerManager: a replica's scheduler process exited; its
    requests fail, and it leaves the routing until a restarted one reports ready."""

    replica: int
    exitcode: int | None = None
    restarting: bool = False


# ----------------------------------------------------------- KV events
# A scheduler replica's radix tree, as a stream of changes (radixrt.cache.mirror
# rebuilds it). Node ids are the replica tree's own; the root is node 0. With
# page_size > 1 every token run below is a whole number of pages.


class _KVEvent(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    pass


class KVStored(_KVEvent, tag="stored"):
    """A new node ``node`` under ``parent`` holding ``token_ids`` (a namespace node: no tokens,
    ``cache_salt`` set, parent the root). With page_size > 1, whole pages."""

    node: int
    parent: int
    token_ids: list[int]
    cache_salt: str | None = None
    window_dropped: bool = False  # a snapshot's tombstone: as if followed by KVWindow(held=False)


class KVSplit(_KVEvent, tag="split"):
    """``node``'s edge split after ``at`` tokens (whole pages): the first ``at`` become new node
    ``upper``, child of ``node``'s old parent and parent of ``node``."""

    node: int
    upper: int
    at: int


class KVRemoved(_KVEvent, tag="removed"):
    """Nodes evicted, in order, each a leaf when removed (a namespace right after its last
    child)."""

    nodes: list[int]


class KVWindow(_KVEvent, tag="window"):
    """A model with sliding-window layers: the sliding layers' KV of these nodes' tokens was
    dropped (``held`` False: the nodes are tombstones, their full KV stays) or is held again.
    A prefix is a hit only where its last ``window`` tokens are held (``SWARadixCache``)."""

    nodes: list[int]
    held: bool


class KVCleared(_KVEvent, tag="cleared"):
    """The whole tree emptied (reset / flush_cache); node ids restart (the root stays 0)."""


KVEvent = KVStored | KVSplit | KVRemoved | KVWindow | KVCleared


class KVEventBatch(_Msg, tag="kv_events"):
    """Scheduler replica → subscribers: the events of one scheduler step, in order.

    ``seq`` is 1, 2, 3, ... per publisher process; a subscriber that sees a gap resyncs from a
    ``KVSnapshot``. With ``page_size`` > 1 every token run is whole pages.
    """

    replica: int
    seq: int
    events: list[KVEvent]
    page_size: int = 1
    window: int = 0  # the sliding window whose KV a hit needs (0: no sliding-window layers)


class KVSnapshot(_Msg, tag="kv_snapshot"):
    """The whole tree as KVStored events, parents before children, consistent with batch ``seq``
    (every batch <= seq applied, none after). With ``page_size`` > 1 every run is whole pages."""

    replica: int
    seq: int
    events: list[KVStored]
    page_size: int = 1
    window: int = 0


Message = (
    Hello
    | GenerateRequest
    | AbortRequest
    | ControlRequest
    | HelloReply
    | StreamChunk
    | GenerateReply
    | ReplyBatch
    | ControlReply
    | Ping
    | ErrorReply
    | TokenizedRequest
    | AbortRid
    | BatchTokenOut
    | BatchTextOut
    | RidError
    | SchedulerReady
    | ProcessReady
    | Drained
    | ProcessFailed
    | ReplicaDown
    | KVEventBatch
    | KVSnapshot
)
MESSAGE_TAGS = frozenset(t.__struct_config__.tag for t in Message.__args__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raise ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on bad input."""
    return _decoder.decode(data)


def classify_bad_frame(data: bytes) -> tuple[str, str, str]:
    """(req_id, code, message) for a frame ``decode`` rejected."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as e:
        return "", ErrorCode.MALFORMED, f"not msgpack: {e}"
    except RecursionError:
        return "", ErrorCode.MALFORMED, "msgpack nested too deeply"
    req_id = raw.get("req_id", "") if isinstance(raw, dict) else ""
    req_id = req_id if isinstance(req_id, str) else ""
    tag = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or "type" not in raw:
        return req_id, ErrorCode.MALFORMED, "a message is a map with a 'type' field"
    if tag not in MESSAGE_TAGS:
        return req_id, ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {tag!r}"
    try:
        decode(data)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        return req_id, ErrorCode.INVALID_REQUEST, str(e)
    except RecursionError:
        return req_id, ErrorCode.MALFORMED, "msgpack nested too deeply"
    return req_id, ErrorCode.MALFORMED, "undecodable message"
