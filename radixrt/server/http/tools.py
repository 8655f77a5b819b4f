"""Tool calling in ``/v1/chat/completions``: what a request's tools change, in and out.

``chat_tools(body, server)`` reads a request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` into ``ChatTools``:

- ``template_tools``: the tools for ``apply_chat_template(tools=...)``, given with every
  tool_choice, ``none`` included (as vLLM does).
- ``constraint``: the SamplingParams constraint (an xgrammar structural tag built from the
  tools' schemas, in the ``--tool-call-parser`` format) that makes the output: for
  ``required``, calls and nothing else (one without ``parallel_tool_calls``); for a named
  function, one call of it; for ``auto``, free text in which a call, once its opening is
  written, keeps to its tool's schema (a triggered tag). None for ``none`` and no tools, and
  for ``auto`` with a ``response_format`` (or ``regex``, ``ebnf``): the request's own applies
  and its output is still read for calls.
- ``output``: how the text is read back. ``ToolOutput`` parses calls (``message`` for a whole
  text, ``stream()`` per streamed choice): ``message.tool_calls`` with ids ``call_<hex>``,
  ``content`` the text outside them (None when only whitespace), ``finish_reason``
  ``tool_calls`` when calls were read and the model stopped. ``PlainOutput`` passes the text
  through (``none``, no tools). Both take the content another stage (a reasoning parser) has
  already split off.

Refused with a 400 naming the field: the legacy ``functions`` and ``function_call`` (use
``tools`` and ``tool_choice``); a tool that is not ``{"type": "function", "function":
{"name", "parameters"}}`` with an OpenAI function name and a JSON Schema of an object (checked
by xgrammar, which enforces it); a tool_choice of an unknown shape, or naming a function not
among the tools; ``auto`` without ``--enable-auto-tool-choice`` (vLLM's rule and message),
``required`` and named without ``--tool-call-parser``; a ``response_format``, ``regex`` or
``ebnf`` next to ``required`` or a named function (both would constrain the output).

``ResponsesToolCalls(server)`` gives ``/v1/responses`` the same checks, grammar and parsing.

``template_messages`` turns the request's messages into the template's: an assistant message's
``tool_calls`` with their arguments parsed into objects (as Hugging Face templates expect),
a ``tool`` message with its ``tool_call_id`` (required).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

from radixrt import grammar
from radixrt.config import ServerConfig
from radixrt.protocol import ErrorCode
from radixrt.server.http import schemas as api
from radixrt.server.http.responses_output import FunctionCall
from radixrt.server.http.tool_parsers import FORMATS, CallFormat, ToolCallStream, parse

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
AUTO_NEEDS_FLAGS += "to be set"


def _bad(message: str, param: str) -> api.ApiError:
    return api.ApiError(400, message, ErrorCode.INVALID_REQUEST, param)


class Choice(NamedTuple):
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function's


class ChatTools(NamedTuple):
    template_tools: list[dict] | None
    constraint: dict[str, Any] | None  # SamplingParams fields; None: the request's own
    output: ToolOutput | PlainOutput


def chat_tools(body: api.ChatCompletionRequest, server: ServerConfig) -> ChatTools:
    """What a chat request's tools change (ApiError 400 for what is refused)."""
    tools = read_tools(body)
    choice = read_choice(body, tools)
    if not tools:
        return ChatTools(None, None, PlainOutput())
    if choice.mode == "none":
        return ChatTools(tools, None, PlainOutput())
    fmt = call_format(choice, server)
    if own_constraint(body, choice):
        return ChatTools(tools, None, ToolOutput(fmt))
    tag = structural_tag(fmt, tools, choice, body.parallel_tool_calls is not False)
    return ChatTools(tools, {"structural_tag": tag}, ToolOutput(fmt))


# ------------------------------------------------------------------------ the request


def read_tools(body: api.ChatCompletionRequest) -> list[dict]:
    """The request's tools, each checked."""
    for legacy, now in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, legacy) is not None:
            raise _bad(f"the legacy {legacy} is not supported: use {now}", legacy)
    names: set[str] = set()
    for i, tool in enumerate(body.tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"{where}: a tool is {{'type': 'function', 'function': {{...}}}}", "tools")
        check_function(tool.get("function"), f"{where}.function", names)
    return list(body.tools or ())


def check_function(fn: Any, where: str, names: set[str]) -> None:
    """400 unless ``fn`` has a new OpenAI function name and, if any, parameters that are a
    JSON Schema of an object."""
    if not isinstance(fn, dict):
        raise _bad(f"{where} must be an object with a name and parameters", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise _bad(
            f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
            "tools",
        )
    if name in names:
        raise _bad(f"{where}.name: the function {name!r} is given twice", "tools")
    names.add(name)
    schema = fn.get("parameters")
    if schema is None:
        return
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise _bad(f"{where}.parameters must be a JSON Schema of an object", "tools")
    try:
        grammar.check(grammar.Constraint("json_schema", json.dumps(schema, sort_keys=True)))
    except grammar.GrammarError as e:
        raise _bad(f"{where}.parameters is not a valid JSON Schema: {e}", "tools") from None


def read_choice(body: api.ChatCompletionRequest, tools: list[dict]) -> Choice:
    choice = body.tool_choice
    if choice is None:
        return Choice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise _bad(
                f"tool_choice must be one of {CHOICES} or {{'type': 'function', 'function': "
                f"{{'name': ...}}}}, got {choice!r}",
                "tool_choice",
            )
        if choice == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools", "tool_choice")
        return Choice(choice)
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad(
            "tool_choice must name a function as {'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {choice!r}",
            "tool_choice",
        )
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        given = ", ".join(map(repr, known)) or "none"
        raise _bad(
            f"tool_choice names the function {name!r}, which is not among the tools ({given})",
            "tool_choice",
        )
    return Choice("named", name)


def call_format(choice: Choice, server: ServerConfig) -> CallFormat:
    """The server's tool-call format, which a tool_choice other than none needs."""
    if choice.mode == "auto" and not server.enable_auto_tool_choice:
        raise _bad(AUTO_NEEDS_FLAGS, "tool_choice")
    if server.tool_call_parser is None:
        what = choice.name if choice.mode == "named" else choice.mode
        raise _bad(
            f"tool_choice {what!r} needs the server launched with --tool-call-parser (the "
            "format tool calls are written and read in)",
            "tool_choice",
        )
    return FORMATS[server.tool_call_parser]


def own_constraint(body: api.ChatCompletionRequest, choice: Choice) -> bool:
    """Whether the request constrains its output itself (``auto`` only: a forced call would
    be constrained twice)."""
    for name in ("response_format", "regex", "ebnf"):
        value = getattr(body, name)
        if value is None or name == "response_format" and value.type == "text":
            continue
        if choice.mode == "auto":
            return True
        raise _bad(
            f"{name} cannot be combined with tool_choice {choice.name or choice.mode!r}: both "
            "constrain the output (with tool_choice 'auto' or 'none', the request's "
            f"{name} applies)",
            name,
        )
    return False


def template_messages(
    messages: list[api.ChatMessage], text_of: Callable[[Any, int], str]
) -> list[dict]:
    """The messages as the chat template takes them (``text_of(content, i)``: a message's
    text)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": text_of(m.content, i),
        }
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
            msg["tool_calls"] = [
                template_call(c, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if not m.tool_call_id:
                raise _bad(
                    f"messages[{i}]: a tool message needs tool_call_id (the id of the call it "
                    "answers)",
                    "messages",
                )
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def template_call(call: dict, where: str) -> dict:
    """An assistant message's tool call for the template: its arguments an object."""
    fn = call.get("function")
    if call.get("type", "function") != "function" or not (
        isinstance(fn, dict) and isinstance(fn.get("name"), str)
    ):
        raise _bad(
            f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
            "'arguments': ...}}}}",
            "messages",
        )
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _bad(
            f"{where}.function.arguments must be a JSON object, got {args!r:.80}", "messages"
        )
    out = {"type": "function", "function": {"name": fn["name"], "arguments": parsed}}
    if "id" in call:
        out["id"] = call["id"]
    return out


# ------------------------------------------------------------------------ the grammar


def structural_tag(fmt: CallFormat, tools: list[dict], choice: Choice, parallel: bool) -> dict:
    """xgrammar's structural tag for ``choice`` over ``tools``, calls written as ``fmt``
    writes them."""
    functions = [t["function"] for t in tools]
    if choice.mode == "named":
        functions = [f for f in functions if f["name"] == choice.name]
    tags = [call_tag(fmt, f) for f in functions]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.joiner,
        "at_least_one": True,
        "stop_after_first": choice.mode == "named" or not parallel,
    }
    if choice.mode != "auto":
        if fmt.block_begin:
            elements = [_const(fmt.block_begin), calls, _const(fmt.block_end)]
            calls = {"type": "sequence", "elements": elements}
        return {"type": "structural_tag", "format": calls}
    if fmt.block_begin:  # the trigger opens one block of calls
        block = {"type": "tag", "begin": fmt.block_begin, "content": calls, "end": fmt.block_end}
        triggered = {"tags": [block], "stop_after_first": True}
    else:
        triggered = {"tags": tags, "stop_after_first": not parallel}
    fmt_ = {"type": "triggered_tags", "triggers": [fmt.trigger], **triggered}
    return {"type": "structural_tag", "format": fmt_}


def call_tag(fmt: CallFormat, fn: dict) -> dict:
    schema = {**(fn.get("parameters") or {}), "type": "object"}
    content = {
        "type": "json_schema",
        "json_schema": schema,
        "max_whitespace_cnt": grammar.MAX_WHITESPACE,
    }
    begin = fmt.call_begin(fn["name"])
    return {"type": "tag", "begin": begin, "content": content, "end": fmt.call_end}


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


# ------------------------------------------------------------------------ the answer


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class PlainOutput:
    """A choice's text as it is: no tools, or tool_choice none."""

    @staticmethod
    def reads_special(special: tuple[str, ...]) -> bool:
        return False

    @staticmethod
    def message(text: str, finish_reason: str) -> tuple[api.AssistantMessage, str]:
        return api.AssistantMessage(text), finish_reason

    @staticmethod
    def stream() -> PlainStream:
        return PlainStream()


class PlainStream:
    @staticmethod
    def step(text: str, finish_reason: str | None) -> tuple[str, list, str | None]:
        return text, [], finish_reason


class ToolOutput:
    """A choice's text read for tool calls in one format."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt

    def reads_special(self, special: tuple[str, ...]) -> bool:
        """Whether a marker of the format is one of the tokenizer's special tokens (``special``):
        then the text must keep special tokens for the parser to see it."""
        return any(m in special for m in (*self.fmt.markers, self.fmt.trigger))

    def message(self, text: str, finish_reason: str) -> tuple[api.AssistantMessage, str]:
        """The assistant message of a whole text, and its finish reason."""
        parsed = parse(self.fmt, text)
        calls = [
            api.ToolCall(new_call_id(), api.FunctionCall(c.name, c.arguments)) for c in parsed.calls
        ]
        content = parsed.content if parsed.content.strip() else None
        reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        return api.AssistantMessage(content, tool_calls=calls or None), reason

    def stream(self) -> ToolStream:
        return ToolStream(self.fmt)


class ToolStream:
    """One streamed choice read for tool calls: ``step(text, finish_reason)`` returns the
    content, the ``ToolCallDelta``s and the finish reason to send. Content that is only
    whitespace so far is held (and dropped if nothing else comes), as ``ToolOutput.message``
    drops it."""

    def __init__(self, fmt: CallFormat) -> None:
        self.parser = ToolCallStream(fmt)
        self.held: str | None = ""  # whitespace held back; None once content has gone out
        self.called = False

    def step(
        self, text: str, finish_reason: str | None
    ) -> tuple[str, list[api.ToolCallDelta], str | None]:
        deltas = self.parser.feed(text, final=finish_reason is not None)
        calls = []
        for d in deltas.calls:
            if d.name is not None:
                self.called = True
                fn = api.FunctionCallDelta(d.name, d.arguments)
                calls.append(api.ToolCallDelta(d.index, new_call_id(), "function", fn))
            else:
                fn = api.FunctionCallDelta(arguments=d.arguments)
                calls.append(api.ToolCallDelta(d.index, function=fn))
        if self.called and finish_reason == "stop":
            finish_reason = "tool_calls"
        return self._content(deltas.content), calls, finish_reason

    def _content(self, text: str) -> str:
        if self.held is None:
            return text
        self.held += text
        if not self.held.strip():
            return ""
        text, self.held = self.held, None
        return text


class ResponsesToolCalls:
    """Tool calling for ``/v1/responses`` (``responses_api.ToolCalls``): the same checks,
    grammar and format as chat completions, over the tools and tool_choice in the Chat
    Completions shapes."""

    def __init__(self, server: ServerConfig) -> None:
        self.server = server

    def constraint(
        self, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
    ) -> dict[str, Any]:
        body = api.ChatCompletionRequest(
            messages=[],
            tools=tools or None,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
        )
        return chat_tools(body, self.server).constraint or {}

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[FunctionCall]]:
        if self.server.tool_call_parser is None or not tools:
            return text, []
        parsed = parse(FORMATS[self.server.tool_call_parser], text)
        return parsed.content, [FunctionCall(c.name, c.arguments) for c in parsed.calls]
