"""Structured outputs: a request's constraint as an xgrammar grammar, and the token masks it gives.

A request constrains its output with at most one of ``SamplingParams.json_schema``, ``regex``,
``ebnf`` and ``structural_tag`` (``constraint(params)``: a ``Constraint`` or None). A
structural tag is xgrammar's JSON format (``{"type": "structural_tag", "format": {...}}``):
free text, tags, triggered tags and JSON schemas in a sequence, which is how tool calls and
reasoning are constrained.

- ``check(constraint)`` parses the grammar without a tokenizer (cheap, cached) and raises
  ``GrammarError`` naming what is wrong: ``SamplingParams`` calls it, so a bad schema, regex
  or grammar is refused where the request is made.
- ``GrammarCompiler(tokenizer, vocab_size, stop_ids)`` compiles a constraint for the model's
  vocabulary on its own threads (``submit`` returns a ``Future``), once per constraint: a
  bounded LRU (``MAX_CACHED``) keeps the compiled grammars, so a repeated constraint's future is
  already done when its request arrives.
- ``Matcher(compiled)`` follows one request's output: ``accept`` advances by the sampled
  token, ``terminated`` says the grammar is complete and its stop token was taken.
- ``mask_logits(logits, rows, matchers)`` fills each matcher's bitmask of the tokens its
  grammar allows next and sets the others' logits in those rows to -inf, the other rows
  untouched.
- Speculative drafts: ``Matcher.accepted_prefix(tokens)`` says how much of a draft branch the
  grammar takes; ``mask_branch_logits`` masks a branch's verification rows, row t with what
  the grammar allows after the branch's first t tokens. Both leave the matcher where it was
  (they walk the branch, then roll back).

JSON schemas are compiled with any whitespace between elements, at most ``MAX_WHITESPACE``
characters in a run (a model cannot stall in whitespace), or with ``any_whitespace`` False
compact (", " and ": " between elements, as ``json.dumps`` writes); and in xgrammar's strict
mode (no properties beyond the schema's). ``response_format`` ``json_object`` is the schema
``JSON_OBJECT``. xgrammar writes the characters of a string with a length limit
(``maxLength``, ``minLength``) as any character but a quote, a backslash, CR and LF, which lets
the other control characters through raw (invalid JSON): such a grammar is rewritten with
JSON's own class (``_json_strings``).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import sampling_ops

KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
JSON_OBJECT = '{"type": "object", "additionalProperties": true}'
MAX_WHITESPACE = 16
MAX_CACHED = 256  # compiled grammars kept per compiler
COMPILE_THREADS = 2


class GrammarError(ValueError):
    """A constraint that is not a valid JSON schema, regex, EBNF grammar or structural tag."""


class Constraint(NamedTuple):
    kind: str  # one of KINDS
    text: str  # the schema or structural tag (JSON text), regex or EBNF grammar


def constraint(params: Any) -> Constraint | None:
    """The constraint of a SamplingParams (None: unconstrained)."""
    for kind in KINDS:
        text = getattr(params, kind, None)
        if text is not None:
            return Constraint(kind, text)
    return None


_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:NN: " of xgrammar's errors


def _message(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a dependency; a broken install says so
        raise GrammarError(f"structured outputs need the xgrammar package ({e})") from None
    return xgrammar


def preload() -> threading.Thread:
    """Import xgrammar on a thread of its own (a second or so), so that the first constrained
    request does not stall its process's loop while it imports."""

    def load() -> None:
        try:
            _xgrammar()
        except GrammarError:  # reported when a request needs it
            pass

    thread = threading.Thread(target=load, name="radixrt-grammar-import", daemon=True)
    thread.start()
    return thread


_LOOSE_CHARS = r"[^\"\\\r\n]"  # xgrammar's class for a length-limited string's characters
_JSON_CHARS = r"[^\0-\x1f\"\\]"  # JSON's: no raw control characters, quotes or backslashes


def _json_strings(xgr, grammar):
    """``grammar`` with every length-limited string's characters in JSON's class."""
    text = str(grammar)
    if _LOOSE_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))


def _grammar(c: Constraint, any_whitespace: bool = True):
    """The xgrammar Grammar of a constraint (raises GrammarError)."""
    xgr = _xgrammar()
    try:
        if c.kind == "json_schema":
            schema_grammar = xgr.Grammar.from_json_schema(
                c.text,
                any_whitespace=any_whitespace,
                max_whitespace_cnt=MAX_WHITESPACE if any_whitespace else None,
                strict_mode=True,
            )
            return _json_strings(xgr, schema_grammar)
        if c.kind == "regex":
            return xgr.Grammar.from_regex(c.text)
        if c.kind == "structural_tag":
            return _json_strings(xgr, xgr.Grammar.from_structural_tag(c.text))
        return xgr.Grammar.from_ebnf(c.text)
    except Exception as e:  # xgrammar raises RuntimeError (and others) with the parser's words
        what = {
            "json_schema": "JSON schema",
            "regex": "regex",
            "ebnf": "EBNF grammar",
            "structural_tag": "structural tag",
        }[c.kind]
        raise GrammarError(f"invalid {what}: {_message(e)}") from None


@functools.lru_cache(maxsize=MAX_CACHED)
def check(c: Constraint) -> None:
    """Raise GrammarError unless the constraint parses (cached per constraint)."""
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"invalid JSON schema: an object or a bool, got {c.text[:80]!r}")
    if c.kind == "structural_tag":
        try:
            tag = json.loads(c.text)
        except ValueError as e:
            raise GrammarError(f"invalid structural tag: not JSON ({e})") from None
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
            raise GrammarError(
                "invalid structural tag: an object with type 'structural_tag' and a format, "
                f"got {c.text[:80]!r}"
            )
    _grammar(c)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, off the caller's thread."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_ids: list[int], any_whitespace: bool = True
    ) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, list(stop_ids)
        self.any_whitespace = any_whitespace
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="radixrt-grammar")
        self.cache: OrderedDict[Constraint, Future] = OrderedDict()
        self.lock = threading.Lock()  # the cache's
        self._init_lock = threading.Lock()  # the compiler's first use
        self._compiler = None  # made on the pool's first job (reading the vocabulary takes time)

    def submit(self, c: Constraint) -> Future:
        """A future of the compiled grammar (an exception: GrammarError); a cached one at once."""
        with self.lock:
            fut = self.cache.get(c)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self.cache.move_to_end(c)
                return fut
            fut = self.pool.submit(self._compile, c)
            self.cache[c] = fut
            while len(self.cache) > MAX_CACHED:
                self.cache.popitem(last=False)
            return fut

    def _compile(self, c: Constraint):
        grammar = _grammar(c, self.any_whitespace)
        with self._init_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:
            raise GrammarError(f"could not compile the {c.kind}: {_message(e)}") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accepted_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar takes one after another from here (none
        after a token that terminates it); the state is left as it was."""
        n = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_along(self, tokens: list[int], bitmask: torch.Tensor, first_row: int) -> list[int]:
        """Fill ``bitmask[first_row + t]`` with the tokens the grammar allows after
        ``tokens[:t]``, for t in 0..len(tokens) (the grammar must take every token:
        ``accepted_prefix``); the state is left as it was. Returns the rows filled: all but the
        one after a token that terminates the grammar (nothing follows it)."""
        rows = []
        for t, token in enumerate(tokens):
            self.matcher.fill_next_token_bitmask(bitmask, first_row + t)
            rows.append(first_row + t)
            if not self.matcher.accept_token(token):
                if t:
                    self.matcher.rollback(t)
                raise ValueError(f"the grammar does not take draft token {token}")
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, first_row + len(tokens))
            rows.append(first_row + len(tokens))
        if tokens:
            self.matcher.rollback(len(tokens))
        return rows


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
    """Set logits[rows[i], t] to -inf for every token t that matchers[i] does not allow next
    (logits [B, V] float32, in place; the other rows are not touched). The bitmask is applied by
    the CPU kernels' library where the process has it (``sampling_ops.apply_token_bitmask``), else
    by xgrammar's ``apply_token_bitmask_inplace``."""
    xgr = _xgrammar()
    bsz, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(bsz, vocab)
    for row, m in zip(rows, matchers):  # on this thread: a pool's threads would compete with
        m.matcher.fill_next_token_bitmask(bitmask, row)  # the forward's for the cores
    _apply_bitmask(logits, bitmask, rows)


def mask_branch_logits(
    logits: torch.Tensor, starts: list[int], matchers: list[Matcher], branches: list[list[int]]
) -> int:
    """Mask draft branches' verification rows, all in one application: for each i, row
    ``starts[i] + t`` (t in 0..len(branches[i])) keeps only the tokens ``matchers[i]`` allows
    after ``branches[i][:t]``, as ``mask_logits`` would once the matcher had taken them (logits
    [B, V] float32, in place; the other rows, and the row after a token that terminates a
    grammar, are not touched). The matchers end where they began. Returns the rows masked."""
    bitmask = _xgrammar().allocate_token_bitmask(*logits.shape)
    rows = []
    for start, m, tokens in zip(starts, matchers, branches):
        rows += m.fill_along(tokens, bitmask, start)
    if rows:
        _apply_bitmask(logits, bitmask, rows)
    return len(rows)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[rows[i]] is 0."""
    xgr = _xgrammar()
    vocab = logits.shape[1]
    lib = cpu_library.loaded()
    with torch.inference_mode():  # the forward's logits are inference tensors
        if lib is not None and logits.is_cpu and logits.dtype == torch.float32:
            sampling_ops.apply_token_bitmask(
                lib, logits, bitmask, torch.tensor(rows, dtype=torch.int64)
            )
        else:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows
            )
