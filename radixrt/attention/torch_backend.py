"""Reference attention on CPU (or any device): gather K/V through slots, attend.

Query heads are grouped under their KV head (GQA): q [T, H, D] is viewed as
[KH, G·n, D] (G = H / KH) so attention runs on the KV heads as they are
stored, with no repeat of K/V. Masks are 4-D boolean so PyTorch's CPU flash
kernel takes them. Output dtype = q dtype.
- Extend: one SDPA per request; new token i (position prefix + i) sees keys
  0..prefix + i.
- Decode, cascade: requests whose req_to_token rows start with the same run of
  slots (a prefix shared through the radix cache) form a group. Per layer the
  group's shared K/V are gathered once and all its queries attend to them
  (float32 matmuls, keeping the log-sum-exp); each request's private tail
  [c_b, seq_len_b) is padded over the batch and masked; the two partial
  results are merged by their log-sum-exps. A group is used only when it has
  >= ``MIN_GROUP_SIZE`` requests and a prefix >= ``MIN_SHARED_PREFIX`` tokens.
- Decode, no qualifying group: the batch is padded to its longest sequence
  (pad slot 0) and masked, one SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode

MIN_GROUP_SIZE = 2
MIN_SHARED_PREFIX = 16


@dataclass
class _ExtendMeta:
    token_starts: list[int]            # [B] first index of request b in T
    slots: list[torch.Tensor]          # [B] int64 [seq_len_b]
    masks: list[torch.Tensor | None]   # [B] bool [1, 1, extend_b, seq_len_b]; None = causal


@dataclass
class _DecodeMeta:
    # Shared groups (empty: plain padded decode): (members int64 [n_g], prefix slots int64 [c_g]).
    groups: list[tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor  # int64 [B * P]: request b's private tokens [c_b, seq_len_b), padded with slot 0
    width: int           # P = max private length
    mask: torch.Tensor   # bool [B, 1, 1, P]


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = _decode_metadata(table, batch.req_rows, batch.seq_lens)
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
        meta = batch.attn_metadata
        if batch.mode is ForwardMode.DECODE:
            if meta.groups:
                return _cascade_decode(q, k_buf, v_buf, meta, scaling)
            return _padded_decode(q, k_buf, v_buf, meta, scaling)
        out = torch.empty_like(q)
        for b, ext in enumerate(batch.extend_lens):
            s = meta.token_starts[b]
            kb, vb = _gather(k_buf, meta.slots[b]), _gather(v_buf, meta.slots[b])  # [L, KH, D]
            out[s:s + ext] = _grouped_sdpa(q[s:s + ext], kb, vb, meta.masks[b], scaling)
        return out


# ---- decode metadata ----------------------------------------------------------------------

def _decode_metadata(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int]) -> _DecodeMeta:
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=table.device)  # [B]
    lmax = max(seq_lens)
    cols = torch.arange(lmax, device=table.device)
    rows = torch.where(cols[None, :] < lens[:, None], table[req_rows, :lmax], -1)  # [B, Lmax], pad -1
    gid, shared = _shared_prefix_lens(rows, lens)
    groups = []
    for g, (c, first) in enumerate(zip(shared.tolist(), _first_members(gid).tolist())):
        members = (gid == g).nonzero().squeeze(1)
        if c >= MIN_SHARED_PREFIX and members.numel() >= MIN_GROUP_SIZE:
            groups.append((members, rows[first, :c]))
    start = torch.zeros_like(lens)  # [B] c_b: first private position of each request
    for members, prefix in groups:
        start[members] = prefix.numel()
    width = int((lens - start).max())
    pos = start[:, None] + torch.arange(width, device=table.device)[None, :]  # [B, P]
    valid = pos < lens[:, None]
    slots = torch.where(valid, rows.gather(1, pos.clamp(max=lmax - 1)), 0).reshape(-1)
    return _DecodeMeta(groups, slots, width, valid[:, None, None, :])


def _shared_prefix_lens(rows: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows int64 [B, Lmax] (pad -1), lens [B] → (group id [B] by first slot, group prefix [NG]).

    A group's prefix is the longest m such that all its rows have equal slots[:m].
    """
    _, gid = torch.unique(rows[:, 0], return_inverse=True)
    first = _first_members(gid)                                         # [NG]
    differs = rows != rows[first[gid]]                                  # [B, Lmax] vs group's first row
    run = torch.where(differs.any(1), differs.int().argmax(1), rows.shape[1])  # [B] equal leading run
    run = torch.minimum(run, lens)
    shared = torch.full_like(first, rows.shape[1]).scatter_reduce(0, gid, run, "amin")
    return gid, shared


def _first_members(gid: torch.Tensor) -> torch.Tensor:
    """gid [B] with values 0..NG-1 → [NG] the lowest request index of each group."""
    idx = torch.arange(gid.numel(), device=gid.device)
    ng = int(gid.max()) + 1
    return torch.full((ng,), gid.numel(), device=gid.device).scatter_reduce(0, gid, idx, "amin")


# ---- decode attention ---------------------------------------------------------------------

def _padded_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _DecodeMeta,
                   scaling: float) -> torch.Tensor:
    """One SDPA over every request's (here: whole) KV, padded to the longest and masked."""
    b, h, d = q.shape
    kh = k_buf.shape[1]
    kk = _gather(k_buf, meta.slots).view(b, meta.width, kh, d).transpose(1, 2)  # [B, KH, P, D]
    vv = _gather(v_buf, meta.slots).view(b, meta.width, kh, d).transpose(1, 2)
    qg = q.view(b, kh, h // kh, d)  # the G query heads of a KV head act as G queries
    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=meta.mask, scale=scaling)
    return o.reshape(b, h, d)


def _cascade_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _DecodeMeta,
                    scaling: float) -> torch.Tensor:
    """Shared prefix once per group + private tails over the batch, merged by log-sum-exp."""
    b, h, d = q.shape
    o1 = q.new_zeros(b, h, d, dtype=torch.float32)              # shared part, [B, H, D]
    lse1 = q.new_full((b, h), float("-inf"), dtype=torch.float32)  # -inf: no shared part
    for members, prefix in meta.groups:
        o, lse = _attend_shared(q[members], _gather(k_buf, prefix), _gather(v_buf, prefix), scaling)
        o1.index_copy_(0, members, o)
        lse1.index_copy_(0, members, lse)
    o2, lse2 = _attend_private(q, k_buf, v_buf, meta, scaling)
    m = torch.maximum(lse1, lse2)  # finite: every request has at least one key
    w1, w2 = (lse1 - m).exp_().unsqueeze(-1), (lse2 - m).exp_().unsqueeze(-1)  # [B, H, 1]
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)


def _attend_shared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D], k/v [c, KH, D] (all n see all c keys) → float32 (o [n, H, D], lse [n, H])."""
    n, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    qg = q.float().view(n, kh, g, d).transpose(0, 1).reshape(kh, n * g, d)  # [KH, n·G, D]
    s = torch.bmm(qg, k.float().permute(1, 2, 0)).mul_(scaling)           # [KH, n·G, c]
    lse = s.logsumexp(-1, keepdim=True)                                    # [KH, n·G, 1]
    o = torch.bmm(s.sub_(lse).exp_(), v.float().transpose(0, 1))         # [KH, n·G, D]
    o = o.view(kh, n, g, d).transpose(0, 1).reshape(n, h, d)
    return o, lse.view(kh, n, g).transpose(0, 1).reshape(n, h)


def _attend_private(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _DecodeMeta,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's private tail → float32 (o [B, H, D], lse [B, H]; lse -inf when empty)."""
    b, h, d = q.shape
    kh = k_buf.shape[1]
    if meta.width == 0:
        return q.new_zeros(b, h, d, dtype=torch.float32), q.new_full((b, h), float("-inf"), dtype=torch.float32)
    kk = _gather(k_buf, meta.slots).view(b, meta.width, kh, d).float().permute(0, 2, 3, 1)  # [B, KH, D, P]
    vv = _gather(v_buf, meta.slots).view(b, meta.width, kh, d).float().transpose(1, 2)     # [B, KH, P, D]
    qg = q.float().view(b, kh, h // kh, d)                                          # [B, KH, G, D]
    s = torch.matmul(qg, kk).mul_(scaling).masked_fill_(~meta.mask, float("-inf"))  # [B, KH, G, P]
    lse = s.logsumexp(-1, keepdim=True)                                             # [B, KH, G, 1]
    p = s.sub_(torch.where(lse.isinf(), 0.0, lse)).exp_()  # an empty tail gives p = 0, o = 0
    return torch.matmul(p, vv).view(b, h, d), lse.view(b, h)


# ---- helpers ------------------------------------------------------------------------------

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
