"""A scheduled batch (requests + how many tokens each computes) and its index tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt.scheduler.req import Req
from radixrt.scheduler.step_cost import attention_pairs


class LogitsLayout(NamedTuple):
    """Logit rows of a step in which some request scores its prompt.

    ``last_rows[b]``: row of request b's last-token logits; ``spans[b]``:
    (first row, target token ids) of its scored positions; ``indices``: the
    token index (into the step's T tokens) each row is taken at.
    """

    last_rows: list[int]
    spans: list[tuple[int, list[int]]]
    indices: list[int]


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request computes this step (1 in decode)
    # A mixed step's first decode_rows requests are running ones computing their next token.
    decode_rows: int = 0
    layout: LogitsLayout | None = field(default=None, init=False)  # set by to_forward_batch

    def prefills(self, i: int) -> bool:
        """Whether request i computes prompt tokens (not a running request's next token)."""
        return self.mode is ForwardMode.EXTEND and i >= self.decode_rows

    def work(self) -> tuple[int, int]:
        """(new tokens, (query, key) pairs their attention reads), before the step runs."""
        pairs = sum(attention_pairs(r.kv_len, n) for r, n in zip(self.reqs, self.extend_lens))
        return sum(self.extend_lens), pairs

    def to_forward_batch(self, pool: KVPool) -> ForwardBatch:
        """Index tensors for the step; slots must already be in the requests' rows."""
        ids, positions, locs = [], [], []
        for req, n in zip(self.reqs, self.extend_lens):
            start = req.kv_len
            ids.extend(req.ids_slice(start, start + n))
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            locs.append(pool.req_to_token[req.row, start : start + n])
        self.layout = self._logits_layout()
        logits_indices = None
        if self.layout is not None:
            logits_indices = torch.tensor(
                self.layout.indices, dtype=torch.int64, device=pool.device
            )
        return ForwardBatch(
            logits_indices=logits_indices,
            mode=self.mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=pool.device),
            positions=torch.cat(positions).to(pool.device),
            out_cache_loc=torch.cat(locs),
            req_rows=torch.tensor(
                [r.row for r in self.reqs], dtype=torch.int64, device=pool.device
            ),
            seq_lens=[r.kv_len + n for r, n in zip(self.reqs, self.extend_lens)],
            extend_lens=list(self.extend_lens),
            decode_rows=self.decode_rows,
        )

    def _logits_layout(self) -> LogitsLayout | None:
        """None unless a request scores prompt tokens in this extend.

        Position p of the extend (p >= logprob_start_len - 1, p + 1 < len(prompt))
        predicts prompt[p + 1].
        """
        if self.mode is not ForwardMode.EXTEND or all(
            r.logprob_start_len is None for r in self.reqs
        ):
            return None
        last_rows, spans, indices, offset = [], [], [], 0
        for req, n in zip(self.reqs, self.extend_lens):
            targets: list[int] = []
            if req.logprob_start_len is not None:
                first = max(req.kv_len, req.logprob_start_len - 1)
                end = min(req.kv_len + n, len(req.prompt_ids) - 1)
                targets = req.prompt_ids[first + 1 : end + 1] if end > first else []
                indices.extend(
                    range(offset + first - req.kv_len, offset + first - req.kv_len + len(targets))
                )
            spans.append((len(indices) - len(targets), targets))
            last_rows.append(len(indices))
            indices.append(offset + n - 1)
            offset += n
        if not any(t for _, t in spans):
            return None
        return LogitsLayout(last_rows, spans, indices)
