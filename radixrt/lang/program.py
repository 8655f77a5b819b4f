"""Prompt programs: ``@function``, the state ``s`` and the expressions added to it.

A ``ProgramState`` holds the prompt as token ids (and its text), the chat
messages and the named variables. ``s += expr`` runs at once:
- ``str``: tokenized on its own (no special tokens) and appended;
- ``gen``: generates from the ids so far, stores the text under its name;
- ``select``: scores every choice in one backend call, appends the best by
  length-normalized log-likelihood;
- ``system/user/assistant(...)``: the chat template's role prefix, the body,
  the role suffix (prefix/suffix come from rendering the template once with a
  placeholder).
``s.fork(n)`` caches the current prefix on the backend, then returns n states
that extend the same ids. A program that raises leaves ``state.error`` set.

``run(..., cache_salt=s)`` / ``run_batch(..., cache_salt=s)`` namespace the
run's prefix cache: every request the run sends (each ``gen``, ``select``
and fork, in every fork) carries salt ``s``, so it shares KV only with
requests of the same salt (see ``SamplingParams.cache_salt``). A ``gen``
may still pass its own ``cache_salt=``.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from radixrt.sampling import SamplingParams

_PLACEHOLDER = "\x00RADIXRT-CONTENT\x00"
_DEFAULT_BACKEND = None


def set_default_backend(backend) -> None:
    global _DEFAULT_BACKEND
    _DEFAULT_BACKEND = backend


def get_default_backend():
    return _DEFAULT_BACKEND


# ----------------------------------------------------------- expressions


@dataclass
class Gen:
    name: str | None
    params: dict[str, Any]


@dataclass
class Select:
    name: str | None
    choices: list[str]


@dataclass
class Role:
    role: str
    body: list[Any] = field(default_factory=list)


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    ignore_eos: bool = False,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    ebnf: str | None = None,
    **extra,
) -> Gen:
    """Generate (greedy by default) and store the text under ``name``. ``regex``,
    ``json_schema`` or ``ebnf`` (at most one) constrains the text to that grammar; a bad one
    raises ``radixrt.grammar.GrammarError`` here."""
    params = dict(
        max_new_tokens=max_tokens,
        stop=stop,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        ignore_eos=ignore_eos,
        seed=seed,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
        **extra,
    )
    if regex is not None or json_schema is not None or ebnf is not None:
        SamplingParams(**params)  # the constraint is checked when the program is written
    return Gen(name, params)


def select(name: str | None = None, choices: list[str] = ()) -> Select:
    if not choices:
        raise ValueError("select needs at least one choice")
    return Select(name, list(choices))


def system(*body) -> Role:
    return Role("system", list(body))


def user(*body) -> Role:
    return Role("user", list(body))


def assistant(*body) -> Role:
    return Role("assistant", list(body))


# --------------------------------------------------------- chat template


class ChatFormat:
    """Role prefix/suffix strings of a tokenizer's chat template."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._cache: dict[tuple[str, bool], tuple[str, str]] = {}

    def _render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False)

    def affixes(self, role: str, first: bool) -> tuple[str, str]:
        """(prefix, suffix) of a ``role`` turn; ``first``: the conversation's first turn."""
        key = (role, first)
        if key not in self._cache:
            if first:
                head, msgs = "", [{"role": role, "content": _PLACEHOLDER}]
            else:
                lead = (
                    [{"role": "system", "content": "S"}]
                    if role != "system"
                    else [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
                )
                head = self._render(lead)
                msgs = lead + [{"role": role, "content": _PLACEHOLDER}]
            text = self._render(msgs)
            if not text.startswith(head) or _PLACEHOLDER not in text:
                raise ValueError(f"cannot derive the {role!r} turn from the chat template")
            pre, post = text[len(head) :].split(_PLACEHOLDER)
            self._cache[key] = (pre, post)
        return self._cache[key]


# ----------------------------------------------------------------- state


class ProgramState:
    def __init__(
        self,
        backend,
        ids: list[int] | None = None,
        stream_q: queue.Queue | None = None,
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> None:
        self.backend = backend
        self.cache_salt = cache_salt  # sent with every request of this state and its forks
        # one replica for the run and its forks (their prefixes are cached there)
        self.routing_key = routing_key or f"run-{uuid.uuid4().hex}"
        self.tokenizer = backend.tokenizer
        self.chat = ChatFormat(self.tokenizer)
        self.ids: list[int] = list(ids) if ids is not None else self._bos()
        self._text: list[str] = []
        self._messages: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}  # per variable: cached_tokens, prompt_tokens, scores
        self.error: BaseException | None = None
        self._stream_q = stream_q
        self._role: str | None = None

    def _bos(self) -> list[int]:
        full = self.tokenizer.encode("a")
        bare = self.tokenizer.encode("a", add_special_tokens=False)
        return full[: len(full) - len(bare)] if full[len(full) - len(bare) :] == bare else []

    # ------------------------------------------------------------- public

    def __iadd__(self, expr) -> ProgramState:
        self._run(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        try:
            return self.variables[name]
        except KeyError:
            raise KeyError(
                f"no variable {name!r} in this state (known: {sorted(self.variables)})"
            ) from None

    def get_meta_info(self, name: str) -> dict:
        return self.meta.get(name, {})

    def text(self) -> str:
        return "".join(self._text)

    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def fork(self, n: int) -> ForkGroup:
        """n states continuing from this one; the shared prefix is cached once first."""
        if len(self.ids) > 1:
            self.backend.cache_prefix(self.ids, self.cache_salt, self.routing_key)
        children = []
        for _ in range(n):
            child = ProgramState(
                self.backend, self.ids, cache_salt=self.cache_salt, routing_key=self.routing_key
            )
            child._text, child._messages = list(self._text), [dict(m) for m in self._messages]
            child.variables, child._role = dict(self.variables), self._role
            children.append(child)
        return ForkGroup(children)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced (needs ``run(stream=True)``); with var_name only that gen's."""
        if self._stream_q is None:
            yield self.text() if var_name is None else self[var_name]
            return
        while True:
            item = self._stream_q.get()
            if item is None:
                return
            name, text = item
            if var_name is None or name == var_name:
                yield text

    # ------------------------------------------------------------ running

    def _run(self, expr) -> None:
        if isinstance(expr, str):
            self._append_text(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Role):
            self._role_turn(expr)
        elif isinstance(expr, (list, tuple)):
            for e in expr:
                self._run(e)
        else:
            raise TypeError(f"cannot add {type(expr).__name__} to a program state")

    def _emit(self, name: str | None, text: str) -> None:
        if self._stream_q is not None and text:
            self._stream_q.put((name, text))

    def _append_text(
        self,
        text: str,
        ids: list[int] | None = None,
        name: str | None = None,
        streamed: bool = False,
    ) -> None:
        if not text and not ids:
            return
        self.ids.extend(
            self.tokenizer.encode(text, add_special_tokens=False) if ids is None else ids
        )
        self._text.append(text)
        if self._role is not None:
            self._messages[-1]["content"] += text
        if not streamed:
            self._emit(name, text)

    def _role_turn(self, expr: Role) -> None:
        if self._role is not None:
            raise ValueError(f"a {expr.role!r} turn cannot nest inside a {self._role!r} turn")
        pre, post = self.chat.affixes(expr.role, first=not self._messages)
        self._append_text(pre)
        self._messages.append({"role": expr.role, "content": ""})
        self._role = expr.role
        try:
            for e in expr.body:
                self._run(e)
        finally:
            self._role = None
        self._append_text(post)

    def _gen(self, expr: Gen) -> None:
        sp = SamplingParams(**{"cache_salt": self.cache_salt, **expr.params})
        if self._stream_q is None:
            out = self.backend.generate(self.ids, sp, self.routing_key)
        else:
            out = None
            for item in self.backend.generate_stream(self.ids, sp, self.routing_key):
                if isinstance(item, str):
                    self._emit(expr.name, item)
                else:
                    out = item
        self._append_text(
            out.text, self._output_ids(out), expr.name, streamed=self._stream_q is not None
        )
        self._store(
            expr.name,
            out.text,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            finish_reason=out.finish_reason,
        )

    def _output_ids(self, out) -> list[int]:
        """Ids to continue from: the generated ids when they decode to the text, else the text's."""
        ids = list(out.token_ids)
        while (
            ids
            and self.tokenizer.decode(ids[-1:], skip_special_tokens=True) == ""
            and ids[-1] in set(self.tokenizer.all_special_ids)
        ):
            ids.pop()
        if self.tokenizer.decode(ids, skip_special_tokens=True) == out.text:
            return ids
        return self.tokenizer.encode(out.text, add_special_tokens=False)

    def _select(self, expr: Select) -> None:
        conts = [self.tokenizer.encode(c, add_special_tokens=False) for c in expr.choices]
        scores = self.backend.score(self.ids, conts, self.cache_salt, self.routing_key)
        normalized = [lp / max(n, 1) for lp, n in scores]
        best = max(range(len(conts)), key=lambda i: normalized[i])
        self._append_text(expr.choices[best], conts[best], expr.name)
        self._store(
            expr.name,
            expr.choices[best],
            normalized_logprobs=normalized,
            logprobs=[lp for lp, _ in scores],
        )

    def _store(self, name: str | None, value: Any, **meta) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta


class ForkGroup(list):
    """The states ``fork(n)`` returned; ``forks += expr`` runs expr in all of them at once."""

    def __iadd__(self, expr) -> ForkGroup:
        with ThreadPoolExecutor(max(1, len(self))) as pool:
            list(pool.map(lambda st: st._run(expr), self))
        return self

    def join(self) -> ForkGroup:
        """Kept for SGLang-style programs: every fork has already run to here."""
        return self


# -------------------------------------------------------------- function


class Program:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "program")
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    def run(
        self,
        *args,
        backend=None,
        stream: bool = False,
        cache_salt: str | None = None,
        routing_key: str | None = None,
        **kwargs,
    ) -> ProgramState:
        """Run once; errors inside the program end up in ``state.error``.

        ``cache_salt``: the prefix-cache namespace of every request of the run.
        ``routing_key``: the run's requests (a fresh key when None) go to one replica.
        """
        backend = backend or _DEFAULT_BACKEND
        if backend is None:
            raise RuntimeError(
                "no backend: call radixrt.lang.set_default_backend(...) or pass backend="
            )
        SamplingParams(cache_salt=cache_salt)  # a bad salt raises here, not inside the program
        backend.ensure_ready()
        state = ProgramState(
            backend,
            stream_q=queue.Queue() if stream else None,
            cache_salt=cache_salt,
            routing_key=routing_key,
        )
        if stream:
            threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True).start()
        else:
            self._execute(state, args, kwargs)
        return state

    def _execute(self, state: ProgramState, args, kwargs) -> None:
        try:
            self.fn(state, *args, **kwargs)
        except Exception as e:  # the state carries it; run never hangs on a failing program
            state.error = e
        finally:
            if state._stream_q is not None:
                state._stream_q.put(None)

    def run_batch(
        self,
        batch_kwargs: list[dict],
        *,
        backend=None,
        num_threads: int = 16,
        progress_bar: bool = False,
        cache_salt: str | None = None,
    ) -> list[ProgramState]:
        """Run once per kwargs dict (in order); the batch's common prompt prefix is cached first.

        ``cache_salt`` applies to every run; a kwargs dict's own ``cache_salt``
        key overrides it for that run. The common prefix is cached once per
        salt that two or more runs use, and then every run goes to the replica
        holding it (one routing key for the batch); without one, each run is
        routed on its own.
        """
        backend = backend or _DEFAULT_BACKEND
        if backend is None:
            raise RuntimeError(
                "no backend: call radixrt.lang.set_default_backend(...) or pass backend="
            )
        backend.ensure_ready()
        batch_kwargs = [{"cache_salt": cache_salt, **kw} for kw in batch_kwargs]
        salts = Counter(kw["cache_salt"] for kw in batch_kwargs)
        prefix = self._common_prefix(backend, [_program_kwargs(kw) for kw in batch_kwargs])
        if len(prefix) > 1 and max(salts.values()) > 1:
            key = f"batch-{uuid.uuid4().hex}"
            batch_kwargs = [{"routing_key": key, **kw} for kw in batch_kwargs]
            for salt, n in salts.items():
                if n > 1:
                    backend.cache_prefix(prefix, salt, key)
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.__name__)

        def one(kw: dict) -> ProgramState:
            st = self.run(backend=backend, **kw)
            if bar is not None:
                bar.update(1)
            return st

        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            states = list(pool.map(one, batch_kwargs))
        if bar is not None:
            bar.close()
        return states

    def _common_prefix(self, backend, batch_kwargs: list[dict]) -> list[int]:
        """Longest common prefix of the prompts the programs send first (traced without a model)."""
        prefixes = []
        for kw in batch_kwargs:
            tracer = _TracingState(backend)
            try:
                self.fn(tracer, **kw)
            except _TraceDone:
                pass
            except Exception:
                return []
            prefixes.append(tracer.ids)
        if not prefixes:
            return []
        common = prefixes[0]
        for p in prefixes[1:]:
            n = 0
            while n < min(len(common), len(p)) and common[n] == p[n]:
                n += 1
            common = common[:n]
        return common


def _program_kwargs(kw: dict) -> dict:
    """A run's kwargs without the ones ``run`` itself takes."""
    return {k: v for k, v in kw.items() if k not in ("cache_salt", "routing_key")}


class _TraceDone(Exception):
    pass


class _TracingState(ProgramState):
    """Runs a program up to its first backend call and stops there."""

    def _gen(self, expr: Gen) -> None:
        raise _TraceDone

    def _select(self, expr: Select) -> None:
        raise _TraceDone

    def fork(self, n: int) -> ForkGroup:
        raise _TraceDone


def function(fn: Callable) -> Program:
    """Decorator: ``fn(s, **kwargs)`` becomes a program with ``run`` and ``run_batch``."""
    return Program(fn)
