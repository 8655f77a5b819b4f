"""A scheduled batch (requests + how many tokens each computes) and its index tensors.

A batch's requests come in three runs: running requests computing their next token, then
running requests verifying a draft (``drafts``), then prompts being prefilled. A drafted
request becomes several rows of the forward, one per branch of its draft (``DraftRows``):
each is a plain causal sequence over the request's KV, so every attention backend computes
it as any extend row, with the bits a decode of the same tokens would give in exact mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt.scheduler.req import Req
from radixrt.scheduler.step_cost import attention_pairs


class LogitsLayout(NamedTuple):
    """Logit rows of a step in which some request scores its prompt or verifies a draft.

    ``last_rows[b]``: row of request b's last-token logits (a drafted request's: its first
    branch's first row); ``spans[b]``: (first row, target token ids) of its scored
    positions; ``indices``: the token index (into the step's T tokens) each row is taken
    at; ``draft_rows[b]``: a drafted request's first row, its branches' rows following on
    (every token of every branch has one).
    """

    last_rows: list[int]
    spans: list[tuple[int, list[int]]]
    indices: list[int]
    draft_rows: dict[int, int] = {}


class HiddenLayout(NamedTuple):
    """Final hidden state rows of a step in which embedding requests compute prompt tokens:
    ``indices``: the token index (into the step's T tokens) of each row; ``spans``: (request
    index, first row, rows) of each request that pools some."""

    indices: list[int]
    spans: list[tuple[int, int, int]]


@dataclass
class DraftRows:
    """A running request's draft in a step. Branch b computes ``[its last token, *tokens[b]]``
    at positions ``kv_len ..`` through row ``rows[b]`` of ``req_to_token`` (``rows[0]`` is the
    request's own; the others are spare rows holding a copy of its KV's slots), into
    ``slots[b]``, new slots of the branch alone (``slots[0][0]`` is the slot decoding
    allocated for the request's next token)."""

    tokens: list[list[int]]
    rows: list[int]
    slots: list[torch.Tensor]

    def lens(self) -> list[int]:
        """Tokens each branch's row computes."""
        return [len(t) + 1 for t in self.tokens]


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request computes this step (1 in decode)
    # The first decode_rows requests are running ones computing their next token (a mixed
    # step's, or a step verifying drafts); the last len(drafts) of them verify a draft.
    decode_rows: int = 0
    drafts: dict[int, DraftRows] = field(default_factory=dict)  # request index -> its draft
    layout: LogitsLayout | None = field(default=None, init=False)  # set by to_forward_batch

    def prefills(self, i: int) -> bool:
        """Whether request i computes prompt tokens (not a running request's next token)."""
        return self.mode is ForwardMode.EXTEND and i >= self.decode_rows

    @property
    def prefilling(self) -> bool:
        """Whether some request computes prompt tokens."""
        return self.mode is ForwardMode.EXTEND and len(self.reqs) > self.decode_rows

    def rows(self) -> list[tuple[int, int, list[int]]]:
        """The forward's sequences: (row of req_to_token, first position, token ids)."""
        out = []
        for i, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            draft = self.drafts.get(i)
            if draft is None:
                out.append((req.row, req.kv_len, req.ids_slice(req.kv_len, req.kv_len + n)))
                continue
            last = req.output_ids[-1]
            out.extend((row, req.kv_len, [last, *t]) for row, t in zip(draft.rows, draft.tokens))
        return out

    def work(self) -> tuple[int, int]:
        """(new tokens, (query, key) pairs their attention reads), before the step runs."""
        rows = self.rows()
        return sum(len(ids) for *_, ids in rows), sum(
            attention_pairs(start, len(ids)) for _, start, ids in rows
        )

    def to_forward_batch(self, pool: KVPool) -> ForwardBatch:
        """Index tensors for the step; slots must already be in the requests' (and the
        drafts' spare) rows."""
        rows, dev = self.rows(), pool.device
        self.layout = self._logits_layout()
        logits_indices = None
        if self.layout is not None:
            logits_indices = torch.tensor(self.layout.indices, dtype=torch.int64, device=dev)
        return ForwardBatch(
            logits_indices=logits_indices,
            mode=self.mode,
            input_ids=torch.tensor([t for *_, ids in rows for t in ids], device=dev),
            positions=torch.cat(
                [torch.arange(start, start + len(ids)) for _, start, ids in rows]
            ).to(dev),
            out_cache_loc=torch.cat(
                [pool.req_to_token[row, start : start + len(ids)] for row, start, ids in rows]
            ),
            req_rows=torch.tensor([row for row, *_ in rows], dtype=torch.int64, device=dev),
            seq_lens=[start + len(ids) for _, start, ids in rows],
            extend_lens=[len(ids) for *_, ids in rows],
            decode_rows=self.decode_rows - len(self.drafts),
        )

    def hidden_layout(self) -> HiddenLayout | None:
        """The rows embedding requests pool in this step (``Req.pooled_rows``); None if
        none."""
        if not any(r.pooling is not None for r in self.reqs):
            return None
        indices, spans, offset = [], [], 0
        for i, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            rows = req.pooled_rows(n) if self.prefills(i) else range(0)
            if rows:
                spans.append((i, len(indices), len(rows)))
                indices.extend(offset + j for j in rows)
            offset += sum(self.drafts[i].lens()) if i in self.drafts else n
        return HiddenLayout(indices, spans) if spans else None

    def _logits_layout(self) -> LogitsLayout | None:
        """None unless a request scores prompt tokens or verifies a draft in this extend.

        Position p of the extend (p >= logprob_start_len - 1, p + 1 < len(prompt))
        predicts prompt[p + 1].
        """
        if self.mode is not ForwardMode.EXTEND or not (
            self.drafts or any(r.logprob_start_len is not None for r in self.reqs)
        ):
            return None
        last_rows, spans, indices, offset = [], [], [], 0
        draft_rows: dict[int, int] = {}
        for i, (req, n) in enumerate(zip(self.reqs, self.extend_lens)):
            if i in self.drafts:
                t = sum(self.drafts[i].lens())
                draft_rows[i] = len(indices)
                spans.append((len(indices), []))
                last_rows.append(len(indices))
                indices.extend(range(offset, offset + t))
                offset += t
                continue
            targets = self._scored(req, n)
            first = max(req.kv_len, (req.logprob_start_len or 1) - 1) - req.kv_len
            indices.extend(range(offset + first, offset + first + len(targets)))
            spans.append((len(indices) - len(targets), targets))
            last_rows.append(len(indices))
            indices.append(offset + n - 1)
            offset += n
        if not draft_rows and not any(t for _, t in spans):
            return None
        return LogitsLayout(last_rows, spans, indices, draft_rows)

    @staticmethod
    def _scored(req: Req, n: int) -> list[int]:
        """The prompt tokens req's extend of n tokens scores (their predecessors' logits)."""
        if req.logprob_start_len is None:
            return []
        first = max(req.kv_len, req.logprob_start_len - 1)
        end = min(req.kv_len + n, len(req.prompt_ids) - 1)
        return req.prompt_ids[first + 1 : end + 1] if end > first else []
