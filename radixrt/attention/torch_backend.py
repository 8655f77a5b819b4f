"""The reference attention backend: gather each request's K/V through its slots, attend with
PyTorch's SDPA. It runs on any device and dtype; it is the fallback where neither the C
kernels (``cpu_backend``) nor Triton (``triton_backend``) run, and the oracle their tests
compare with.

One step is one padded batch, the same in extend and decode: request b's new tokens are
queries 0..extend_len_b - 1 at positions prefix_len_b + i; its keys are its whole sequence
``req_to_token[row_b, :seq_len_b]`` (the new K/V stored first); query i sees keys
j <= prefix_len_b + i. Queries are padded to the longest extend, keys to the longest sequence
(pad slot 0, masked); padded queries' outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.attention.base import AttentionBackend, ForwardBatch


@dataclass
class _Meta:
    slots: torch.Tensor  # int64 [B, L]: each request's slots, padded with slot 0
    q_rows: torch.Tensor  # int64 [B, Q]: each request's rows of q, padded with row 0
    q_valid: torch.Tensor  # bool [B, Q]: real queries (their order is q's)
    mask: torch.Tensor  # bool [B, 1, Q, L]: query i of request b sees key j


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        dev = table.device
        seq = torch.tensor(batch.seq_lens, dtype=torch.int64, device=dev)
        ext = torch.tensor(batch.extend_lens, dtype=torch.int64, device=dev)
        keys = torch.arange(max(batch.seq_lens), device=dev)  # [L]
        queries = torch.arange(max(batch.extend_lens), device=dev)[None, :]  # [1, Q]
        in_seq = keys[None, :] < seq[:, None]  # [B, L]
        slots = torch.where(in_seq, table[:, : keys.numel()].index_select(0, batch.req_rows), 0)
        q_valid = queries < ext[:, None]
        q_rows = torch.where(q_valid, (ext.cumsum(0) - ext)[:, None] + queries, 0)
        last_key = (seq - ext)[:, None] + queries  # [B, Q]
        mask = (keys[None, None, :] <= last_key[:, :, None]) & in_seq[:, None, :]
        batch.attn_metadata = _Meta(slots, q_rows, q_valid, mask[:, None])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scaling: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], the new k/v [T, KH, D] → [T, H, D] in q's dtype."""
        self.unsupported(window, softcap)
        self.pool.store_kv(layer_id, batch.out_cache_loc, k, v)
        meta: _Meta = batch.attn_metadata
        (b, nq), (_, h, d) = meta.q_rows.shape, q.shape
        qq = q.index_select(0, meta.q_rows.reshape(-1)).view(b, nq, h, d).transpose(1, 2)
        kk = _gather(self.pool.k_buffers[layer_id], meta.slots, h)
        vv = _gather(self.pool.v_buffers[layer_id], meta.slots, h)
        o = F.scaled_dot_product_attention(
            qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=meta.mask, scale=scaling
        )  # [B, H, Q, D]
        return o.transpose(1, 2)[meta.q_valid]


def _gather(buf: torch.Tensor, slots: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``slots`` [B, L] of a [N, KH, D] buffer as [B, heads, L, D] (each KV head repeated
    for the query heads that share it)."""
    n, kh, d = buf.shape
    b, length = slots.shape
    rows = torch.index_select(buf.view(n, kh * d), 0, slots.reshape(-1)).view(b, length, kh, d)
    return rows.transpose(1, 2).repeat_interleave(heads // kh, dim=1)
