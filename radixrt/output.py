"""A request's progress as its consumer sees it: token deltas, text deltas, the final output.

Used by ``radixrt.Engine`` (``make_output``), by the server's Scheduler process
(``OutputTracker``, whose ``TokenDelta``s go over the wire) and Detokenizer process
(``Detokenizer``, ``TokenDelta`` → ``TextDelta``), and by ``radixrt.lang``'s
``EngineBackend``, which runs both in one thread.

Contract:
- ``token_delta(req, n0, n)`` carries output tokens ``[n0, n)`` of a ``Req``, with their
  logprobs when ``params.logprobs`` and their top logprobs when ``params.top_logprobs``;
  the first delta (``n0 == 0``) also carries the stop strings, the time of the first
  token and a scoring request's prompt logprobs (its prompt is all computed by then);
  only a finished request's delta has a finish reason. Every delta carries the prompt's
  length, its cached tokens and how many of them were loaded from below the device
  (``cached_below``; ``cached_tokens_details`` makes the dict outputs give), and its
  speculative decoding counters so far (``spec_verify_ct``, ``spec_draft_tokens``,
  ``spec_accepted_tokens``; 0 without speculation). A finished embedding request's delta
  carries its ``embedding`` (float32 values).
- ``OutputTracker`` knows, per tracked request, how many output tokens were sent. A
  streamed request has a delta due whenever it has new tokens; an unstreamed one has a
  single delta, holding everything, when it finishes. A finished request's delta is its
  last; the tracker forgets it then.
- Text: a request's text deltas concatenate to ``cut_at_stop(decode(output_ids), stop)``,
  which is also the text of ``make_output``. Stop strings end a request in the scheduler
  (``Scheduler._hit_stop_string``); here they only cut the text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixrt.protocol import (
    BatchTextOut,
    BatchTokenOut,
    ErrorCode,
    GenerateOutput,
    RidError,
    TextDelta,
    TokenDelta,
)

if TYPE_CHECKING:
    from radixrt.scheduler.req import Req


def token_delta(req: Req, n0: int, n: int) -> TokenDelta:
    """Output tokens ``[n0, n)`` of req, with what the first delta and the last one carry."""
    first = n0 == 0
    scored = first and req.logprob_start_len is not None
    top = req.params.top_logprobs > 0
    return TokenDelta(
        rid=req.rid,
        token_ids=req.output_ids[n0:n],
        logprobs=req.output_logprobs[n0:n] if req.params.logprobs else None,
        finish_reason=req.finish_reason if req.finished else None,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens,
        cached_below=req.cached_below,
        stop=req.params.stop if first else None,
        skip_special_tokens=req.params.skip_special_tokens,
        ends_on_stop_token=ends_on_stop_token(req, n),
        first_token_at=(req.first_token_at or 0.0) if first else 0.0,
        prompt_logprobs=list(req.prompt_logprobs) if scored else None,
        top_logprobs=req.output_top_logprobs[n0:n] if top else None,
        prompt_top_logprobs=list(req.prompt_top_logprobs) if scored and top else None,
        **spec_counters(req),
        embedding=embedding_values(req),
    )


def make_output(req: Req, decode: Callable[[list[int], bool], str]) -> GenerateOutput:
    """Everything req produced, as one output; finish_reason "abort" while it is unfinished.

    Its fields are those of the concatenation of req's deltas (``token_delta``), and its
    text is what the Detokenizer's text deltas of them add up to.
    """
    d = token_delta(req, 0, len(req.output_ids))
    return GenerateOutput(
        rid=req.rid,
        text=cut_at_stop(decode(*text_ids(d.token_ids, d)), req.params.stop),
        token_ids=d.token_ids,
        prompt_tokens=d.prompt_tokens,
        cached_tokens=d.cached_tokens,
        cached_tokens_details=cached_tokens_details(d.cached_tokens, d.cached_below),
        finish_reason=req.finish_reason or "abort",
        logprobs=d.logprobs,
        prompt_logprobs=d.prompt_logprobs,
        top_logprobs=d.top_logprobs,
        prompt_top_logprobs=d.prompt_top_logprobs,
        **spec_counters(d),
        embedding=d.embedding,
    )


def ends_on_stop_token(req: Req, n: int) -> bool:
    """Whether output token n - 1 is the last and the stop token that ended req."""
    ids = req.output_ids
    return bool(
        req.finished and req.finish_reason == "stop" and n == len(ids) and ids[-1] in req.stop_ids
    )


def text_ids(ids: list[int], d: TokenDelta) -> tuple[list[int], bool]:
    """The ids whose text a request's output is, and whether special tokens are skipped: all
    of them, but the stop token that ended it where special tokens are kept as text."""
    if d.skip_special_tokens or not d.ends_on_stop_token:
        return ids, d.skip_special_tokens
    return ids[:-1], False


def embedding_values(req: Req) -> list[float] | None:
    """A finished embedding request's embedding as float32 values (None for any other)."""
    if req.embedding is None or not req.finished:
        return None
    return req.embedding.tolist()


def embedding_output(req: Req) -> dict:
    """A finished embedding request as SGLang's ``encode`` answers: ``{"embedding": [...],
    "meta_info": {"id", "prompt_tokens", "cached_tokens"}}``."""
    meta = {"id": req.rid, "prompt_tokens": len(req.prompt_ids), "cached_tokens": req.cached_tokens}
    return {"embedding": embedding_values(req), "meta_info": meta}


def cached_tokens_details(cached_tokens: int, cached_below: tuple[int, int]) -> dict[str, int]:
    """Where a request's cached tokens were found: ``cached_below`` (host, storage) of them
    were loaded from the hierarchical cache's tiers, the rest were in the device's tree."""
    host, storage = cached_below
    return {"device": cached_tokens - host - storage, "host": host, "storage": storage}


class OutputTracker:
    """The requests whose output is being sent, and how many output tokens of each were sent."""

    def __init__(self) -> None:
        self._reqs: dict[str, Req] = {}
        self._sent: dict[str, int] = {}  # rid -> output tokens already sent
        self._unstreamed: set[str] = set()  # rids whose output goes out only when they finish

    def add(self, req: Req, stream: bool = True) -> None:
        self._reqs[req.rid] = req
        self._sent[req.rid] = 0
        if not stream:
            self._unstreamed.add(req.rid)

    def remove(self, rid: str) -> None:
        del self._reqs[rid], self._sent[rid]
        self._unstreamed.discard(rid)

    def rids(self) -> list[str]:
        return list(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def collect(self) -> list[tuple[Req, TokenDelta]]:
        """The due delta of every tracked request, in the order they were added; the
        finished ones (their delta is their last) are forgotten."""
        due = []
        for rid, req in list(self._reqs.items()):
            n0, n = self._sent[rid], len(req.output_ids)
            if not req.finished and (n == n0 or rid in self._unstreamed):
                continue
            due.append((req, token_delta(req, n0, n)))
            self._sent[rid] = n
            if req.finished:
                self.remove(rid)
        return due


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    """Cut text at each stop string in turn (the final text of a request)."""
    for s in stop or ():
        cut = text.find(s)
        if cut != -1:
            text = text[:cut]
    return text


class DecodeState:
    __slots__ = ("ids", "prefix_offset", "read_offset", "text", "sent", "stop", "skip")

    def __init__(self, stop: list[str] | None, skip: bool = True) -> None:
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[:prefix_offset] are decoded into text for good
        self.read_offset = 0  # ids[:read_offset] are decoded into text
        self.text = ""
        self.sent = ""
        self.stop = stop
        self.skip = skip  # skip special tokens


class Detokenizer:
    """Token deltas → text deltas, per request, incrementally.

    Per request it keeps the output ids, the text decoded so far and the text already sent.
    Only the ids after ``prefix_offset`` are decoded each step, and the difference to
    ``decode(ids[prefix_offset:read_offset])`` is new text unless it ends in an incomplete
    UTF-8 sequence (U+FFFD). A tail that could be the start of a stop string is held back.
    The final delta comes from one full decode, so the text deltas concatenate to the text
    of ``make_output``.

    ``process`` isolates faults: a request whose delta raises (e.g. the tokenizer fails on
    odd ids) gets a ``RidError(code=INTERNAL)`` in ``errors`` and its later deltas, up to
    its final one, are ignored; the other requests of the batch go on.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}
        self.dropped: set[str] = set()  # failed rids whose final delta has not come yet
        self.errors: list[RidError] = []  # failures of the last process(), to send after it

    def process(self, batch: BatchTokenOut) -> BatchTextOut:
        """Text deltas of batch; a request whose delta raises goes to ``errors`` instead."""
        items, self.errors = [], []
        for item in batch.items:
            if item.rid in self.dropped:
                if item.finish_reason is not None:
                    self.dropped.discard(item.rid)
                continue
            try:
                items.append(self.delta(item))
            except Exception as e:  # this request's fault only
                self.forget(item.rid)
                if item.finish_reason is None:
                    self.dropped.add(item.rid)
                self.errors.append(
                    RidError(
                        rid=item.rid, code=ErrorCode.INTERNAL, message=f"detokenizer failed: {e!r}"
                    )
                )
        return BatchTextOut(items=items)

    def forget(self, rid: str) -> None:
        """Drop everything kept for rid (it failed here or upstream)."""
        self.states.pop(rid, None)
        self.dropped.discard(rid)

    def delta(self, item: TokenDelta) -> TextDelta:
        """item with its new text; a final item's state is dropped."""
        st = self.states.get(item.rid)
        if st is None:
            st = self.states[item.rid] = DecodeState(item.stop, item.skip_special_tokens)
        st.ids.extend(item.token_ids)
        if item.finish_reason is not None:
            text = cut_at_stop(self.decode(*text_ids(st.ids, item)), st.stop)
            del self.states[item.rid]
        else:
            self.advance(st)
            text = self.stable_text(st.text, st.stop)
        new = text[len(st.sent) :] if text.startswith(st.sent) and len(text) > len(st.sent) else ""
        st.sent += new
        return TextDelta(
            rid=item.rid,
            text=new,
            token_ids=item.token_ids,
            logprobs=item.logprobs,
            finish_reason=item.finish_reason,
            prompt_tokens=item.prompt_tokens,
            cached_tokens=item.cached_tokens,
            cached_below=item.cached_below,
            prompt_logprobs=item.prompt_logprobs,
            top_logprobs=item.top_logprobs,
            prompt_top_logprobs=item.prompt_top_logprobs,
            first_token_at=item.first_token_at,
            **spec_counters(item),
            embedding=item.embedding,
        )

    def decode(self, ids: list[int], skip: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def advance(self, st: DecodeState) -> None:
        """Append the newly complete text of st.ids to st.text."""
        new = self.decode(st.ids[st.prefix_offset :], st.skip)
        old = (
            self.decode(st.ids[st.prefix_offset : st.read_offset], st.skip)
            if st.read_offset > st.prefix_offset
            else ""
        )
        if len(new) > len(old) and not new.endswith("\ufffd"):
            st.text += new[len(old) :]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    @staticmethod
    def stable_text(text: str, stop: list[str] | None) -> str:
        """text cut at a stop string, or without the tail that could start one."""
        if stop:
            cut = cut_at_stop(text, stop)
            if cut != text:
                return cut
            hold = max(len(s) for s in stop) - 1
            text = text[: len(text) - hold] if hold else text
        return text


def spec_counters(d: Req | TokenDelta | TextDelta) -> dict[str, int]:
    """The speculative counters of a request or delta by their output names (SGLang's
    ``meta_info`` names)."""
    return {
        "spec_verify_ct": d.spec_verify_ct,
        "spec_draft_tokens": d.spec_draft_tokens,
        "spec_accepted_tokens": d.spec_accepted_tokens,
    }
