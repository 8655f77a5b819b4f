"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

Contract:
- ``create`` answers one turn of a conversation as a Response object
  (``responses_output``), streamed as OpenAI streams it with ``stream``.
  Its prompt is the chat template's rendering of ``instructions`` (a system
  message), the conversation of ``previous_response_id`` (if given) and the
  new ``input`` items, with ``tools`` (``responses_input``).
- With ``store`` (the default) a finished response is kept in the
  ``ResponseStore`` (``--responses-store-size``, least recently used out
  first) under its scope, the request's API key and ``cache_salt``: a next
  turn names it by ``previous_response_id`` and sends only its new items;
  its prompt extends the stored token ids, so the radix tree hits the whole
  conversation. ``GET``/``DELETE`` take the same scope (``?cache_salt=``);
  an id unknown in the scope is a 404 naming it.
- Tool calls: a ``ToolCalls`` object validates the tools against
  ``tool_choice`` (returning the SamplingParams fields that enforce it) and
  splits a reply into its text and its function calls. ``NoToolCalls``, the
  default, renders the tools and takes ``tool_choice`` "none" only. A reply
  that may hold calls is streamed once it is whole (parsed first); any other
  streams its text as it comes.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixrt.sampling import SamplingParams
from radixrt.server.front_api import FrontApi
from radixrt.server.http import schemas as api
from radixrt.server.http.context import HttpContext
from radixrt.server.http.jobs import Choice, Job, Prompt, json_response
from radixrt.server.http.response_store import ResponseStore, Scope, StoredResponse
from radixrt.server.http.responses_input import (
    ConversationPrompt,
    ResponsesRequest,
    bad,
    chat_tool_choice,
    chat_tools,
    check_request,
    conversation_prompt,
    input_messages,
    template_arguments,
    text_constraint,
)
from radixrt.server.http.responses_output import (
    DeletedResponse,
    EventWriter,
    FunctionCall,
    FunctionCallItem,
    OutputMessage,
    ResponseObject,
    finished,
    new_id,
    output_items,
    usage,
)


class ToolCalls(Protocol):
    """Tool calling for the Responses API (tools and tool_choice in the Chat Completions
    shapes: ``responses_input.chat_tools``, ``chat_tool_choice``)."""

    def constraint(
        self, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
    ) -> dict[str, Any]:
        """Validate ``tools`` for ``tool_choice``; the SamplingParams fields that make the
        reply follow it (e.g. ``structural_tag``), or ``{}``; ApiError for what it cannot do."""

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[FunctionCall]]:
        """A whole reply's text outside its tool calls, and the calls."""


class NoToolCalls:
    """No tool-call parser: tools are rendered for the model, and ``tool_choice`` may only be
    "none" (any other choice is refused, never answered with unparsed calls)."""

    def constraint(
        self, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
    ) -> dict[str, Any]:
        if tools and tool_choice != "none":
            raise bad(
                f"tool_choice {tool_choice!r} with tools needs a tool-call parser "
                "(--tool-call-parser); this server takes tool_choice 'none' only",
                "tool_choice",
            )
        return {}

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[FunctionCall]]:
        return text, []


@dataclass(frozen=True, slots=True)
class Turn:
    """One request's turn: its scope, its prompt, what its reply may hold, and the fields of
    its Response (``template``: status in_progress, no output yet)."""

    scope: Scope
    prompt: ConversationPrompt
    tools: list[dict]  # Chat Completions shape
    parses: bool  # the reply may hold tool calls
    store: bool
    template: ResponseObject


class ResponsesApi:
    def __init__(
        self,
        http: HttpContext,
        front: FrontApi,
        store: ResponseStore | None = None,
        tool_calls: ToolCalls | None = None,
    ) -> None:
        self.http, self.front = http, front  # the HTTP plumbing, and the front process
        if store is None:
            store = ResponseStore(front.server.responses_store_size)
        self.store = store
        self.tool_calls = NoToolCalls() if tool_calls is None else tool_calls

    async def create(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, ResponsesRequest)
        self.http.check_model(body.model)
        check_request(body, self.front.server.max_new_tokens_limit)
        turn, params = self.begin(body, key)
        result = await self.http.run_job(
            request,
            key,
            [Prompt(turn.prompt.ids, params)],
            bool(body.stream),
            lambda job, first: self.stream(job, first, turn),
        )
        if body.stream:
            return result
        return json_response(self.finish(turn, result.choices[0], new_id("msg")))

    async def retrieve(self, request: Request, key: str | None) -> Response:
        response_id = request.path_params["response_id"]
        stored = self.store.get(scope_of(request, key), response_id)
        if stored is None:
            raise not_found(response_id, "response_id")
        return json_response(stored.body)

    async def delete(self, request: Request, key: str | None) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(scope_of(request, key), response_id):
            raise not_found(response_id, "response_id")
        return json_response(DeletedResponse(response_id))

    # ------------------------------------------------------------ a turn

    def begin(self, body: ResponsesRequest, key: str | None) -> tuple[Turn, SamplingParams]:
        """The turn of a checked request, and its sampling parameters."""
        messages = input_messages(body.input)
        tools = chat_tools(body.tools)
        choice = chat_tool_choice(body.tool_choice, tools)
        parallel = body.parallel_tool_calls is not False
        fields = {
            **text_constraint(body.text),
            **self.tool_calls.constraint(tools, choice, parallel),
        }
        scope = (key, body.cache_salt)
        prev = self.previous(scope, body.previous_response_id)
        prompt = conversation_prompt(self.front, prev, body.instructions, messages, tools)
        params = self.sampling(body, len(prompt.ids), fields)
        template = ResponseObject(
            id=new_id("resp"),
            created_at=int(time.time()),
            model=body.model or self.http.model_name,
            status="in_progress",
            output=[],
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            temperature=params.temperature,
            top_p=params.top_p,
            tools=body.tools or [],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=parallel,
            metadata=body.metadata or {},
            store=body.store is not False,
            text=body.text or {"format": {"type": "text"}},
            user=body.user,
        )
        parses = bool(tools) and choice != "none"
        return Turn(scope, prompt, tools, parses, template.store, template), params

    def previous(self, scope: Scope, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        stored = self.store.get(scope, response_id)
        if stored is None:
            raise not_found(response_id, "previous_response_id")
        return stored

    def sampling(
        self, body: ResponsesRequest, prompt_len: int, constraint: dict[str, Any]
    ) -> SamplingParams:
        given = body.max_output_tokens is not None
        fields = dict(
            constraint,
            max_new_tokens=body.max_output_tokens
            if given
            else self.http.default_max_tokens(prompt_len),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            cache_salt=body.cache_salt,
        )
        return self.http.make_params(fields, given)

    def finish(self, turn: Turn, choice: Choice, message_id: str) -> ResponseObject:
        """The finished turn's Response, stored when the request asked for it."""
        text = choice.text
        content, calls = self.tool_calls.parse(text, turn.tools) if turn.parses else (text, [])
        response = finished(turn.template, choice.finish_reason)
        item_status = "incomplete" if response.status == "incomplete" else "completed"
        response = msgspec.structs.replace(
            response,
            output=output_items(message_id, content, calls, item_status),
            usage=usage(choice.prompt_tokens, choice.cached_tokens, len(choice.token_ids)),
        )
        if turn.store and response.status != "cancelled":
            stored = StoredResponse(
                id=response.id,
                body=response,
                messages=(*turn.prompt.messages, assistant_message(content, response.output)),
                ids=array("i", [*turn.prompt.ids, *choice.token_ids]),
                prompt_text=turn.prompt.text,
                output_text=text,
                ends_with_stop=choice.finish_reason == "stop",
            )
            self.store.put(turn.scope, stored)
        return response

    async def stream(self, job: Job, first, turn: Turn) -> AsyncIterator[bytes]:
        """The turn's events: its text as it comes, or, when the reply may hold tool calls,
        every item once the reply is whole and parsed."""
        events, message_id, live = EventWriter(), new_id("msg"), not turn.parses
        for chunk in events.opening(turn.template):
            yield chunk
        if live:
            for chunk in events.message_added(0, OutputMessage(message_id, [], "in_progress")):
                yield chunk
        item = first
        try:
            while True:
                text = item[1].text
                if live and text:
                    yield events.text_delta(0, message_id, text)
                if job.finished:
                    break
                item = await job.next()
        except api.ApiError as e:
            yield events.error(e)
            return
        response = self.finish(turn, job.choices[0], message_id)
        for index, out in enumerate(response.output):
            chunks = events.message_done(index, out) if live else events.item_events(index, out)
            for chunk in chunks:
                yield chunk
        yield events.closing(response)


def assistant_message(content: str, output: list[Any]) -> dict:
    """A reply as the chat template's assistant message (its calls as ``tool_calls``)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": template_arguments(item.arguments)},
        }
        for item in output
        if isinstance(item, FunctionCallItem)
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def scope_of(request: Request, key: str | None) -> Scope:
    return key, request.query_params.get("cache_salt")


def not_found(response_id: str, param: str) -> api.ApiError:
    return api.ApiError(
        404,
        f"no stored response {response_id!r} (never stored, deleted, evicted, or stored under "
        "another API key or cache_salt)",
        "not_found",
        param,
    )
