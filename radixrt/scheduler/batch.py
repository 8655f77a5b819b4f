"""A scheduled batch (requests + how many tokens each computes) and its index tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt.scheduler.req import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request computes this step (1 in decode)

    def to_forward_batch(self, pool: KVPool) -> ForwardBatch:
        """Index tensors for the step; slots must already be in the requests' rows."""
        ids, positions, locs = [], [], []
        for req, n in zip(self.reqs, self.extend_lens):
            start = req.kv_len
            ids.extend(req.fill_ids[start:start + n])
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            locs.append(pool.req_to_token[req.row, start:start + n])
        layout = self.logits_layout()
        logits_indices = None
        if any(targets for _, targets in layout[1]):
            idx = [0] * (len(layout[0]) + sum(len(t) for _, t in layout[1]))
            offset = 0
            for req, n, last, (start, targets) in zip(self.reqs, self.extend_lens, layout[0], layout[1]):
                first = max(req.kv_len, (req.logprob_start_len or 0) - 1)
                for k in range(len(targets)):
                    idx[start + k] = offset + first - req.kv_len + k
                idx[last] = offset + n - 1
                offset += n
            logits_indices = torch.tensor(idx, dtype=torch.int64, device=pool.device)
        return ForwardBatch(
            logits_indices=logits_indices,
            mode=self.mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=pool.device),
            positions=torch.cat(positions).to(pool.device),
            out_cache_loc=torch.cat(locs),
            req_rows=torch.tensor([r.row for r in self.reqs], dtype=torch.int64, device=pool.device),
            seq_lens=[r.kv_len + n for r, n in zip(self.reqs, self.extend_lens)],
            extend_lens=list(self.extend_lens),
        )

    def logits_layout(self) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """Where each request's logits sit when some request scores its prompt.

        Per request: the row of its last-token logits, and (start row, target
        token ids) of its scored positions: position p in this extend (with
        p >= logprob_start_len - 1 and p + 1 < len(prompt)) predicts prompt[p + 1].
        """
        last_rows, spans, row = [], [], 0
        for req, n in zip(self.reqs, self.extend_lens):
            targets: list[int] = []
            if req.logprob_start_len is not None and self.mode is ForwardMode.EXTEND:
                first = max(req.kv_len, req.logprob_start_len - 1)
                end = min(req.kv_len + n, len(req.prompt_ids) - 1)
                targets = req.prompt_ids[first + 1:end + 1] if end > first else []
            spans.append((row, targets))
            row += len(targets)
            last_rows.append(row)
            row += 1
        return last_rows, spans
