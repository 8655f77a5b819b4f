"""A chat request's tools (``radixrt.server.http.tools``) without a server: what is refused,
the grammar each tool_choice gets in each format (checked with xgrammar on strings), and how an
answer is read back, whole and streamed."""

from __future__ import annotations

import json

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from radixrt.config import ServerConfig
from radixrt.server.http import schemas as api
from radixrt.server.http.openai_api import OpenAIApi
from radixrt.server.http.tool_parsers import FORMATS, HERMES
from radixrt.server.http.tools import (
    PlainOutput,
    ToolOutput,
    chat_tools,
    template_messages,
)

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NEG = {
    "type": "function",
    "function": {
        "name": "neg",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
TOOLS = [ADD, NEG]
ASK = [{"role": "user", "content": "2 + 3?"}]
FULL = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)


def request(**fields) -> api.ChatCompletionRequest:
    body = {"messages": ASK, "tools": TOOLS, **fields}
    return api.decode_body(json.dumps(body).encode(), api.ChatCompletionRequest)


def refused(server: ServerConfig = FULL, **fields) -> api.ApiError:
    with pytest.raises(api.ApiError) as e:
        chat_tools(request(**fields), server)
    assert e.value.status == 400
    return e.value


def grammar_of(parser: str, **fields) -> Grammar:
    server = ServerConfig(tool_call_parser=parser, enable_auto_tool_choice=True)
    tools = chat_tools(request(**fields), server)
    return Grammar.from_structural_tag(json.dumps(tools.constraint["structural_tag"]))


def written(parser: str, calls: list[tuple[str, str]]) -> str:
    fmt = FORMATS[parser]
    body = fmt.joiner.join(fmt.call_begin(n) + a + fmt.call_end for n, a in calls)
    return fmt.block_begin + body + fmt.block_end


# ----------------------------------------------------------------------- refusals


def test_auto_needs_the_flag_as_vllm_says() -> None:
    for server in (ServerConfig(), ServerConfig(tool_call_parser="hermes")):
        for fields in ({}, {"tool_choice": "auto"}):  # auto: the default with tools
            err = refused(server, **fields)
            assert err.param == "tool_choice"
            assert "--enable-auto-tool-choice and --tool-call-parser" in err.message


def test_forced_calls_need_a_parser() -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        err = refused(ServerConfig(), tool_choice=choice)
        assert err.param == "tool_choice" and "--tool-call-parser" in err.message


def test_none_needs_nothing_and_shows_the_tools() -> None:
    tools = chat_tools(request(tool_choice="none"), ServerConfig())
    assert tools.template_tools == TOOLS and tools.constraint is None
    assert isinstance(tools.output, PlainOutput)
    no_tools = chat_tools(request(tools=None), ServerConfig())
    assert no_tools.template_tools is None and isinstance(no_tools.output, PlainOutput)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "a b"),
        ({"tools": [ADD, ADD]}, "tools", "twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools",
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f",
                                                        "parameters": {"type": "string"}}}]},
            "tools",
            "of an object",
        ),
        (
            {"tools": [ADD, {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
            "tools",
            'tools[1].function.parameters is not a valid JSON Schema: invalid JSON schema: '
            'Unsupported type "strin"',
        ),
        ({"tool_choice": "always"}, "tool_choice", "'always'"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "must name a function"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
            "'mul', which is not among the tools ('add', 'neg')",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "regex": "x"}, "regex", "'required'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "add"}},
             "response_format": {"type": "json_object"}},
            "response_format",
            "'add'",
        ),
        ({"tools": None, "functions": [ADD["function"]]}, "functions", "use tools"),
        ({"function_call": "auto"}, "function_call", "use tool_choice"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(fields, param, words) -> None:
    err = refused(**fields)
    assert err.param == param and words in err.message, err.message


def test_auto_with_its_own_response_format_keeps_it_and_reads_calls() -> None:
    tools = chat_tools(request(response_format={"type": "json_object"}), FULL)
    assert tools.constraint is None and isinstance(tools.output, ToolOutput)
    text = chat_tools(request(response_format={"type": "text"}), FULL)
    assert "structural_tag" in text.constraint


# ------------------------------------------------------------------------ grammars


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_required_is_calls_and_nothing_else(parser: str) -> None:
    one = [("add", '{"a": 1, "b": 2}')]
    two = [*one, ("neg", '{"x": -4}')]
    g = grammar_of(parser, tool_choice="required")
    assert accepts(g, written(parser, one)) and accepts(g, written(parser, two))
    assert not accepts(g, "Sure. " + written(parser, one))
    assert not accepts(g, written(parser, [("add", '{"a": 1}')]))  # b is required
    assert not accepts(g, written(parser, [("add", '{"a": 1, "b": "2"}')]))
    assert not accepts(g, written(parser, [("mul", '{"a": 1, "b": 2}')]))
    single = grammar_of(parser, tool_choice="required", parallel_tool_calls=False)
    assert accepts(single, written(parser, one)) and not accepts(single, written(parser, two))


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_a_named_function_is_one_call_of_it(parser: str) -> None:
    g = grammar_of(parser, tool_choice={"type": "function", "function": {"name": "neg"}})
    assert accepts(g, written(parser, [("neg", '{"x": 7}')]))
    assert not accepts(g, written(parser, [("add", '{"a": 1, "b": 2}')]))
    assert not accepts(g, written(parser, [("neg", '{"x": 7}'), ("neg", '{"x": 8}')]))


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_auto_is_free_text_until_a_call_opens(parser: str) -> None:
    g = grammar_of(parser, tool_choice="auto")
    call = written(parser, [("add", '{"a": 1, "b": 2}')])
    assert accepts(g, "Just text, no call.")
    assert accepts(g, "Let me add. " + call)
    assert not accepts(g, "Let me add. " + written(parser, [("add", '{"a": 1}')]))
    assert not accepts(g, "Let me add. " + written(parser, [("mul", "{}")]))


# ----------------------------------------------------------------------- answers


def test_a_whole_answer() -> None:
    out = ToolOutput(HERMES)
    text = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    message, reason = out.message(text, "stop")
    assert message.content is None and reason == "tool_calls"
    [call] = message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 1, "b": 2}')
    message, reason = out.message("Hi " + text, "length")
    assert message.content == "Hi \n\n" and reason == "length"
    message, reason = out.message("no call", "stop")
    assert message.content == "no call" and message.tool_calls is None and reason == "stop"
    assert PlainOutput().message(text, "stop") == (api.AssistantMessage(text), "stop")


def test_a_streamed_answer_holds_whitespace_and_names_each_call_once() -> None:
    stream = ToolOutput(HERMES).stream()
    assert stream.step("\n ", None) == ("", [], None)
    text, calls, _ = stream.step('<tool_call>{"name": "add", "arguments": {"a"', None)
    assert text == "" and len(calls) == 1
    first = calls[0]
    assert first.id.startswith("call_") and first.type == "function"
    assert (first.index, first.function.name, first.function.arguments) == (0, "add", '{"a"')
    text, calls, reason = stream.step(": 1}}</tool_call>\n", "stop")
    assert text == "" and reason == "tool_calls"
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in calls] == [
        (0, None, None, ": 1}")
    ]
    words = ToolOutput(HERMES).stream()
    assert words.step("\n", None)[0] == "" and words.step("Hi", "stop") == ("\nHi", [], "stop")


def test_messages_for_the_template() -> None:
    body = request(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "2 + 3?", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ]
    )

    text_of = OpenAIApi.message_text
    assert template_messages(body.messages, text_of) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    ]  # fmt: skip
    for bad, words in [
        ({"role": "tool", "content": "5"}, "messages[0]: a tool message needs tool_call_id"),
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
            "only assistant messages carry tool_calls",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].tool_calls[0].function.arguments must be a JSON object",
        ),
        ({"role": "assistant", "tool_calls": [{"type": "code"}]}, "messages[0].tool_calls[0]"),
    ]:
        with pytest.raises(api.ApiError) as e:
            template_messages(request(messages=[bad]).messages, text_of)
        assert words in e.value.message and e.value.param == "messages"


def test_a_format_whose_markers_are_special_tokens_keeps_them_as_text():
    from radixrt.server.http.tool_parsers import FORMATS
    from radixrt.server.http.tools import PlainOutput, ToolOutput

    assert ToolOutput(FORMATS["mistral"]).reads_special(["</s>", "[TOOL_CALLS]"])
    assert ToolOutput(FORMATS["llama3"]).reads_special(["<|eot_id|>", "<|python_tag|>"])
    assert not ToolOutput(FORMATS["hermes"]).reads_special(["<|im_end|>", "<|endoftext|>"])
    assert not PlainOutput().reads_special(["[TOOL_CALLS]"])
