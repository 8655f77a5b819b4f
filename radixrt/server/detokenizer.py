"""The Detokenizer process: token ids → text deltas.

Per request it keeps the output ids, the text decoded so far and the text
already sent. Decoding is incremental: only the ids after ``prefix_offset`` are
decoded each step, and the difference to ``decode(ids[prefix_offset:read_offset])``
is new text unless it ends in an incomplete UTF-8 sequence (U+FFFD). A tail
that could be the start of a stop string is held back. The final delta comes
from one full decode, so the concatenation equals what the in-process Engine
returns (full decode, cut at the first stop string).
Messages that are not token batches pass through unchanged; a ``RidError``
also drops the request's state.

A request whose delta raises (e.g. the tokenizer fails on odd ids) is
dropped: the process sends ``RidError(code=INTERNAL)`` for it (the
TokenizerManager answers the client and aborts it in the scheduler), and
ignores its later deltas up to its final one. The other requests of the
batch go on.
"""

from __future__ import annotations

import zmq

from radixrt.protocol import (BatchTextOut, BatchTokenOut, ErrorCode, RidError, TextDelta, TokenDelta,
                              decode, encode)
from radixrt.server import faults
from radixrt.server.common import POLL_MS, exit_if_orphaned, pull, push, report_ready, run_child


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    """The Engine's rule: cut at each stop string in turn."""
    for s in stop or ():
        cut = text.find(s)
        if cut != -1:
            text = text[:cut]
    return text


class DecodeState:
    __slots__ = ("ids", "prefix_offset", "read_offset", "text", "sent", "stop")

    def __init__(self, stop: list[str] | None) -> None:
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[:prefix_offset] are decoded into text for good
        self.read_offset = 0    # ids[:read_offset] are decoded into text
        self.text = ""
        self.sent = ""
        self.stop = stop


class Detokenizer:
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
                self.errors.append(RidError(rid=item.rid, code=ErrorCode.INTERNAL,
                                            message=f"detokenizer failed: {e!r}"))
        return BatchTextOut(items=items)

    def forget(self, rid: str) -> None:
        """Drop everything kept for rid (it failed here or upstream)."""
        self.states.pop(rid, None)
        self.dropped.discard(rid)

    def delta(self, item: TokenDelta) -> TextDelta:
        st = self.states.get(item.rid)
        if st is None:
            st = self.states[item.rid] = DecodeState(item.stop)
        st.ids.extend(item.token_ids)
        if item.finish_reason is not None:
            text = cut_at_stop(self.decode(st.ids), st.stop)
            del self.states[item.rid]
        else:
            self.advance(st)
            text = self.stable_text(st.text, st.stop)
        new = text[len(st.sent):] if text.startswith(st.sent) and len(text) > len(st.sent) else ""
        st.sent += new
        return TextDelta(rid=item.rid, text=new, token_ids=item.token_ids, logprobs=item.logprobs,
                         finish_reason=item.finish_reason, prompt_tokens=item.prompt_tokens,
                         cached_tokens=item.cached_tokens, prompt_logprobs=item.prompt_logprobs,
                         top_logprobs=item.top_logprobs,
                         prompt_top_logprobs=item.prompt_top_logprobs, first_token_at=item.first_token_at)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def advance(self, st: DecodeState) -> None:
        """Append the newly complete text of st.ids to st.text."""
        new = self.decode(st.ids[st.prefix_offset:])
        old = self.decode(st.ids[st.prefix_offset:st.read_offset]) if st.read_offset > st.prefix_offset else ""
        if len(new) > len(old) and not new.endswith("\ufffd"):
            st.text += new[len(old):]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    @staticmethod
    def stable_text(text: str, stop: list[str] | None) -> str:
        if stop:
            cut = cut_at_stop(text, stop)
            if cut != text:
                return cut
            hold = max(len(s) for s in stop) - 1
            text = text[:len(text) - hold] if hold else text
        return text


def run_detokenizer(args: dict) -> None:
    def main(ctx: zmq.Context, ready: zmq.Socket) -> None:
        from transformers import AutoTokenizer
        detok = Detokenizer(AutoTokenizer.from_pretrained(args["model_path"]))
        armed = faults.parse(args.get("debug_faults"))
        if armed is not None:
            faults.install_in_detokenizer(detok, armed)
        recv = pull(ctx, args["detokenizer_addr"])
        send = push(ctx, args["tokenizer_addr"])
        report_ready(ready, "detokenizer")
        while True:
            exit_if_orphaned(args)
            if not recv.poll(POLL_MS):
                continue
            data = recv.recv()
            msg = decode(data)
            if isinstance(msg, BatchTokenOut):
                out = detok.process(msg)
                if out.items:
                    send.send(encode(out))
                for err in detok.errors:
                    send.send(encode(err))
            else:
                if isinstance(msg, RidError):
                    detok.forget(msg.rid)
                send.send(data)  # control replies and errors pass through

    run_child("detokenizer", args, main)
