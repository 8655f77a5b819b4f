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
        return ForwardBatch(
            mode=self.mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=pool.device),
            positions=torch.cat(positions).to(pool.device),
            out_cache_loc=torch.cat(locs),
            req_rows=torch.tensor([r.row for r in self.reqs], dtype=torch.int64, device=pool.device),
            seq_lens=[r.kv_len + n for r, n in zip(self.reqs, self.extend_lens)],
            extend_lens=list(self.extend_lens),
        )
