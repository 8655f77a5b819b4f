"""Reference attention on CPU (or any device): gather K/V through slots, call SDPA.

Extend runs one SDPA per request (ragged lengths, causal with a prefix
offset); decode pads the batch to its longest sequence and masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode

_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _ExtendMeta:
    token_starts: list[int]          # [B] first index of request b in T
    slots: list[torch.Tensor]        # [B] int64 [seq_len_b]
    masks: list[torch.Tensor | None]  # [B] bool [extend_b, seq_len_b]; None = plain causal


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # int64 [B, Lmax], padded with slot 0
    mask: torch.Tensor   # bool [B, 1, 1, Lmax]


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        if batch.mode is ForwardMode.DECODE:
            lmax = max(batch.seq_lens)
            lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
            valid = torch.arange(lmax)[None, :] < lens[:, None]
            slots = torch.where(valid, table[batch.req_rows, :lmax], 0)
            batch.attn_metadata = _DecodeMeta(slots, valid[:, None, None, :])
            return
        starts, slots, masks, pos = [], [], [], 0
        for row, seq_len, ext in zip(batch.req_rows.tolist(), batch.seq_lens, batch.extend_lens):
            starts.append(pos)
            pos += ext
            slots.append(table[row, :seq_len])
            prefix = seq_len - ext
            masks.append(None if prefix == 0 else
                         torch.arange(seq_len)[None, :] <= torch.arange(ext)[:, None] + prefix)
        batch.attn_metadata = _ExtendMeta(starts, slots, masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scaling: float) -> torch.Tensor:
        self.pool.store_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        meta = batch.attn_metadata
        if batch.mode is ForwardMode.DECODE:
            kk = k_buf[meta.slots].transpose(1, 2)   # [B, KH, L, D]
            vv = v_buf[meta.slots].transpose(1, 2)
            o = _sdpa(q.unsqueeze(2), kk, vv, meta.mask, scaling)  # [B, H, 1, D]
            return o.squeeze(2)
        out = torch.empty_like(q)
        for b, ext in enumerate(batch.extend_lens):
            s = meta.token_starts[b]
            qb = q[s:s + ext].transpose(0, 1)                 # [H, e, D]
            kb = k_buf[meta.slots[b]].transpose(0, 1)         # [KH, L, D]
            vb = v_buf[meta.slots[b]].transpose(0, 1)
            ob = _sdpa(qb, kb, vb, meta.masks[b], scaling, causal=meta.masks[b] is None)
            out[s:s + ext] = ob.transpose(0, 1)
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scaling: float, causal: bool = False) -> torch.Tensor:
    """SDPA with grouped-query heads: q [..., H, n, D], k/v [..., KH, L, D]."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1 and not _HAS_GQA:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    kwargs = {"enable_gqa": True} if group > 1 and _HAS_GQA else {}
    if v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scaling, **kwargs)
