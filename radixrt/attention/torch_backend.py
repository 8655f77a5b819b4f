"""Reference attention on CPU (or any device): gather K/V through slots, attend.

Attention over parts of a sequence runs as SDPA that also returns the
log-sum-exp (``_sdpa_lse``: PyTorch's CPU flash kernel, which takes GQA and
strided K/V as they are), and parts are merged by their log-sum-exps:
(o1·e^lse1 + o2·e^lse2) / (e^lse1 + e^lse2) = lerp(o2, o1, sigmoid(lse1 - lse2)).
Output dtype = q dtype.
- Extend: the new tokens of a request attend causally to each other, read
  straight from the new k/v (one SDPA per run of consecutive requests with the
  same extend length); requests with a cached prefix also attend to it, one
  SDPA per group of requests whose cached prefixes are the very same slots
  (its K/V gathered once: requests admitted together under a shared prefix).
- A prefix whose slots are one run of consecutive slots (prefilled in one
  piece: the allocator hands out fresh slots in order) is read in place as a
  view of the KV buffer instead of gathered: in extend (one SDPA per prefix
  either way), and in the cascade's shared part when it has a single group
  (several groups gathered take one SDPA; read in place, one per group, which
  costs more than the gather saves).
- Decode, cascade: requests whose req_to_token rows start with the same run of
  c_g slots (a prefix shared through the radix cache) form a group; groups of
  >= ``MIN_GROUP_SIZE`` requests with c_g >= ``MIN_SHARED_PREFIX`` are used.
  Per layer, (1) each group's prefix K/V is gathered once and all the group's
  queries attend to it; (2) every request's private tail [c_b, seq_len_b),
  padded over the batch, is attended; (3) the two results are merged. The
  query heads of a KV head act as that head's queries: q [B, H, D] is viewed
  [B, KH, G, D] (G = H / KH), with no repeat of K/V. c_g is
  capped at seq_len - 1 so every tail holds at least the new token; a request
  outside every group has an empty shared part (lse -inf, weight 0).
- Decode, no qualifying group: the batch is padded to its longest sequence
  (pad slot 0) and masked, one SDPA.
- On the CPU with the C kernel (``radixrt_kernels.cpu_attention``, fp32/bf16,
  head_dim a multiple of 32), instead of all the above, one call per layer
  that reads K/V in place and also stores the forward's new K/V. Decode: the
  same groups become segments (each shared prefix, then every request's
  private keys). Extend: each request's whole sequence is one causal segment
  for its new tokens. Without it (no C compiler), PyTorch's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from radixrt.model.loader import cache_dir
from radixrt_kernels import cpu_attention as cpu_kernel
from radixrt_kernels import cpu_library

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # → (output, lse)
MIN_GROUP_SIZE = 2
MIN_SHARED_PREFIX = 16
# Cost of one key, in keys of the padded bf16 SDPA path, fitted on a 2-core AMX CPU (bf16,
# KH 3, G 3, D 64; B 8-32, 1-16 groups, prefixes 64-1024, tails 32-512): the cascade runs when
# TAIL_COST·B·P + PREFIX_COST·Σc_g < B·Lmax.
TAIL_COST = 1.5
PREFIX_COST = 3.3


@dataclass
class _ExtendMeta:
    runs: list[tuple[int, int, int]]  # (first token, requests, extend length) of equal-length runs
    # (token indices [n], prefix slots [p], or (first slot, p) when they are consecutive)
    prefix_groups: list[tuple[torch.Tensor, torch.Tensor | tuple[int, int]]]
    prefix_tokens: torch.Tensor | None  # int64: every token with a cached prefix, group by group


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # int64 [B * Lmax], padded with slot 0
    lmax: int
    mask: torch.Tensor   # bool [B, 1, 1, Lmax]


@dataclass
class _Part:
    """X key sequences of up to L slots each (X = groups for prefixes, B for tails)."""
    slots: torch.Tensor        # int64 [X, L], padded with slot 0
    bias: torch.Tensor | None  # [X, 1, 1, L] in the KV dtype: 0 on keys, -inf on padding (None: none)
    runs: list[tuple[int, int]] | None = None  # (first slot, length) per sequence when each is one
    # run of consecutive slots (a prefix prefilled in one piece): read in place, not gathered


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
    """``use_kernel``: attention through the C kernel when it builds and takes the pool's dtype
    (None: whenever it can; False: never, PyTorch's kernels only)."""

    def __init__(self, pool, use_kernel: bool | None = None) -> None:
        super().__init__(pool)
        self.kernel = None
        if use_kernel is not False and pool.device.type == "cpu":
            self.kernel = cpu_library.load(cache_dir())
            if use_kernel and self.kernel is None:
                raise RuntimeError(f"the CPU attention kernel is unavailable: {cpu_library.why_unavailable()}")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        kernel = self.kernel is not None and cpu_kernel.supports(self.pool.k_buffers[0])
        if batch.mode is ForwardMode.DECODE:
            if kernel:
                batch.attn_metadata = cpu_kernel.decode_segments(
                    self.kernel, table, batch.req_rows, batch.seq_lens, MIN_SHARED_PREFIX, MIN_GROUP_SIZE)
                return
            batch.attn_metadata = _decode_metadata(table, batch.req_rows, batch.seq_lens,
                                                   self.pool.kv_heads, self.pool.dtype)
            return
        if kernel:
            batch.attn_metadata = _kernel_extend_metadata(table, batch.req_rows, batch.seq_lens,
                                                          batch.extend_lens)
            return
        batch.attn_metadata = _extend_metadata(table, batch.req_rows, batch.seq_lens, batch.extend_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scaling: float) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        meta = batch.attn_metadata
        if isinstance(meta, cpu_kernel.Segments):  # the kernel stores the new K/V itself
            dt, out_dtype = k_buf.dtype, q.dtype  # q, k, v are read in place (views into qkv)
            if not q.dtype == k.dtype == v.dtype == dt:
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
            o = cpu_kernel.attention(self.kernel, q, k_buf, v_buf, meta, scaling, (k, v, batch.out_cache_loc))
            return o.to(out_dtype)
        self.pool.store_kv(layer_id, batch.out_cache_loc, k, v)
        if isinstance(meta, _CascadeMeta):
            return _cascade_decode(q, k_buf, v_buf, meta, scaling)
        if isinstance(meta, _DecodeMeta):
            return _padded_decode(q, k_buf, v_buf, meta, scaling)
        return _extend(q, k, v, k_buf, v_buf, meta, scaling)


# ---- extend ---------------------------------------------------------------------------------

def _extend_metadata(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int],
                     extend_lens: list[int]) -> _ExtendMeta:
    runs: list[tuple[int, int, int]] = []
    groups: dict[tuple, list] = {}  # (prefix length, first slot, last slot) → [[slots, tokens...]]
    pos = 0
    for row, seq_len, ext in zip(req_rows.tolist(), seq_lens, extend_lens):
        if runs and runs[-1][2] == ext:
            first, n, _ = runs[-1]
            runs[-1] = (first, n + 1, ext)
        else:
            runs.append((pos, 1, ext))
        prefix = seq_len - ext
        if prefix:
            slots = table[row, :prefix]
            same = groups.setdefault((prefix, int(slots[0]), int(slots[-1])), [])
            for group in same:  # requests whose whole cached prefix is the same slots share it
                if torch.equal(group[0], slots):
                    group[1].append(torch.arange(pos, pos + ext))
                    break
            else:
                same.append([slots, [torch.arange(pos, pos + ext)]])
        pos += ext
    prefix_groups = [(torch.cat(tokens).to(table.device), _as_run(slots))
                     for same in groups.values() for slots, tokens in same]
    every = torch.cat([t for t, _ in prefix_groups]) if prefix_groups else None
    return _ExtendMeta(runs, prefix_groups, every)


def _kernel_extend_metadata(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int],
                            extend_lens: list[int]) -> cpu_kernel.Segments:
    """The C kernel's segments for an extend: per request its whole sequence (cached prefix and
    new tokens), causal, with its new tokens as members."""
    dev = table.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
    valid = torch.arange(max(seq_lens), device=dev)[None, :] < lens[:, None]
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    ext = torch.tensor(extend_lens, dtype=torch.int64, device=dev)
    t, s = int(ext.sum()), len(seq_lens)
    return cpu_kernel.Segments(
        slots=table[:, :valid.shape[1]].index_select(0, req_rows)[valid],  # request by request
        slot_start=torch.cat([zero, lens.cumsum(0)]),
        members=torch.arange(t, device=dev),
        member_start=torch.cat([zero, ext.cumsum(0)]),
        part=torch.zeros(s, dtype=torch.int64, device=dev),
        num_parts=torch.ones(t, dtype=torch.int64, device=dev),
        causal=torch.ones(s, dtype=torch.int64, device=dev))


def _as_run(slots: torch.Tensor) -> torch.Tensor | tuple[int, int]:
    """(first slot, length) when ``slots`` [p] are consecutive, else ``slots``."""
    runs = _consecutive_runs(slots[None, :], torch.tensor([slots.numel()], device=slots.device))
    return runs[0] if runs else slots


def _extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
            v_buf: torch.Tensor, meta: _ExtendMeta, scaling: float) -> torch.Tensor:
    """q [T, H, D], the new k/v [T, KH, D] → [T, H, D]: each request's new tokens attend
    causally to each other (run by run of equal lengths, straight from k/v) and, when it has
    one, to its cached prefix (once per group of requests sharing it); the two are merged by
    their log-sum-exps."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device) if meta.prefix_groups else None
    for first, n, ext in meta.runs:
        span = slice(first, first + n * ext)
        qq, kk, vv = (x[span].view(n, ext, -1, d).transpose(1, 2) for x in (q, k, v))
        o, l = _sdpa_lse(qq, kk, vv, scaling, causal=True)  # [n, H, ext, D], [n, H, ext]
        out[span] = o.transpose(1, 2).reshape(n * ext, h, d)
        if lse is not None:
            lse[span] = l.transpose(1, 2).reshape(n * ext, h)
    if not meta.prefix_groups:
        return out
    parts, part_lse = [], []
    for tokens, slots in meta.prefix_groups:
        qq = q.index_select(0, tokens).unsqueeze(0).transpose(1, 2)  # [1, H, n, D]
        if isinstance(slots, tuple):  # consecutive slots: K/V read in place
            kk, vv = _run(k_buf, *slots), _run(v_buf, *slots)          # [1, KH, p, D]
        else:
            kk = _gather(k_buf, slots).unsqueeze(0).transpose(1, 2)
            vv = _gather(v_buf, slots).unsqueeze(0).transpose(1, 2)
        o, l = _sdpa_lse(qq, kk, vv, scaling)
        parts.append(o[0].transpose(0, 1))  # [n, H, D]
        part_lse.append(l[0].transpose(0, 1))  # [n, H]
    rows = meta.prefix_tokens
    o_prefix = torch.cat(parts) if len(parts) > 1 else parts[0]
    w = torch.sigmoid(torch.cat(part_lse) - lse.index_select(0, rows)).unsqueeze(-1)
    merged = torch.lerp(out.index_select(0, rows).float(), o_prefix.float(), w)
    return out.index_copy_(0, rows, merged.to(q.dtype))


# ---- decode metadata (once per step) -------------------------------------------------------

@dataclass
class _StepRows:
    """A decode step's KV rows and its groups of requests sharing a prefix."""
    rows: torch.Tensor         # int64 [B, Lmax]: each request's slots, padded with -1
    lens: torch.Tensor         # int64 [B]
    valid: torch.Tensor        # bool [B, Lmax]: slot positions within each request
    groups: list[torch.Tensor]  # NG × int64 [n_g]: the requests of each qualifying group
    prefix_lens: torch.Tensor  # int64 [NG]: c_g, the length of each group's shared prefix
    start: torch.Tensor        # int64 [B] c_b: first private position, 0 outside groups


def _step_rows(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int]) -> _StepRows:
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=table.device)  # [B]
    lmax = max(seq_lens)
    valid = torch.arange(lmax, device=table.device)[None, :] < lens[:, None]
    rows = torch.where(valid, table[:, :lmax].index_select(0, req_rows), -1)  # [B, Lmax], pad -1
    groups, prefix_lens = _shared_groups(rows, lens)
    start = torch.zeros_like(lens)
    for members, c in zip(groups, prefix_lens.tolist()):
        start.index_fill_(0, members, c)
    return _StepRows(rows, lens, valid, groups, prefix_lens, start)


def _decode_metadata(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int],
                     kh: int, dtype: torch.dtype) -> _DecodeMeta | _CascadeMeta:
    st = _step_rows(table, req_rows, seq_lens)
    lmax = st.rows.shape[1]
    if st.groups:
        b, width = len(seq_lens), int((st.lens - st.start).max())  # P: longest private tail
        if TAIL_COST * b * width + PREFIX_COST * int(st.prefix_lens.sum()) < b * lmax:
            return _cascade_metadata(st.rows, st.lens, st.start, width, st.groups, st.prefix_lens, kh,
                                     dtype)
    return _DecodeMeta(st.rows.clamp(min=0).reshape(-1), lmax, st.valid[:, None, None, :])


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
                      groups: list[torch.Tensor], prefix_lens: torch.Tensor, kh: int,
                      dtype: torch.dtype) -> _CascadeMeta:
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
    prefix_slots = rows[:, :int(prefix_lens.max())].index_select(0, firsts)
    runs = _consecutive_runs(prefix_slots, prefix_lens) if ng == 1 else None  # in place: no bias
    prefix = _part(prefix_slots, prefix_lens, dtype) if runs is None else _Part(prefix_slots, None, runs)
    tail_pos = start[:, None] + torch.arange(width, device=dev)[None, :]  # [B, P]
    tail = _part(rows.gather(1, tail_pos.clamp(max=lmax - 1)), lens - start, dtype)
    return _CascadeMeta(list(zip(groups, prefix_lens.tolist())), n, prefix, tail,
                        q_rows.reshape(-1), out_rows.reshape(-1), no_shared)


def _consecutive_runs(slots: torch.Tensor, lens: torch.Tensor) -> list[tuple[int, int]] | None:
    """[(first slot, length)] of each row of ``slots`` [X, L] if the first lens[x] slots of every
    row are consecutive (first, first + 1, ...); else None."""
    first, offsets = slots[:, 0], torch.arange(slots.shape[1], device=slots.device)[None, :]
    keys = offsets < lens[:, None]
    if not bool(((slots == first[:, None] + offsets) | ~keys).all()):
        return None
    return list(zip(first.tolist(), lens.tolist()))


def _part(slots: torch.Tensor, lens: torch.Tensor, dtype: torch.dtype) -> _Part:
    """slots int64 [X, L], of which the first lens[x] are keys of sequence x."""
    keys = torch.arange(slots.shape[1], device=slots.device)[None, :] < lens[:, None]  # [X, L]
    if bool(keys.all()):
        return _Part(slots, None)
    bias = torch.zeros(keys.shape, dtype=dtype, device=slots.device)
    bias.masked_fill_(~keys, float("-inf"))
    return _Part(torch.where(keys, slots, 0), bias[:, None, None, :])


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
    rows = q.reshape(b * kh, g * d)  # row (b, j): b's G queries on KV head j
    # (1) shared: per (group, KV head) the N·G queries of its requests vs its C prefix keys
    qs = rows.index_select(0, meta.q_rows).view(-1, kh, meta.width * g, d)
    o1, lse1 = _attend(qs, k_buf, v_buf, meta.prefix, scaling)  # [NG, KH, N·G, D], [NG, KH, N·G]
    o1 = o1.reshape(-1, g * d).index_select(0, meta.out_rows).view(b, h, d)
    lse1 = lse1.reshape(-1, g).index_select(0, meta.out_rows).view(b, h) + meta.no_shared
    # (2) private: per (request, KV head) its G queries vs its P tail keys
    o2, lse2 = _attend(q.view(b, kh, g, d), k_buf, v_buf, meta.tail, scaling)  # [B, KH, G, D]
    # (3) merge: (o1·e^lse1 + o2·e^lse2) / (e^lse1 + e^lse2) = lerp(o2, o1, sigmoid(lse1 - lse2))
    w1 = torch.sigmoid(lse1 - lse2.reshape(b, h)).unsqueeze(-1)  # [B, H, 1]
    return torch.lerp(o2.reshape(b, h, d).float(), o1.float(), w1).to(q.dtype)


def _attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, part: _Part,
            scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [X, KH, n, D] vs the part's keys → (o [X, KH, n, D] in q's dtype, float32 lse [X, KH, n])."""
    if part.runs is not None:  # each sequence's K/V read in place: one SDPA per sequence, no bias
        outs = [_sdpa_lse(q[x:x + 1], _run(k_buf, first, n), _run(v_buf, first, n), scaling)
                for x, (first, n) in enumerate(part.runs)]
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])
    k, v = _gather_heads(k_buf, part), _gather_heads(v_buf, part)  # [X, KH, L, D]
    return _sdpa_lse(q, k, v, scaling, bias=part.bias)


def _sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
              causal: bool = False, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [X, H, n, D], k/v [X, KH, L, D] (KH divides H; any strides) → (o [X, H, n, D] in q's
    dtype, float32 lse [X, H, n]). ``causal`` aligns the end of q with the end of k (n == L
    here); ``bias`` [X, 1, 1, L] in q's dtype is added to the scores.

    On the CPU: PyTorch's flash kernel, which returns the log-sum-exp, handles GQA and reads
    strided views in place, accumulating in float32. Elsewhere: the same, as float32 math.
    """
    if q.is_cpu:
        return _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scaling)
    return _sdpa_lse_math(q, k, v, scaling, causal, bias)


def _sdpa_lse_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                   causal: bool = False, bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sdpa_lse`` as plain float32 math (devices without the CPU kernel)."""
    g = q.shape[1] // k.shape[1]
    s = torch.matmul(q.float(), k.float().repeat_interleave(g, 1).transpose(-1, -2)).mul_(scaling)
    if bias is not None:
        s.add_(bias)
    if causal:
        n, length = s.shape[-2:]
        s.masked_fill_(torch.ones(n, length, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v.float().repeat_interleave(g, 1))
    return o.to(q.dtype), lse


def _gather_heads(buf: torch.Tensor, part: _Part) -> torch.Tensor:
    """The part's rows of a [N, KH, D] buffer as a [X, KH, L, D] view (one gathering copy)."""
    _, kh, d = buf.shape
    x, length = part.slots.shape
    return _gather(buf, part.slots.reshape(-1)).view(x, length, kh, d).transpose(1, 2)


# ---- helpers --------------------------------------------------------------------------------

def _run(buf: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Rows [first, first + n) of a [N, KH, D] buffer as a [1, KH, n, D] view (no copy)."""
    return buf[first:first + n].unsqueeze(0).transpose(1, 2)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a [N, KH, D] buffer (index_select: far faster than advanced indexing)."""
    n, kh, d = buf.shape
    return torch.index_select(buf.view(n, kh * d), 0, slots).view(-1, kh, d)
