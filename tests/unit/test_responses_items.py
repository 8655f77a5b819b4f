"""The Responses API without a server: input items as chat messages, tools and tool_choice in
the Chat Completions shapes, refusals naming the field, and a turn's answer and stream events
with a tool-call parser plugged in (a fake one) and without one."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixrt.server.http import schemas as api
from radixrt.server.http.jobs import Choice
from radixrt.server.http.response_store import ResponseStore
from radixrt.server.http.responses_api import NoToolCalls, ResponsesApi, Turn
from radixrt.server.http.responses_input import (
    ConversationPrompt,
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_request,
    input_messages,
    text_constraint,
)
from radixrt.server.http.responses_output import EventWriter, FunctionCall, ResponseObject

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def refused(param: str):
    """pytest.raises for a 400 naming ``param``."""

    class Check:
        def __enter__(self):
            self.raises = pytest.raises(api.ApiError)
            self.info = self.raises.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.raises.__exit__(*exc)
            err = self.info.value
            assert (err.status, err.param) == (400, param), (err.status, err.param, err.message)
            return out

    return Check()


def test_input_items_become_chat_messages():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"A"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "oops"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "?"}],
        },
        {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
    ]
    calls = lambda *cs: [  # noqa: E731
        {"id": i, "type": "function", "function": {"name": "weather", "arguments": a}}
        for i, a in cs
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": calls(("c1", {"city": "A"}), ("c2", "oops")),
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": calls(("c3", {}))},
    ]


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        [{"type": "reasoning", "summary": []}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
        [{"role": "user", "content": 3}],
        [{"type": "function_call", "call_id": "c", "name": "f"}],
        [{"type": "function_call_output", "output": "x"}],
    ],
)
def test_bad_input_is_refused_naming_input(value):
    with refused("input"):
        input_messages(value)


def test_tools_in_the_chat_shape():
    tools = chat_tools([WEATHER, {"type": "function", "name": "now"}])
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER["parameters"],
                "description": "The weather in a city",
            },
        },
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
    ]
    assert chat_tool_choice(None, tools) == "auto"
    assert chat_tool_choice("none", tools) == "none"
    assert chat_tool_choice("required", tools) == "required"
    named = chat_tool_choice({"type": "function", "name": "now"}, tools)
    assert named == {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "web_search"},
        {"type": "function"},
        {"type": "function", "name": "f", "parameters": [1]},
        {"type": "function", "name": "f", "colour": "red"},
    ],
)
def test_bad_tools_are_refused_naming_the_tool(tool):
    with refused("tools[1]"):
        chat_tools([WEATHER, tool])


@pytest.mark.parametrize(
    "choice, tools",
    [
        ({"type": "function", "name": "absent"}, [WEATHER]),
        ("required", []),
        ("sometimes", [WEATHER]),
        ({"type": "allowed_tools", "tools": []}, [WEATHER]),
    ],
)
def test_bad_tool_choices_are_refused(choice, tools):
    with refused("tool_choice"):
        chat_tool_choice(choice, chat_tools(tools))


def test_without_a_parser_tools_take_tool_choice_none_only():
    tools = chat_tools([WEATHER])
    assert NoToolCalls().constraint(tools, "none", True) == {}
    assert NoToolCalls().constraint([], "auto", True) == {}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "weather"}}):
        with refused("tool_choice"):
            NoToolCalls().constraint(tools, choice, True)
    assert NoToolCalls().parse("text", tools) == ("text", [])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 65}, "max_output_tokens"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_fields_not_done_are_refused_by_name(fields, param):
    with refused(param):
        check_request(ResponsesRequest(input="x", **fields), max_new_tokens_limit=64)


def test_text_format():
    assert text_constraint(None) == {} == text_constraint({"format": {"type": "text"}})
    schema = {"type": "object"}
    got = text_constraint({"format": {"type": "json_schema", "name": "o", "schema": schema}})
    assert got == {"json_schema": schema}
    for text in ({"format": {"type": "json_schema"}}, {"format": {"type": "yaml"}}, {"x": 1}):
        with refused("text"):
            text_constraint(text)


def test_unknown_and_mistyped_fields_name_the_field():
    with pytest.raises(api.ApiError) as e:
        api.decode_body(b'{"input": "x", "colour": 1}', ResponsesRequest)
    assert e.value.status == 400 and "colour" in e.value.message
    with pytest.raises(api.ApiError) as e:
        api.decode_body(b'{"input": 7}', ResponsesRequest)
    assert e.value.param == "input"


# ------------------------------------------------------- a turn's answer


class FakeParser:
    """Calls written as ``CALL name {json}`` on lines of their own."""

    def constraint(self, tools, tool_choice, parallel_tool_calls):
        return {}

    def parse(self, text, tools):
        lines = text.split("\n")
        calls = [
            FunctionCall(*line[5:].split(" ", 1)) for line in lines if line.startswith("CALL ")
        ]
        return "\n".join(line for line in lines if not line.startswith("CALL ")), calls


def make_turn(store, parses=True, prompt_ids=(5, 6, 7)):
    template = ResponseObject(
        id="resp_1", created_at=0, model="m", status="in_progress", output=[], tools=[WEATHER]
    )
    prompt = ConversationPrompt(list(prompt_ids), "PROMPT", [{"role": "user", "content": "Hi"}])
    tools = chat_tools([WEATHER])
    return Turn(("k", None), prompt, tools, parses, store, template)


def reply(text: str, ids: list[int], finish: str) -> Choice:
    choice = Choice()
    choice.texts, choice.token_ids, choice.finish_reason = [text], ids, finish
    choice.prompt_tokens, choice.cached_tokens = 3, 1
    return choice


def test_a_reply_with_calls_becomes_items_and_is_stored_as_tool_calls():
    store = ResponseStore(4)
    responses = ResponsesApi(None, None, store, FakeParser())
    text = 'Checking.\nCALL weather {"city": "A"}'
    out = responses.finish(make_turn(True), reply(text, [8, 9, 2], "stop"), "msg_1")
    sdk = Response.model_validate(json.loads(api.encode(out)))
    assert sdk.status == "completed" and sdk.output_text == "Checking."
    message, call = sdk.output
    assert message.id == "msg_1" and call.type == "function_call"
    assert (call.name, json.loads(call.arguments)) == ("weather", {"city": "A"})
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert sdk.usage.input_tokens_details.cached_tokens == 1 and sdk.usage.total_tokens == 6
    saved = store.get(("k", None), "resp_1")
    assert list(saved.ids) == [5, 6, 7, 8, 9, 2] and saved.ends_with_stop
    assert saved.output_text == text and saved.prompt_text == "PROMPT"
    assert saved.messages[-1] == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": "weather", "arguments": {"city": "A"}},
            }
        ],
    }


def test_an_unstored_or_cut_reply():
    store = ResponseStore(4)
    responses = ResponsesApi(None, None, store, FakeParser())
    out = responses.finish(make_turn(False, parses=False), reply("CALL x {}", [8], "length"), "m")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in out.output] == ["message"] and out.output[0].status == "incomplete"
    assert out.output[0].content[0].text == "CALL x {}"  # not parsed: no tools in play
    assert len(store) == 0


class OneDeltaJob:
    def __init__(self, choice: Choice) -> None:
        self.choices, self.finished = [choice], True


def stream_events(turn: Turn, choice: Choice, parser) -> list:
    responses = ResponsesApi(None, None, ResponseStore(4), parser)
    delta = type("Delta", (), {"text": choice.text})()

    async def run():
        return [c async for c in responses.stream(OneDeltaJob(choice), (0, delta), turn)]

    chunks = asyncio.run(run())
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for chunk in chunks:
        head, data = chunk.decode().split("\n", 1)
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_reply_that_may_hold_calls_streams_its_items_once_parsed():
    text = 'Checking.\nCALL weather {"city": "A"}'
    events = stream_events(make_turn(True), reply(text, [8, 9], "stop"), FakeParser())
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[4].delta == "Checking." and events[10].arguments == '{"city": "A"}'
    assert events[-1].response.output[1].name == "weather"


def test_a_plain_reply_streams_as_it_comes():
    events = stream_events(make_turn(True, parses=False), reply("Hi", [8], "length"), NoToolCalls())
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0].response.status == "in_progress" and events[-1].response.status == "incomplete"


def test_event_writer_numbers_events():
    writer = EventWriter()
    assert writer("a").startswith(b"event: a\ndata: ") and b'"sequence_number":1' in writer("b")
