"""Reference attention on CPU (or any device): gather K/V through slots, call SDPA.

Query heads are grouped under their KV head (GQA): q [T, H, D] is viewed as
[KH, G·n, D] so SDPA runs on the KV heads as they are stored, with no
repeat of K/V. Masks are 4-D boolean so PyTorch's CPU flash kernel takes them.
- Extend: one SDPA per request; new token i (position prefix + i) sees keys
  0..prefix + i.
- Decode: the batch is padded to its longest sequence (pad slot 0) and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode


@dataclass
class _ExtendMeta:
    token_starts: list[int]            # [B] first index of request b in T
    slots: list[torch.Tensor]          # [B] int64 [seq_len_b]
    masks: list[torch.Tensor | None]   # [B] bool [1, 1, extend_b, seq_len_b]; None = causal


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # int64 [B * Lmax], padded with slot 0
    lmax: int
    mask: torch.Tensor   # bool [B, 1, 1, Lmax]


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        if batch.mode is ForwardMode.DECODE:
            lmax = max(batch.seq_lens)
            lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=table.device)
            valid = torch.arange(lmax, device=table.device)[None, :] < lens[:, None]
            slots = torch.where(valid, table[batch.req_rows, :lmax], 0).reshape(-1)
            batch.attn_metadata = _DecodeMeta(slots, lmax, valid[:, None, None, :])
            return
        starts, slots, masks, pos = [], [], [], 0
        for row, seq_len, ext in zip(batch.req_rows.tolist(), batch.seq_lens, batch.extend_lens):
            starts.append(pos)
            pos += ext
            slots.append(table[row, :seq_len])
            masks.append(None if seq_len == ext else _prefix_causal_mask(ext, seq_len, table.device))
        batch.attn_metadata = _ExtendMeta(starts, slots, masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scaling: float) -> torch.Tensor:
        self.pool.store_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        if batch.mode is ForwardMode.DECODE:
            return self._decode(q, k_buf, v_buf, batch.attn_metadata, scaling)
        meta = batch.attn_metadata
        out = torch.empty_like(q)
        for b, ext in enumerate(batch.extend_lens):
            s = meta.token_starts[b]
            kb, vb = _gather(k_buf, meta.slots[b]), _gather(v_buf, meta.slots[b])  # [L, KH, D]
            out[s:s + ext] = _grouped_sdpa(q[s:s + ext], kb, vb, meta.masks[b], scaling)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _DecodeMeta,
                scaling: float) -> torch.Tensor:
        b, h, d = q.shape
        kh = k_buf.shape[1]
        kk = _gather(k_buf, meta.slots).view(b, meta.lmax, kh, d).transpose(1, 2)  # [B, KH, L, D]
        vv = _gather(v_buf, meta.slots).view(b, meta.lmax, kh, d).transpose(1, 2)
        qg = q.view(b, kh, h // kh, d)  # the G query heads of a KV head act as G queries
        o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=meta.mask, scale=scaling)
        return o.reshape(b, h, d)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a [N, KH, D] buffer (index_select: far faster than advanced indexing)."""
    n, kh, d = buf.shape
    return torch.index_select(buf.view(n, kh * d), 0, slots).view(-1, kh, d)


def _prefix_causal_mask(ext: int, seq_len: int, device: torch.device) -> torch.Tensor:
    prefix = seq_len - ext
    cols = torch.arange(seq_len, device=device)[None, :]
    rows = torch.arange(ext, device=device)[:, None]
    return (cols <= rows + prefix)[None, None]


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scaling: float) -> torch.Tensor:
    """q [n, H, D], k/v [L, KH, D] → [n, H, D]; causal (aligned at the end) when mask is None."""
    n, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    # [n, KH, G, D] → [KH, G, n, D] → [1, KH, G·n, D]: rows of KV head j are its G heads' queries.
    qg = q.view(n, kh, g, d).permute(1, 2, 0, 3).reshape(1, kh, g * n, d)
    kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if mask is None:
        mask = _prefix_causal_mask(n, k.shape[0], q.device)
    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask.repeat(1, 1, g, 1), scale=scaling)
    return o.view(kh, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)
