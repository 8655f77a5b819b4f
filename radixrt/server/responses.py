"""Responses: what the replicas produced, back to whoever asked.

Each step's ``BatchTextOut`` (from the Detokenizer) is split by request: a
ZeroMQ client gets one message per step (a ``StreamChunk`` or, for an
unstreamed request, one ``GenerateReply`` once it finished; several in a
``ReplyBatch``), an HTTP request's deltas go to its sink. A request leaves
the table with its last delta or its failure. Every delta is observed in
the metrics: the first token, the gaps between tokens, the request's end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from radixrt.output import cached_tokens_details, spec_counters
from radixrt.protocol import (
    BatchTextOut,
    ErrorReply,
    GenerateOutput,
    GenerateReply,
    ReplyBatch,
    StreamChunk,
    TextDelta,
)
from radixrt.server.front_api import RequestError
from radixrt.server.metrics import ServerMetrics
from radixrt.server.request_table import ClientReq, RequestTable

Reply = Callable[[bytes, msgspec.Struct], None]  # (ZeroMQ identity, message) -> sent


class Responses:
    def __init__(self, requests: RequestTable, metrics: ServerMetrics, reply: Reply) -> None:
        self.requests, self.metrics, self.reply = requests, metrics, reply

    def on_text_batch(self, batch: BatchTextOut) -> None:
        """Reply to each client once per step: one message, or a ReplyBatch of several; an HTTP
        request's deltas go to its sink."""
        replies: dict[bytes, list] = {}
        now = time.monotonic()
        for item in batch.items:
            st = self.requests.get(item.rid)
            if st is None:  # client gone
                continue
            self.requests.started(item.rid)
            self.observe(st, item, now)
            if st.sink is not None:
                if item.finish_reason is not None:
                    self.requests.forget(item.rid)
                st.sink.put_nowait((st.index, item))
                continue
            reply = self.rpc_reply(st, item)
            if reply is not None:
                replies.setdefault(st.identity, []).append(reply)
        for identity, items in replies.items():
            self.reply(identity, items[0] if len(items) == 1 else ReplyBatch(items=items))

    def fail(self, rid: str, code: str, message: str) -> None:
        """Answer request ``rid`` with an error and forget it."""
        st = self.requests.forget(rid)
        if st is not None and st.sink is not None:
            st.sink.put_nowait((st.index, RequestError(code, message)))
        elif st is not None:
            self.reply(st.identity, ErrorReply(req_id=st.req_id, code=code, message=message))

    def observe(self, st: ClientReq, item: TextDelta, now: float) -> None:
        """Metrics of one delta: first token, token gaps, the request's end. A streamed request's
        gaps are measured here as its deltas arrive; an unstreamed one's single delta carries the
        scheduler's time of its first token (the same monotonic clock), and its mean gap after
        it."""
        n = len(item.token_ids)
        if n and st.last_token_at is None:
            first = item.first_token_at if not st.stream and item.first_token_at else now
            self.metrics.on_first_token(first - st.arrived)
            if n > 1:
                self.metrics.on_tokens(now - first, n - 1)
        elif n:
            self.metrics.on_tokens(now - st.last_token_at, n)
        if n:
            st.last_token_at = now
        st.generated += n
        if item.finish_reason is not None:
            self.metrics.on_finish(
                item.finish_reason,
                item.prompt_tokens,
                item.cached_tokens,
                st.generated,
                now - st.arrived,
                item.spec_verify_ct,
                item.spec_accepted_tokens,
            )

    def rpc_reply(self, st: ClientReq, item: TextDelta) -> StreamChunk | GenerateReply | None:
        """A ZeroMQ client's message for one delta: a chunk when streamed, else the whole
        output once finished (None before)."""
        done = item.finish_reason is not None
        if done:
            self.requests.forget(item.rid)
        details = cached_tokens_details(item.cached_tokens, item.cached_below)
        if st.stream:
            return StreamChunk(
                req_id=st.req_id,
                text=item.text,
                token_ids=item.token_ids,
                logprobs=item.logprobs,
                finish_reason=item.finish_reason,
                prompt_tokens=item.prompt_tokens,
                cached_tokens=item.cached_tokens,
                cached_tokens_details=details,
                top_logprobs=item.top_logprobs,
                **spec_counters(item),
            )
        st.texts.append(item.text)
        st.token_ids.extend(item.token_ids)
        if item.logprobs is not None:
            st.logprobs = (st.logprobs or []) + item.logprobs
        if not done:
            return None
        out = GenerateOutput(
            rid=st.req_id,
            text="".join(st.texts),
            token_ids=st.token_ids,
            prompt_tokens=item.prompt_tokens,
            cached_tokens=item.cached_tokens,
            cached_tokens_details=details,
            finish_reason=item.finish_reason,
            logprobs=st.logprobs,
            prompt_logprobs=item.prompt_logprobs,
            top_logprobs=item.top_logprobs,
            prompt_top_logprobs=item.prompt_top_logprobs,
            **spec_counters(item),
            embedding=item.embedding,
        )
        return GenerateReply(req_id=st.req_id, output=out)
