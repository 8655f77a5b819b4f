"""Reasoning parsers (``--reasoning-parser``): a chat answer's reasoning, apart from its content.

Contract:
- The parsers carry SGLang's and vLLM's names (``config.REASONING_PARSERS``); both mark the
  reasoning with ``<think>`` … ``</think>`` and keep one reasoning block, at the output's start:
  - ``deepseek-r1``: the output starts inside the reasoning (DeepSeek-R1's template opens it in
    the prompt; R1-0528 writes ``<think>`` itself, and that leading tag is dropped).
  - ``qwen3``: the same, unless the request's ``chat_template_kwargs`` sets
    ``enable_thinking`` to false; then the output starts in the content, and only a ``<think>``
    at its start (after whitespace) opens a reasoning block.
  The prompt decides before either default (``ReasoningParser.opens_in_reasoning``): one that
  ends (bar whitespace) with ``</think>`` has closed the reasoning, one that ends with
  ``<think>`` has opened it; with ``continue_final_message`` the continued message decides
  likewise by the last tag it holds.
- Reasoning that never ends (no ``</think>`` before the output stops) is all reasoning, and the
  content is empty.
- ``ReasoningSplitter``: ``feed(text_delta) -> Split(reasoning, content)`` and ``finish()``.
  It holds back only text that may begin a tag it waits for (a leading ``<think>``, then
  ``</think>``), so a stream split at any point gives the texts of ``split(text)`` (``feed``
  then ``finish``). The tags and the whitespace before a leading ``<think>`` are dropped,
  nothing else. With ``stream_reasoning`` false the reasoning comes out in one piece, when it
  ends (or at ``finish``).
- ``ChatReasoning`` is one chat request's plan (``chat_reasoning``): whether its output starts
  in the reasoning, whether to split (SGLang's ``separate_reasoning``), and ``constrain(sp)``:
  a request that starts in the reasoning and has a structured output (``json_schema``,
  ``regex``, ``ebnf`` or ``structural_tag``) gets it after the reasoning, as one xgrammar
  structural tag (a tag ``""`` any text ``</think>``, then the constraint; any text excludes
  ``</think>``, so the reasoning ends at its first one). ``thinking_token_budget`` (vLLM's
  request field) bounds the reasoning to that many tokens, after which the grammar allows
  only ``</think>``; without a constraint the content after it is free. A request that starts
  in the content keeps its constraint as it is and has no reasoning to bound.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixrt import grammar
from radixrt.config import REASONING_PARSERS
from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.http import schemas as api

THINK_START, THINK_END = "<think>", "</think>"
# Prompt tokens decoded to see how the prompt ends: a tag and its whitespace, token by token.
PROMPT_TAIL_TOKENS = 16


class Split(NamedTuple):
    reasoning: str
    content: str


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A ``--reasoning-parser``: its tags, and the template switch that turns reasoning off."""

    name: str
    start: str = THINK_START
    end: str = THINK_END
    switch: str | None = None  # a chat_template_kwargs key; False: the output starts in content

    def opens_in_reasoning(
        self, prompt_tail: str, template_kwargs: Mapping[str, Any], continued: str | None = None
    ) -> bool:
        """Whether the output starts inside the reasoning, after a prompt ending with
        ``prompt_tail`` (``continued``: the final message it continues, if any)."""
        if continued is not None and (self.start in continued or self.end in continued):
            return continued.rfind(self.start) > continued.rfind(self.end)
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return False
        if tail.endswith(self.start):
            return True
        return self.switch is None or template_kwargs.get(self.switch) is not False

    def splitter(self, in_reasoning: bool, stream_reasoning: bool = True) -> ReasoningSplitter:
        return ReasoningSplitter(self.start, self.end, in_reasoning, stream_reasoning)

    def split(self, text: str, in_reasoning: bool) -> Split:
        """The whole output's (reasoning, content)."""
        return self.splitter(in_reasoning).split(text)


PARSERS = {
    "deepseek-r1": ReasoningParser("deepseek-r1"),
    "qwen3": ReasoningParser("qwen3", switch="enable_thinking"),
}
assert tuple(PARSERS) == REASONING_PARSERS


def parser_of(name: str | None) -> ReasoningParser | None:
    """The parser named by ``--reasoning-parser`` (None: none)."""
    return None if name is None else PARSERS[name]


_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one output's text, delta by delta, into reasoning and content."""

    def __init__(self, start: str, end: str, in_reasoning: bool, stream_reasoning: bool = True):
        self.start, self.end = start, end
        self.forced = in_reasoning  # without a leading start tag, the output is reasoning
        self.stream_reasoning = stream_reasoning
        self.state = _OPENING
        self.held = ""  # text not yet placed: it may begin a tag
        self.pending = ""  # reasoning kept back until it ends (stream_reasoning false)

    def feed(self, text: str) -> Split:
        """The reasoning and content that ``text`` (the output's next characters) completes."""
        self.held += text
        reasoning = content = ""
        if self.state == _OPENING:
            self._open()
        if self.state == _REASONING:
            reasoning = self._reason()
        if self.state == _CONTENT:
            content, self.held = self.held, ""
        return self._release(reasoning, content)

    def finish(self) -> Split:
        """What is still held, once the output has ended."""
        if self.state == _OPENING:
            self.state = _REASONING if self.forced else _CONTENT
        held, self.held = self.held, ""
        if self.state == _CONTENT:
            return self._release("", held)
        reasoning, self.pending = self.pending + held, ""
        return Split(reasoning, "")

    def split(self, text: str) -> Split:
        """The whole of ``text`` split (a fresh splitter's ``feed`` then ``finish``)."""
        head, tail = self.feed(text), self.finish()
        return Split(head.reasoning + tail.reasoning, head.content + tail.content)

    def _open(self) -> None:
        """At the output's start: drop a leading start tag, or settle without one."""
        stripped = self.held.lstrip()
        if stripped.startswith(self.start):
            self.held, self.state = stripped[len(self.start) :], _REASONING
        elif not self.start.startswith(stripped):  # not whitespace, nor a partial start tag
            self.state = _REASONING if self.forced else _CONTENT

    def _reason(self) -> str:
        """The reasoning now known; moves to the content at the end tag."""
        at = self.held.find(self.end)
        if at >= 0:
            reasoning, self.held = self.held[:at], self.held[at + len(self.end) :]
            self.state = _CONTENT
            return reasoning
        cut = len(self.held) - _partial_suffix(self.held, self.end)
        reasoning, self.held = self.held[:cut], self.held[cut:]
        return reasoning

    def _release(self, reasoning: str, content: str) -> Split:
        if self.stream_reasoning:
            return Split(reasoning, content)
        self.pending += reasoning
        if self.state != _CONTENT:
            return Split("", content)
        reasoning, self.pending = self.pending, ""
        return Split(reasoning, content)


# ------------------------------------------------------------------ chat requests


@dataclass(frozen=True, slots=True)
class ChatReasoning:
    """One chat request's reasoning: where its output starts, and how it is answered."""

    parser: ReasoningParser
    in_reasoning: bool  # the output starts inside the reasoning
    separate: bool  # reasoning_content apart from content (SGLang's separate_reasoning)
    stream_reasoning: bool
    budget: int | None  # thinking_token_budget

    def splitter(self) -> ReasoningSplitter | None:
        """A fresh splitter for one choice's stream (None: the text stays whole)."""
        if not self.separate:
            return None
        return self.parser.splitter(self.in_reasoning, self.stream_reasoning)

    def split(self, text: str) -> Split:
        """One choice's whole text as (reasoning, content)."""
        if not self.separate:
            return Split("", text)
        return self.parser.split(text, self.in_reasoning)

    def constrain(self, sp: SamplingParams) -> SamplingParams:
        """``sp`` with its constraint (and the budget) applying after the reasoning."""
        c = sp.constraint
        if not self.in_reasoning or (c is None and self.budget is None):
            return sp
        think = {"type": "any_text"}
        if self.budget is not None:
            think["max_tokens"] = self.budget
        head = {"type": "tag", "begin": "", "content": think, "end": self.parser.end}
        rest = {"type": "any_text"} if c is None else _format(c)
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [head, rest]}}
        cleared = {kind: None for kind in grammar.KINDS}
        return dataclasses.replace(sp, **{**cleared, "structural_tag": tag})


def _format(c: grammar.Constraint) -> dict[str, Any]:
    """A constraint as an element of an xgrammar structural tag's format."""
    if c.kind == "json_schema":
        schema = json.loads(c.text)
        return {
            "type": "json_schema",
            "json_schema": schema,
            "max_whitespace_cnt": grammar.MAX_WHITESPACE,
        }
    if c.kind == "regex":
        return {"type": "regex", "pattern": c.text}
    if c.kind == "ebnf":
        return {"type": "grammar", "grammar": c.text}
    return json.loads(c.text)["format"]


def chat_reasoning(
    parser: ReasoningParser | None, body: Any, ids: list[int], decode: Callable[[list[int]], str]
) -> ChatReasoning | None:
    """The reasoning plan of a chat request (``body``: a ChatCompletionRequest; ``ids``: its
    prompt, ``decode`` their text); None without a parser. 400 for a ``thinking_token_budget``
    without a parser, or below 0."""
    budget = body.thinking_token_budget
    if budget is not None and (parser is None or budget < 0):
        why = (
            "needs a server started with --reasoning-parser"
            if parser is None
            else f"must be >= 0, got {budget}"
        )
        raise api.ApiError(
            400, f"thinking_token_budget {why}", ErrorCode.INVALID_REQUEST, "thinking_token_budget"
        )
    if parser is None:
        return None
    last = body.messages[-1] if body.messages else None
    continued = None
    if body.continue_final_message and last is not None and isinstance(last.content, str):
        continued = last.content
    kwargs = body.chat_template_kwargs or {}
    return ChatReasoning(
        parser,
        parser.opens_in_reasoning(decode(ids[-PROMPT_TAIL_TOKENS:]), kwargs, continued),
        body.separate_reasoning,
        body.stream_reasoning,
        budget,
    )


class StreamSplits:
    """The splitters of one streamed chat request's choices (none without a plan that
    separates): ``feed(index, text, finished)``."""

    def __init__(self, plan: ChatReasoning | None) -> None:
        self.plan = plan
        self.splitters: dict[int, ReasoningSplitter | None] = {}

    def feed(self, index: int, text: str, finished: bool) -> Split:
        """Choice ``index``'s next text as (reasoning, content); ``finished``: its last."""
        if index not in self.splitters:
            self.splitters[index] = None if self.plan is None else self.plan.splitter()
        splitter = self.splitters[index]
        if splitter is None:
            return Split("", text)
        head = splitter.feed(text)
        if not finished:
            return head
        tail = splitter.finish()
        return Split(head.reasoning + tail.reasoning, head.content + tail.content)
