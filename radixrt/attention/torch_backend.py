"""The reference attention backend: gather each request's K/V through its slots, attend with
PyTorch's SDPA. It runs on any device and dtype; it is the fallback where neither the C
kernels (``cpu_backend``) nor Triton (``triton_backend``) run, and the oracle their tests
compare with.

One step is one padded batch, the same in extend and decode: request b's new tokens are
queries 0..extend_len_b - 1 at positions prefix_len_b + i; its keys are its whole sequence
``req_to_token[row_b, :seq_len_b]`` (the new K/V stored first); query i sees keys
j <= prefix_len_b + i. Queries are padded to the longest extend, keys to the longest sequence
(pad slot 0, masked); padded queries' outputs are dropped.

A layer's sliding window W (``forward(..., window=W)``) narrows query i's keys to
prefix_len_b + i - W < j (the mask, one per window a step meets); the keys no query of a request
sees under it are zeroed after the gather, so whatever the slots a window dropped hold never
reaches an output. A soft cap c turns the scores (after scaling) into c·tanh(s / c), in float32,
before the mask and the softmax (SDPA has no soft cap).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixrt.attention.base import AttentionBackend, ForwardBatch


@dataclass
class _Meta:
    slots: torch.Tensor  # int64 [B, L]: each request's slots, padded with slot 0
    q_rows: torch.Tensor  # int64 [B, Q]: each request's rows of q, padded with row 0
    q_valid: torch.Tensor  # bool [B, Q]: real queries (their order is q's)
    keys: torch.Tensor  # int64 [1, 1, L]: key positions
    last_key: torch.Tensor  # int64 [B, Q, 1]: each query's position (padded: its request's last)
    in_seq: torch.Tensor  # bool [B, 1, L]: keys of the request
    masks: dict = field(default_factory=dict)  # window (None: none) → (mask, seen)

    def mask(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bool [B, 1, Q, L]: query i of request b sees key j; bool [B, L]: some query sees
        key j, None without a window)."""
        if window not in self.masks:
            sees = (self.keys <= self.last_key) & self.in_seq
            if window is not None:
                sees &= self.keys > self.last_key - window
            self.masks[window] = (sees[:, None], None if window is None else sees.any(1))
        return self.masks[window]


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
        last_key = torch.minimum((seq - ext)[:, None] + queries, seq[:, None] - 1)  # [B, Q]
        batch.attn_metadata = _Meta(
            slots, q_rows, q_valid, keys[None, None, :], last_key[:, :, None], in_seq[:, None, :]
        )
        to_swa = getattr(self.pool, "full_to_swa", None)
        if to_swa is not None:  # sliding-window layers' own slots (behind a window: slot 0)
            batch.swa_metadata = dataclasses.replace(batch.attn_metadata, slots=to_swa[slots])
            batch.swa_out_cache_loc = to_swa[batch.out_cache_loc]

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
        meta, new_slots = self.layer_view(layer_id, batch)
        self.pool.store_kv(layer_id, new_slots, k, v)
        mask, seen = meta.mask(window)
        (b, nq), (_, h, d) = meta.q_rows.shape, q.shape
        qq = q.index_select(0, meta.q_rows.reshape(-1)).view(b, nq, h, d).transpose(1, 2)
        kk = _gather(self.pool.k_buffers[layer_id], meta.slots, h, seen).to(q.dtype)
        vv = _gather(self.pool.v_buffers[layer_id], meta.slots, h, seen).to(q.dtype)
        if softcap is None:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scaling)
        else:
            o = _capped_attention(qq, kk, vv, mask, scaling, softcap)  # [B, H, Q, D]
        return o.transpose(1, 2)[meta.q_valid]


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    cap: float,
) -> torch.Tensor:
    """SDPA's result with the scores soft-capped (c·tanh(s / c)), in float32; q's dtype out."""
    s = q.float() @ k.float().transpose(-1, -2) * scaling
    s = (cap * torch.tanh(s / cap)).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype)


def _gather(
    buf: torch.Tensor, slots: torch.Tensor, heads: int, seen: torch.Tensor | None
) -> torch.Tensor:
    """Rows ``slots`` [B, L] of a [N, KH, D] buffer as [B, heads, L, D] (each KV head repeated
    for the query heads that share it); where ``seen`` [B, L] is False, zeros."""
    n, kh, d = buf.shape
    b, length = slots.shape
    rows = torch.index_select(buf.view(n, kh * d), 0, slots.reshape(-1)).view(b, length, kh, d)
    if seen is not None:
        rows = torch.where(seen[:, :, None, None], rows, 0)
    return rows.transpose(1, 2).repeat_interleave(heads // kh, dim=1)
