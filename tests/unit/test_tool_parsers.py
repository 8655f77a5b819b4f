"""The tool-call parsers (``radixrt.server.http.tool_parsers``): each format read whole, and
streamed at every split of its text to the same content and calls; malformed calls stay
content."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.config import TOOL_CALL_PARSERS
from radixrt.server.http.tool_parsers import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    CallFormat,
    ParsedText,
    ToolCall,
    ToolCallStream,
    parse,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"s": "a}b\\"{[", "n": [1, {"x": null}], "u": "caf\\u00e9 \u00e9"}'

# (format, text, content, calls)
CASES = [
    (HERMES, "Hello there.", "Hello there.", []),
    (HERMES, "a < b and <tool but not a call", "a < b and <tool but not a call", []),
    (
        HERMES,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        "",
        [ToolCall("get_weather", WEATHER)],
    ),
    (
        HERMES,
        f'Let me check.\n<tool_call>{{"name": "a", "arguments": {TRICKY}}}</tool_call>\n'
        '<tool_call> {"name":"b","parameters":{}} </tool_call> Done.',
        "Let me check.\n\n Done.",
        [ToolCall("a", TRICKY), ToolCall("b", "{}")],
    ),
    (  # another key order: the arguments re-serialised
        HERMES,
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
        "",
        [ToolCall("f", '{"x": 1}')],
    ),
    (  # no closing tag at the end
        HERMES,
        'ok <tool_call>{"name": "f", "arguments": {"x": [1, 2]}}',
        "ok ",
        [ToolCall("f", '{"x": [1, 2]}')],
    ),
    (  # malformed first, then a call
        HERMES,
        '<tool_call>not json</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>',
        "<tool_call>not json</tool_call>",
        [ToolCall("f", "{}")],
    ),
    (HERMES, '<tool_call>{"oops": 1}</tool_call>', '<tool_call>{"oops": 1}</tool_call>', []),
    (
        HERMES,
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "", "arguments": {}}</tool_call>x',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>x',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
        [],
    ),
    (HERMES, "<tool_call>{never closed", "<tool_call>{never closed", []),
    (HERMES, "<tool_call>", "<tool_call>", []),
    (LLAMA3, '{"name": "f", "parameters": {"a": 1}}', "", [ToolCall("f", '{"a": 1}')]),
    (
        LLAMA3,
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}',
        "",
        [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")],
    ),
    (
        LLAMA3,
        'Sure: {"name": "f", "parameters": {}} done',
        "Sure:  done",
        [ToolCall("f", "{}")],
    ),
    (LLAMA3, '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    (LLAMA3, '{"a": 1} {"name"', '{"a": 1} {"name"', []),
    (
        LLAMA3,
        '{"name": "f", "parameters": {}}; garbage',
        "; garbage",
        [ToolCall("f", "{}")],
    ),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
        "",
        [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")],
    ),
    (
        MISTRAL,
        'Calling. [TOOL_CALLS] [ {"name": "f", "arguments": {"a": "]"}} ]\n',
        "Calling. \n",
        [ToolCall("f", '{"a": "]"}')],
    ),
    (
        MISTRAL,
        '[TOOL_CALLS]{"name": "f", "arguments": {}}',
        '[TOOL_CALLS]{"name": "f", "arguments": {}}',
        [],
    ),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, oops]',
        ", oops]",
        [ToolCall("f", "{}")],
    ),
    (MISTRAL, "[TOOL", "[TOOL", []),
]


def streamed(fmt: CallFormat, pieces: list[str]) -> ParsedText:
    """The content and calls a stream reassembles to, checking each call's deltas: its name
    first (once), then its arguments; calls numbered from 0 in order."""
    stream = ToolCallStream(fmt)
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for piece in [*pieces, None]:
        deltas = stream.feed(piece) if piece is not None else stream.finish()
        content.append(deltas.content)
        for d in deltas.calls:
            if d.index not in calls:
                assert d.index == len(calls) and d.name is not None, d
                calls[d.index] = [d.name, ""]
            else:
                assert d.name is None, d
            calls[d.index][1] += d.arguments
    return ParsedText("".join(content), [ToolCall(n, a) for n, a in calls.values()])


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_text(fmt, text, content, calls) -> None:
    assert parse(fmt, text) == ParsedText(content, calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_at_every_split_equals_whole(fmt, text, content, calls) -> None:
    want = ParsedText(content, calls)
    assert streamed(fmt, [text]) == want
    assert streamed(fmt, list(text)) == want  # a character at a time
    for k in range(len(text) + 1):
        assert streamed(fmt, [text[:k], text[k:]]) == want, k
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(fmt, pieces) == want, pieces


def test_the_name_goes_out_before_the_arguments_end() -> None:
    stream = ToolCallStream(HERMES)
    assert stream.feed("Hi <tool_").content == "Hi "  # a possible tag is held
    d = stream.feed('call>{"name": "f", "arguments": {"a": ')
    assert d.content == "" and [(c.index, c.name, c.arguments) for c in d.calls] == [
        (0, "f", '{"a": ')
    ]
    d = stream.feed("1}}</tool_call> bye")
    assert [(c.name, c.arguments) for c in d.calls] == [(None, "1}")]
    assert d.content == " bye"
    assert stream.finish() == ("", [])


def test_a_call_malformed_after_its_name_went_out() -> None:
    """The documented limit: once its name is out a call stays a call in the stream; the whole
    text keeps it content."""
    text = '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'
    assert parse(HERMES, text) == ParsedText(text, [])
    got = streamed(HERMES, [text])
    assert got.calls == [ToolCall("f", '{"a": tru}')]
    cut = '<tool_call>{"name": "f", "arguments": {"a": 1'  # cut short (max_tokens)
    assert parse(HERMES, cut) == ParsedText(cut, [])
    assert streamed(HERMES, [cut]).calls == [ToolCall("f", '{"a": 1')]


def test_every_configured_parser_has_a_format() -> None:
    assert set(FORMATS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_what_the_grammar_writes_parses_back(name: str) -> None:
    fmt = FORMATS[name]
    args = ['{"a": 1}', '{"b": "x"}']
    body = fmt.joiner.join(fmt.call_begin(n) + a + fmt.call_end for n, a in zip(["f", "g"], args))
    text = fmt.block_begin + body + fmt.block_end
    assert text.startswith(fmt.trigger)
    got = parse(fmt, text)
    assert got.calls == [ToolCall("f", args[0]), ToolCall("g", args[1])]
    assert got.content.strip() == ""  # the joiner's whitespace, at most
    assert streamed(fmt, list(text)) == got


FRAGMENTS = [
    *(m for f in (HERMES, LLAMA3, MISTRAL) for m in f.markers),
    "</tool_call>",
    "[",
    "]",
    ",",
    ";",
    " ",
    "\n",
    "hi",
    "{",
    "}",
    '"',
    "<",
    "<tool",
    "[TOOL",
    '{"a": 1}',
    '{"name": "f", "arguments": {"s": "x}"}}',
    '{"name":"g","parameters":{"n":[1,{}]}}',
    '{"arguments": {"k": true}, "name": "h"}',
    '{"name": "f", "arguments": 3}',
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(FORMATS)),
    st.lists(st.sampled_from(FRAGMENTS), max_size=12),
    st.randoms(use_true_random=False),
)
def test_any_mix_of_calls_and_text_streams_as_it_parses(name, fragments, rng) -> None:
    """Texts made of whole calls, markers, separators and stray text: the stream, split
    anywhere, gives what the whole text gives."""
    fmt, text = FORMATS[name], "".join(fragments)
    want = parse(fmt, text)
    assert streamed(fmt, list(text)) == want
    cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(fmt, pieces) == want
