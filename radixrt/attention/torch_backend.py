"""Reference attention on CPU (or any device): gather K/V through slots, attend.

Query heads are grouped under their KV head (GQA): q [T, H, D] is viewed as
[KH, G·n, D] (G = H / KH) so attention runs on the KV heads as they are
stored, with no repeat of K/V. Output dtype = q dtype.
- Extend: one SDPA per request; new token i (position prefix + i) sees keys
  0..prefix + i. Masks are 4-D boolean so PyTorch's CPU flash kernel takes them.
- Decode, cascade: requests whose req_to_token rows start with the same run of
  c_g slots (a prefix shared through the radix cache) form a group; groups of
  >= ``MIN_GROUP_SIZE`` requests with c_g >= ``MIN_SHARED_PREFIX`` are used.
  Per layer, (1) each group's prefix K/V is gathered once and all the group's
  queries attend to it; (2) every request's private tail [c_b, seq_len_b),
  padded over the batch, is attended; both in float32 matmuls keeping the
  log-sum-exp; (3) the two results are merged by their log-sum-exps. c_g is
  capped at seq_len - 1 so every tail holds at least the new token; a request
  outside every group has an empty shared part (lse -inf, weight 0).
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
# Cost of one key, in keys of the padded bf16 SDPA path, measured on a 2-core AVX-512 CPU
# (float32 conversion + matmuls): the cascade runs when TAIL_COST·B·P + PREFIX_COST·Σc_g < B·Lmax.
TAIL_COST = 3.0
PREFIX_COST = 2.0


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


@dataclass
class _Part:
    """X key sequences of up to L slots each (X = groups for prefixes, B for tails)."""
    slots: torch.Tensor        # int64 [X, L], padded with slot 0
    bias: torch.Tensor | None  # float32 [X * KH, 1, L]: 0 on keys, -inf on padding (None: none)


@dataclass
class _CascadeMeta:
    groups: list[tuple[torch.Tensor, int]]  # NG × (requests int64 [n_g], prefix length c_g)
    width: int               # N = max n_g
    prefix: _Part            # X = NG, L = C = max c_g
    tail: _Part              # X = B, L = P = max private length
    q_rows: torch.Tensor     # int64 [NG * KH * N]: rows of q viewed [B * KH, G * D]
    out_rows: torch.Tensor   # int64 [B * KH]: rows of the prefix output viewed [NG * KH * N, G * D]
    no_shared: torch.Tensor  # float32 [B, 1]: 0 in a group, -inf outside every group


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = _decode_metadata(table, batch.req_rows, batch.seq_lens,
                                                   self.pool.kv_heads)
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
        if isinstance(meta, _CascadeMeta):
            return _cascade_decode(q, k_buf, v_buf, meta, scaling)
        if isinstance(meta, _DecodeMeta):
            return _padded_decode(q, k_buf, v_buf, meta, scaling)
        out = torch.empty_like(q)
        for b, ext in enumerate(batch.extend_lens):
            s = meta.token_starts[b]
            kb, vb = _gather(k_buf, meta.slots[b]), _gather(v_buf, meta.slots[b])  # [L, KH, D]
            out[s:s + ext] = _grouped_sdpa(q[s:s + ext], kb, vb, meta.masks[b], scaling)
        return out


# ---- decode metadata (once per step) -------------------------------------------------------

def _decode_metadata(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int],
                     kh: int) -> _DecodeMeta | _CascadeMeta:
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=table.device)  # [B]
    lmax = max(seq_lens)
    valid = torch.arange(lmax, device=table.device)[None, :] < lens[:, None]
    rows = torch.where(valid, table[:, :lmax].index_select(0, req_rows), -1)  # [B, Lmax], pad -1
    groups, prefix_lens = _shared_groups(rows, lens)
    if groups:
        start = torch.zeros_like(lens)  # [B] c_b: first private position, 0 outside groups
        for members, c in zip(groups, prefix_lens.tolist()):
            start.index_fill_(0, members, c)
        b, width = len(seq_lens), int((lens - start).max())  # P: longest private tail
        if TAIL_COST * b * width + PREFIX_COST * int(prefix_lens.sum()) < b * lmax:
            return _cascade_metadata(rows, lens, start, width, groups, prefix_lens, kh)
    return _DecodeMeta(rows.clamp(min=0).reshape(-1), lmax, valid[:, None, None, :])


def _shared_groups(rows: torch.Tensor,
                   lens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """rows int64 [B, Lmax] (pad -1), lens [B] → the qualifying groups: their requests (NG ×
    int64 [n_g], ascending) and prefix lengths c [NG].

    Requests are grouped by their first slot; a group's prefix is the longest run slots[:c]
    equal in all its rows, capped at seq_len - 1 of each.
    """
    (b, lmax), dev = rows.shape, rows.device
    _, gid = torch.unique(rows[:, 0], return_inverse=True)                 # [B] group id
    ng = int(gid.max()) + 1
    idx = torch.arange(b, device=dev)
    first = torch.full((ng,), b, device=dev).scatter_reduce(0, gid, idx, "amin")  # [NG] 1st request
    differs = rows != rows.index_select(0, first[gid])                 # [B, Lmax] vs that request
    run = torch.where(differs.any(1), differs.int().argmax(1), lmax)   # [B] equal leading run
    run = torch.minimum(run, lens - 1)
    c = torch.full((ng,), lmax, device=dev).scatter_reduce(0, gid, run, "amin")  # [NG]
    size = torch.bincount(gid, minlength=ng)                           # [NG]
    keep = ((c >= MIN_SHARED_PREFIX) & (size >= MIN_GROUP_SIZE)).nonzero().squeeze(1)
    return [(gid == g).nonzero().squeeze(1) for g in keep.tolist()], c[keep]


def _cascade_metadata(rows: torch.Tensor, lens: torch.Tensor, start: torch.Tensor, width: int,
                      groups: list[torch.Tensor], prefix_lens: torch.Tensor, kh: int) -> _CascadeMeta:
    (b, lmax), dev = rows.shape, rows.device
    ng, n = len(groups), max(m.numel() for m in groups)
    heads = torch.arange(kh, device=dev)
    q_rows = torch.empty(ng, kh, n, dtype=torch.int64, device=dev)
    out_rows = torch.zeros(b, kh, dtype=torch.int64, device=dev)  # outside groups: row 0, weight 0
    no_shared = torch.full((b, 1), float("-inf"), dtype=torch.float32, device=dev)
    for g, members in enumerate(groups):
        padded = torch.cat([members, members[:1].expand(n - members.numel())])  # [N]
        q_rows[g] = padded[None, :] * kh + heads[:, None]                  # (request, KV head) rows
        pos = torch.arange(members.numel(), device=dev)[:, None]
        out_rows.index_copy_(0, members, (g * kh + heads[None, :]) * n + pos)
        no_shared.index_fill_(0, members, 0.0)
    firsts = torch.stack([m[0] for m in groups])
    prefix = _part(rows[:, :int(prefix_lens.max())].index_select(0, firsts), prefix_lens, kh)
    tail_pos = start[:, None] + torch.arange(width, device=dev)[None, :]  # [B, P]
    tail = _part(rows.gather(1, tail_pos.clamp(max=lmax - 1)), lens - start, kh)
    return _CascadeMeta(list(zip(groups, prefix_lens.tolist())), n, prefix, tail,
                        q_rows.reshape(-1), out_rows.reshape(-1), no_shared)


def _part(slots: torch.Tensor, lens: torch.Tensor, kh: int) -> _Part:
    """slots int64 [X, L], of which the first lens[x] are keys of sequence x."""
    keys = torch.arange(slots.shape[1], device=slots.device)[None, :] < lens[:, None]  # [X, L]
    if bool(keys.all()):
        return _Part(slots, None)
    bias = torch.zeros(keys.shape, dtype=torch.float32, device=slots.device)
    bias.masked_fill_(~keys, float("-inf"))
    return _Part(torch.where(keys, slots, 0), bias.repeat_interleave(kh, 0)[:, None, :])


# ---- decode attention (per layer) ----------------------------------------------------------

def _padded_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _DecodeMeta,
                   scaling: float) -> torch.Tensor:
    b, h, d = q.shape
    kh = k_buf.shape[1]
    kk = _gather(k_buf, meta.slots).view(b, meta.lmax, kh, d).transpose(1, 2)  # [B, KH, L, D]
    vv = _gather(v_buf, meta.slots).view(b, meta.lmax, kh, d).transpose(1, 2)
    qg = q.view(b, kh, h // kh, d)  # the G query heads of a KV head act as G queries
    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=meta.mask, scale=scaling)
    return o.reshape(b, h, d)


def _cascade_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: _CascadeMeta,
                    scaling: float) -> torch.Tensor:
    b, h, d = q.shape
    kh = k_buf.shape[1]
    g = h // kh
    qf = (q.float() * scaling).reshape(b * kh, g * d)  # row (b, j): b's G queries on KV head j
    # (1) shared: per (group, KV head) the N·G queries of its requests vs its C prefix keys
    qs = qf.index_select(0, meta.q_rows).view(-1, meta.width * g, d)
    o1, lse1 = _attend(qs, k_buf, v_buf, meta.prefix)  # [NG·KH, N·G, D], [NG·KH, N·G]
    o1 = o1.reshape(-1, g * d).index_select(0, meta.out_rows).view(b, h, d)
    lse1 = lse1.reshape(-1, g).index_select(0, meta.out_rows).view(b, h) + meta.no_shared
    # (2) private: per (request, KV head) its G queries vs its P tail keys
    o2, lse2 = _attend(qf.view(b * kh, g, d), k_buf, v_buf, meta.tail)  # [B·KH, G, D]
    # (3) merge: (o1·e^lse1 + o2·e^lse2) / (e^lse1 + e^lse2) = lerp(o2, o1, sigmoid(lse1 - lse2))
    w1 = torch.sigmoid(lse1 - lse2.view(b, h)).unsqueeze(-1)  # [B, H, 1]
    return torch.lerp(o2.view(b, h, d), o1, w1).to(q.dtype)


def _attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
            part: _Part) -> tuple[torch.Tensor, torch.Tensor]:
    """q float32 [X·KH, n, D], pre-scaled, vs the part's keys → float32 (o [X·KH, n, D],
    lse [X·KH, n])."""
    k, v = _gather_heads(k_buf, part), _gather_heads(v_buf, part)  # [X·KH, L, D]
    s = torch.bmm(q, k.transpose(1, 2))  # [X·KH, n, L]
    if part.bias is not None:
        s.add_(part.bias)
    m = s.amax(-1, keepdim=True)  # finite: every sequence has a key
    p = s.sub_(m).exp_()
    total = p.sum(-1, keepdim=True)
    return torch.bmm(p, v).div_(total), (m + total.log()).squeeze(-1)


def _gather_heads(buf: torch.Tensor, part: _Part) -> torch.Tensor:
    """The part's rows of a [N, KH, D] buffer → float32 [X·KH, L, D] (one converting copy)."""
    _, kh, d = buf.shape
    x, length = part.slots.shape
    rows = _gather(buf, part.slots.reshape(-1)).view(x, length, kh, d).transpose(1, 2)  # [X, KH, L, D]
    return buf.new_empty(rows.shape, dtype=torch.float32).copy_(rows).view(x * kh, length, d)


# ---- helpers --------------------------------------------------------------------------------

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
