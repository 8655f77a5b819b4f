"""The answer side of ``POST /v1/responses``: the Response object and its stream events.

Contract:
- ``ResponseObject`` has OpenAI's shape (``openai.types.responses.Response``):
  ``id`` ``resp_<hex>``, ``status`` completed or incomplete (with
  ``incomplete_details.reason`` "max_output_tokens"), ``output`` items (a
  ``message`` with one ``output_text`` part, and ``function_call`` items),
  ``usage`` with ``input_tokens_details.cached_tokens`` always present.
- ``EventWriter`` numbers events from 0 (``sequence_number``) and writes each
  as a Server-Sent Event whose ``event`` is its ``type``. A stream is
  ``response.created``, ``response.in_progress``, then per output item
  ``response.output_item.added``, its content events
  (``response.content_part.added``, ``response.output_text.delta``…,
  ``response.output_text.done``, ``response.content_part.done``; or
  ``response.function_call_arguments.delta`` / ``.done``),
  ``response.output_item.done``, and last ``response.completed`` (or
  ``response.incomplete``; ``response.failed`` for a request the server
  stopped).
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any, NamedTuple

import msgspec

from radixrt.server.http import schemas as api

FINISH_STATUS = {"stop": "completed", "length": "incomplete"}  # otherwise: "cancelled"
CLOSING_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class FunctionCall(NamedTuple):
    """A tool call parsed from a reply: the function's name and its arguments (JSON text)."""

    name: str
    arguments: str


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list = msgspec.field(default_factory=list)
    logprobs: list = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str
    role: str = "assistant"
    type: str = "message"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0  # explicit cache writes (OpenAI's prompt_cache_options): none


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[Any]  # OutputMessage and FunctionCallItem
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    store: bool = True
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
    error: None = None
    reasoning: None = None
    object: str = "response"


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        prompt_tokens,
        InputTokensDetails(cached_tokens),
        output_tokens,
        OutputTokensDetails(),
        prompt_tokens + output_tokens,
    )


def output_items(
    message_id: str, content: str, calls: list[FunctionCall], status: str
) -> list[Any]:
    """A reply's output items: its message (when it has text, or no calls), then its calls."""
    items: list[Any] = []
    if content or not calls:
        items.append(OutputMessage(message_id, [OutputText(content)], status))
    for call in calls:
        items.append(FunctionCallItem(new_id("fc"), new_id("call"), call.name, call.arguments))
    return items


def finished(response: ResponseObject, finish_reason: str | None) -> ResponseObject:
    """``response`` with the status a request's ``finish_reason`` gives it."""
    status = FINISH_STATUS.get(finish_reason or "", "cancelled")
    details = IncompleteDetails("max_output_tokens") if status == "incomplete" else None
    return msgspec.structs.replace(response, status=status, incomplete_details=details)


# ------------------------------------------------------------------ events


class EventWriter:
    """Stream events of one response, numbered in order."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return b"event: " + kind.encode() + b"\ndata: " + api.encode(event) + b"\n\n"

    def opening(self, response: ResponseObject) -> list[bytes]:
        return [
            self("response.created", response=response),
            self("response.in_progress", response=response),
        ]

    def message_added(self, index: int, item: OutputMessage) -> list[bytes]:
        opened = msgspec.structs.replace(item, content=[], status="in_progress")
        return [
            self("response.output_item.added", output_index=index, item=opened),
            self(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=OutputText(""),
            ),
        ]

    def text_delta(self, index: int, item_id: str, text: str) -> bytes:
        return self(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def message_done(self, index: int, item: OutputMessage) -> list[bytes]:
        part = item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        return [
            self("response.output_text.done", text=part.text, logprobs=[], **where),
            self("response.content_part.done", part=part, **where),
            self("response.output_item.done", output_index=index, item=item),
        ]

    def call_events(self, index: int, item: FunctionCallItem) -> list[bytes]:
        opened = msgspec.structs.replace(item, arguments="", status="in_progress")
        where = {"item_id": item.id, "output_index": index}
        return [
            self("response.output_item.added", output_index=index, item=opened),
            self("response.function_call_arguments.delta", delta=item.arguments, **where),
            self("response.function_call_arguments.done", arguments=item.arguments, **where),
            self("response.output_item.done", output_index=index, item=item),
        ]

    def item_events(self, index: int, item: Any) -> list[bytes]:
        """Every event of an output item not streamed as it was made."""
        if isinstance(item, FunctionCallItem):
            return self.call_events(index, item)
        chunks = self.message_added(index, item)  # numbered in order: one call after another
        text = item.content[0].text
        if text:
            chunks.append(self.text_delta(index, item.id, text))
        return chunks + self.message_done(index, item)

    def closing(self, response: ResponseObject) -> bytes:
        return self(CLOSING_EVENT.get(response.status, "response.failed"), response=response)

    def error(self, err: api.ApiError) -> bytes:
        return self("error", code=err.code, message=err.message, param=err.param)
