"""Tool-call parsers: the calls a model wrote into its text, read whole or as the text streams.

Formats (``--tool-call-parser``, vLLM's and SGLang's names, ``FORMATS``):

- ``hermes``, ``qwen25``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one call
  per tag, any number of tags, text around them.
- ``llama3``, ``llama3_json``: ``{"name": ..., "parameters": {...}}`` after ``<|python_tag|>``
  or on its own (from ``{"name"`` on), several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Every format reads a call region as ``MARKER ws OPEN ws CALL (ws SEPARATOR ws CALL)* [ws
CLOSE]`` (``CallFormat``); a CALL is a JSON object with a non-empty string ``name`` and an
object ``arguments`` (or ``parameters``), whose text becomes the call's arguments: as written
when the object starts ``{"name": ..., "arguments": {``, else re-serialised. Text outside the
regions is content. A region whose first call is malformed is no region: its marker is content
and what follows the marker is read again as text. After a call, anything but the separator or
CLOSE ends the region and is read again as text.

``parse(fmt, text)`` reads a whole text. ``ToolCallStream(fmt)`` reads it in pieces:
``feed(text, final)`` and ``finish()`` return ``Deltas`` (content, and ``CallDelta``s: a call's name
first, then its arguments in pieces). Text that may still turn out to be a marker or the head
of a call is held until it is known. Fed any split of a text, the stream's content and calls
are ``parse``'s, except for a call that proves malformed after its name has gone out (arguments
that are not valid JSON, an object not closed after them, or cut short at the end): the stream
has sent that call as far as it got, where ``parse`` leaves its text content. Output written
under the grammar of ``radixrt.server.http.tools`` is never malformed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import regex

_WS = " \t\n\r"  # JSON's whitespace
_HEAD = regex.compile(
    r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*(?P<name>"(?:[^"\\\x00-\x1f]|\\.)*")'
    r'[ \t\n\r]*,[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*'
)
_DECODER = json.JSONDecoder()
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model family writes tool calls: the region ``parse`` reads (``markers`` ...
    ``close``), and the text the grammar writes (``trigger`` ... ``block_end``)."""

    markers: tuple[str, ...]  # each opens a region
    trigger: str  # the text that starts calls within free text (the grammar's trigger)
    kept: tuple[str, ...] = ()  # markers that are the first characters of the first call
    open: str = ""  # after the marker, before the first call
    separator: str | None = None  # between the calls of a region; None: one call per region
    close: str = ""  # ends a region; optional in the text
    args_key: str = "arguments"  # the arguments' key the grammar writes (parsing takes either)
    call_prefix: str = ""  # the grammar writes this before each call object ...
    call_suffix: str = ""  # ... and this after it
    joiner: str = ""  # between calls
    block_begin: str = ""  # before the calls (once)
    block_end: str = ""  # after them

    def call_begin(self, name: str) -> str:
        """What the grammar writes before a call's arguments."""
        return f'{self.call_prefix}{{"name": {json.dumps(name)}, "{self.args_key}": '

    @property
    def call_end(self) -> str:
        return "}" + self.call_suffix


HERMES = CallFormat(
    markers=("<tool_call>",),
    trigger="<tool_call>",
    close="</tool_call>",
    call_prefix="<tool_call>\n",
    call_suffix="\n</tool_call>",
    joiner="\n",
)
LLAMA3 = CallFormat(
    markers=("<|python_tag|>", '{"name"'),
    trigger='{"name": ',
    kept=('{"name"',),
    separator=";",
    args_key="parameters",
    joiner="; ",
)
MISTRAL = CallFormat(
    markers=("[TOOL_CALLS]",),
    trigger="[TOOL_CALLS]",
    open="[",
    separator=",",
    close="]",
    joiner=", ",
    block_begin="[TOOL_CALLS][",
    block_end="]",
)
FORMATS = {
    "hermes": HERMES,
    "qwen25": HERMES,
    "llama3": LLAMA3,
    "llama3_json": LLAMA3,
    "mistral": MISTRAL,
}


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object


class ParsedText(NamedTuple):
    content: str
    calls: list[ToolCall]


class CallDelta(NamedTuple):
    """A piece of call ``index``: its name (the first piece only) and more of its arguments."""

    index: int
    name: str | None
    arguments: str


class Deltas(NamedTuple):
    content: str
    calls: list[CallDelta]


# ---------------------------------------------------------------- reading a whole text


def parse(fmt: CallFormat, text: str) -> ParsedText:
    """The content and the calls of a whole text."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (hit := _find_marker(fmt, text, pos)) is not None:
        at, marker = hit
        content.append(text[pos:at])
        got, end = _region(fmt, text, at, marker)
        if got:
            calls += got
            pos = end
        else:
            content.append(marker)
            pos = at + len(marker)
    content.append(text[pos:])
    return ParsedText("".join(content), calls)


def _region(fmt: CallFormat, text: str, at: int, marker: str) -> tuple[list[ToolCall], int]:
    """The calls of the region whose marker is at ``at``, and where the region ends."""
    i = _skip_ws(text, at if marker in fmt.kept else at + len(marker))
    if fmt.open:
        if not text.startswith(fmt.open, i):
            return [], at
        i = _skip_ws(text, i + len(fmt.open))
    calls, end = [], at
    while (got := _call_object(text, i)) is not None:
        call, end = got
        calls.append(call)
        if fmt.separator is None:
            break
        j = _skip_ws(text, end)
        if not text.startswith(fmt.separator, j):
            break
        i = _skip_ws(text, j + len(fmt.separator))
    if calls and fmt.close:
        j = _skip_ws(text, end)
        if text.startswith(fmt.close, j):
            end = j + len(fmt.close)
    return calls, end


def _call_object(text: str, i: int) -> tuple[ToolCall, int] | None:
    """The call whose object starts at ``i`` and where it ends, or None."""
    if not text.startswith("{", i):
        return None
    head = _HEAD.match(text, i)
    name = _head_name(head)
    if name is not None and text.startswith("{", head.end()):
        try:
            _, args_end = _DECODER.raw_decode(text, head.end())
        except ValueError:
            return None
        j = _skip_ws(text, args_end)
        if not text.startswith("}", j):
            return None
        return ToolCall(name, text[head.end() : args_end]), j + 1
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    call = _call_of(obj)
    return None if call is None else (call, end)


def _head_name(head: Any) -> str | None:
    """The call's name from a complete ``_HEAD`` match (None: no match, or not a name)."""
    if head is None or getattr(head, "partial", False):
        return None
    try:
        name = json.loads(head.group("name"))
    except ValueError:
        return None
    return name or None


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if not (isinstance(name, str) and name and isinstance(args, dict)):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _find_marker(fmt: CallFormat, text: str, pos: int) -> tuple[int, str] | None:
    """The first marker at or after ``pos`` (the longest where two start together)."""
    best = None
    for marker in fmt.markers:
        at = text.find(marker, pos)
        if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
            best = (at, marker)
    return best


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _held_suffix(fmt: CallFormat, text: str) -> int:
    """The length of the longest end of ``text`` that a marker starts with (not a whole one)."""
    longest = 0
    for marker in fmt.markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


# ------------------------------------------------------------------ reading a stream

_NEED = object()  # the text so far does not decide yet
_FAIL = object()  # no call here


class _ValueEnd:
    """Where a JSON object or array ends, read in pieces (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = False

    def feed(self, s: str) -> int | None:
        """The offset just past the value's end in ``s``, or None if it goes on."""
        k = 0
        while k < len(s):
            if self.escape:
                self.escape, k = False, k + 1
            elif self.in_string:
                m = _IN_STRING.search(s, k)
                if m is None:
                    return None
                k = m.end()
                if m.group() == '"':
                    self.in_string = False
                else:
                    self.escape = True
            else:
                m = _OUTSIDE.search(s, k)
                if m is None:
                    return None
                k, ch = m.end(), m.group()
                if ch == '"':
                    self.in_string = True
                else:
                    self.depth += 1 if ch in "{[" else -1
                    if self.depth == 0:
                        return k
        return None


class ToolCallStream:
    """``parse`` over a text that arrives in pieces (see the module docstring)."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.buf = ""  # text not read yet
        self.pending = ""  # a region's text since its marker or its last call, undecided
        self.marker = ""  # the current region's marker
        self.region_calls = 0  # calls read in the current region
        self.calls = 0  # calls begun
        self.args: _ValueEnd | None = None  # the arguments being streamed
        self.state = self._text
        self.done = False
        self.out_content: list[str] = []
        self.out_calls: list[CallDelta] = []

    def feed(self, text: str, final: bool = False) -> Deltas:
        """What ``text`` adds; ``final``: the text ends with it, and whatever was held is
        decided now."""
        self.buf += text
        self.done = self.done or final
        while self.state():
            pass
        return self._take()

    def finish(self) -> Deltas:
        return self.feed("", final=True)

    def _take(self) -> Deltas:
        calls: list[CallDelta] = []
        for d in self.out_calls:  # an index's argument pieces, joined
            if calls and calls[-1].index == d.index and d.name is None:
                calls[-1] = calls[-1]._replace(arguments=calls[-1].arguments + d.arguments)
            else:
                calls.append(d)
        deltas = Deltas("".join(self.out_content), calls)
        self.out_content, self.out_calls = [], []
        return deltas

    # Each state reads what it can and returns whether it moved on (False: it waits for text).

    def _text(self) -> bool:
        hit = _find_marker(self.fmt, self.buf, 0)
        if hit is None:
            keep = 0 if self.done else _held_suffix(self.fmt, self.buf)
            self.out_content.append(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        at, self.marker = hit
        self.out_content.append(self.buf[:at])
        self.pending, self.buf = self.buf[at:], ""
        self.region_calls = 0
        self.state = self._region
        return True

    def _region(self) -> bool:
        self.pending += self.buf
        self.buf = ""
        step = self._region_step()
        if step is _NEED and self.done:
            step = _FAIL
        if step is _NEED:
            return False
        if step is _FAIL:  # no (more) calls: read what is left as text
            if self.region_calls == 0:
                self.out_content.append(self.marker)
                self.pending = self.pending[len(self.marker) :]
            self.buf, self.pending = self.pending, ""
            self.state = self._text
        elif isinstance(step, int):  # the region's close, up to this offset
            self.buf, self.pending = self.pending[step:], ""
            self.state = self._text
        else:
            self._begin_call(*step)
        return True

    def _region_step(self) -> Any:
        """_NEED, _FAIL, an int (the region closes there), (name, args offset) where a call's
        arguments begin, or (ToolCall, end) for a call read whole."""
        fmt, text = self.fmt, self.pending
        if self.region_calls == 0:
            i = _skip_ws(text, 0 if self.marker in fmt.kept else len(self.marker))
            if fmt.open:
                if len(text) - i < len(fmt.open) and fmt.open.startswith(text[i:]):
                    return _NEED
                if not text.startswith(fmt.open, i):
                    return _FAIL
                i = _skip_ws(text, i + len(fmt.open))
            return _object_step(text, i)
        i = _skip_ws(text, 0)
        rest = text[i:]
        if not rest or any(
            rest != t and t.startswith(rest) for t in (fmt.separator, fmt.close) if t
        ):
            return _NEED
        if fmt.separator is not None and rest.startswith(fmt.separator):
            return _object_step(text, _skip_ws(text, i + len(fmt.separator)))
        if fmt.close and rest.startswith(fmt.close):
            return i + len(fmt.close)
        return _FAIL

    def _begin_call(self, first: Any, second: int) -> None:
        self.region_calls += 1
        if isinstance(first, ToolCall):  # read whole
            self.out_calls.append(CallDelta(self.calls, first.name, first.arguments))
            self.calls += 1
            self.pending = self.pending[second:]
            return
        self.out_calls.append(CallDelta(self.calls, first, ""))
        self.buf, self.pending = self.pending[second:], ""
        self.args = _ValueEnd()
        self.state = self._arguments

    def _arguments(self) -> bool:
        end = self.args.feed(self.buf)
        piece = self.buf if end is None else self.buf[:end]
        if piece:
            self.out_calls.append(CallDelta(self.calls, None, piece))
        if end is None:
            self.buf = ""
            return False
        self.buf = self.buf[end:]
        self.state = self._object_close
        return True

    def _object_close(self) -> bool:
        i = _skip_ws(self.buf, 0)
        if i == len(self.buf) and not self.done:
            return False
        self.calls += 1
        if self.buf.startswith("}", i):
            self.buf = self.buf[i + 1 :]
            self.state = self._region
        else:  # malformed after its name went out: the call ends here
            self.state = self._text
        return True


def _object_step(text: str, i: int) -> Any:
    """At a call object's start: _NEED, _FAIL, (name, args offset) once its head is read, or
    (ToolCall, end) for an object that does not start with its name and arguments."""
    if i == len(text):
        return _NEED
    if text[i] != "{":
        return _FAIL
    head = _HEAD.match(text, i, partial=True)
    if head is not None and head.partial:
        return _NEED
    name = _head_name(head)
    if name is not None:
        if head.end() == len(text):
            return _NEED
        if text[head.end()] == "{":
            return name, head.end()
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return _NEED  # incomplete, or malformed: decided when the text ends
    call = _call_of(obj)
    return _FAIL if call is None else (call, end)
