"""Deterministic decode and extend attention: every query reduced over fixed key splits.

The contract (SGLang's ``--enable-deterministic-inference``): the output row of a query
(one head of the token at position p of a request, seeing keys 0..p) has the same bits
whatever the batch around it, however many splits the grid has, however its keys divide
into cached and new, and whether decode or extend computed it.

Per query row, in both kernels:
1. The keys are cut into splits of ``SPLIT_LEN`` keys at absolute offsets ``s·SPLIT_LEN``
   from key 0, each split into ``BLOCK_N``-key chunks from its start; the row's last split
   and chunk are masked past its own last key (key p).
2. ``attend_split`` runs the online softmax of one split chunk by chunk in key order (fp32,
   exp2 with the scale folded in); ``close_split`` (the split-count decode's too) gives its
   normalised output and log-sum-exp.
3. ``merge_split`` folds the splits s = 0, 1, ... in that order into a running weighted sum,
   and ``finish`` divides by the total weight.
Both kernels call these helpers with one set of constexprs (``launch_meta``) on tiles of one
shape: ``[BLOCK_M, BLOCK_D]`` queries against ``[BLOCK_N, BLOCK_D]`` keys. In decode the
BLOCK_M rows are the G query heads of one KV head (BLOCK_M = max(16, G), as in
``decode_attention``); in extend they are BLOCK_M new tokens of one query head. A chunk or
split wholly past a row's last key is an exact no-op for that row (scale 1, weight 0), so
the other rows of a tile never change a row's bits.

Decode, grid ``(B, KH, S)`` then ``(B, KH)``: stage-1 program (b, j, s) writes split s's
output and log-sum-exp (natural log) into the workspace, or nothing when request b has no
key there; stage 2 merges request b's ``cdiv(seq_len, SPLIT_LEN)`` splits in order. S, from
``max_seq_len``, only bounds the grid; it never moves a split boundary.

Extend, grid ``(cdiv(max_extend_len, BLOCK_M), H, B)``: a program takes BLOCK_M new tokens
of one query head through the three steps. It reads every key, cached or new, through
``kv_indices`` over the whole sequence (prefix then new tokens, whose K/V are stored
first), so where the cache hit ends is invisible to the arithmetic.

Sliding windows (``window`` W) and soft caps: a row sees only the keys from its position
- W + 1 on (``row_lo``), masked as keys past ``row_end`` are. The boundaries do not move: a
program skips the splits before its rows' least window start, and its first split's chunks
before the chunk that holds it (no slot there is read); a chunk or split wholly before a row's
window start is, for that row, an exact no-op (an all -inf maximum counts as 0, an empty split
merges with weight 0), so a row's bits stay its own. A soft cap c turns each score into
c·tanh(s / c) (``scale_scores``), the same code in both kernels.

Under ``TRITON_INTERPRET=1`` the float32 arithmetic is numpy's, so bit equality there shows
that the ORDER of the reduction is canonical: the same chunks, splits, merge order and tile
shapes. On a GPU the same order holds; tl.dot's internal order is the hardware's, which
for one instruction and tile shape is the same for every row. Launches turn off FMA
contraction (``enable_fp_fusion=False``) so the two kernels round the shared code alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixrt_kernels.triton._common import (
    INTERPRET,
    check_attention_tensors,
    check_block,
    check_launch_options,
    check_max_len,
    check_sm_scale,
    group_rows,
    head_meta,
    log2_scale,
    row_head_strides,
    scale_scores,
    window_args,
    window_meta,
)
from radixrt_kernels.triton.decode_attention import (
    DecodeWorkspace,
    check_decode_tensors,
    close_split,
    split_kernel_args,
    workspace_for,
)
from radixrt_kernels.triton.extend_attention import check_extend_index, extend_grid


@dataclass(frozen=True, slots=True)
class FixedSplitConfig:
    """Keys per split, keys per chunk and launch options, one config for decode and extend.

    ``split_len`` is a multiple of ``block_n``, a power of two >= 16 (tl.dot). The two sizes
    place every boundary of the reduction: a replica changing either changes the bits.
    """

    split_len: int = 256
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_block("block_n", self.block_n)
        if self.split_len < self.block_n or self.split_len % self.block_n:
            raise ValueError(
                f"split_len ({self.split_len}) must be a positive multiple of "
                f"block_n ({self.block_n})"
            )
        check_launch_options(self.num_warps, self.num_stages)


#: Under the interpreter: two 16-key chunks per split, so short test sequences span splits.
INTERPRETER_CONFIG = FixedSplitConfig(split_len=32, block_n=16, num_warps=4, num_stages=1)
GPU_SPLIT_LEN = 256


def default_fixed_split_config(
    head_dim: int, dtype: torch.dtype = torch.bfloat16, masked: bool = False
) -> FixedSplitConfig:
    """Untuned GPU tiles with ``GPU_SPLIT_LEN`` keys per split, checked to compile for sm_90
    without register spills at the usual group sizes (fp32 runs exact FMA dots, which want
    smaller chunks), ``masked`` (a layer with a sliding window or a soft cap) too: it changes
    only the pipelining, never a boundary, so the workspace and the bits are as without;
    small tiles under the interpreter."""
    if INTERPRET:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        if head_dim > 128:
            return FixedSplitConfig(GPU_SPLIT_LEN, block_n=16, num_warps=8, num_stages=1)
        stages = 1 if masked else 2  # a window's masks need the registers a second stage takes
        return FixedSplitConfig(GPU_SPLIT_LEN, block_n=32, num_warps=8, num_stages=stages)
    if head_dim > 128:
        return FixedSplitConfig(GPU_SPLIT_LEN, block_n=32, num_warps=8, num_stages=2)
    return FixedSplitConfig(GPU_SPLIT_LEN, block_n=64, num_warps=4, num_stages=2)


def num_fixed_splits(max_seq_len: int, config: FixedSplitConfig) -> int:
    """Splits of the longest sequence: the decode grid's and workspace's split axis S."""
    return max(1, -(-max_seq_len // config.split_len))


def launch_meta(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    config: FixedSplitConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> dict[str, object]:
    """The constexprs and launch options of decode stage 1 and of extend for a layer's window
    and soft cap: one dict, so a query row meets the same tile shapes and instructions in
    both."""
    masked = window is not None or softcap is not None
    cfg = config or default_fixed_split_config(head_dim, dtype, masked)
    group = heads // kv_heads
    return (
        head_meta(dtype, group, head_dim, exact=True)
        | dict(
            BLOCK_M=group_rows(group),
            BLOCK_N=cfg.block_n,
            SPLIT_LEN=cfg.split_len,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            enable_fp_fusion=False,
        )
        | window_meta(window, softcap)
    )


def merge_meta(meta: dict[str, object]) -> dict[str, object]:
    """Decode stage 2's constexprs and launch options, taken from stage 1's."""
    keys = ("HEAD_DIM", "GROUP", "BLOCK_M", "BLOCK_D", "SPLIT_LEN", "num_warps")
    return {k: meta[k] for k in keys} | {"enable_fp_fusion": False}


def fixed_split_workspace(
    q: torch.Tensor, max_seq_len: int, config: FixedSplitConfig | None = None
) -> DecodeWorkspace:
    """A decode workspace for q ``[B, H, D]`` and sequences of up to ``max_seq_len`` keys."""
    cfg = config or default_fixed_split_config(q.shape[2], q.dtype)
    return workspace_for(q, num_fixed_splits(max_seq_len, cfg))


# ---- the per-row reduction both kernels share -----------------------------------------------


@triton.jit
def attend_split(
    q,
    K_buf,
    V_buf,
    Kv_indices,
    kv_start,
    kv_head,
    lo,
    hi,
    row_lo,
    row_end,
    qk_scale,
    cap_in,
    cap_out,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax of q ``[M, D]`` over the keys lo..hi-1 of one split, row r seeing only
    keys < row_end[r] (WINDOWED: and >= row_lo[r]; the chunks before the one holding the least
    row_lo skipped, no key before that read), in BLOCK_N chunks from lo → (acc [M, D], m [M]
    in log2 units, l [M]). A row that sees no key gets acc 0, m -inf, l 0."""
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    mask_d = dims < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = 0  # the least first key of the rows, and the chunk that holds it
    chunk = lo
    if WINDOWED:
        first = tl.min(row_lo, 0)
        chunk = tl.maximum(lo, first // BLOCK_N * BLOCK_N)
    for start in range(chunk, hi, BLOCK_N):
        keys = start + cols
        mask_n = keys < hi
        if WINDOWED:
            mask_n &= keys >= first
        slots = tl.load(Kv_indices + kv_start + keys, mask=mask_n, other=0).to(tl.int64)
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_buf + slots[:, None] * stride_kbs + kv_head * stride_kbh + dims[None, :],
            mask=mask_nd,
            other=0.0,
        )  # [N, D]
        v = tl.load(
            V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + dims[None, :],
            mask=mask_nd,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = scale_scores(qk, qk_scale, cap_in, cap_out, SOFTCAP)
        seen = keys[None, :] < row_end[:, None]
        if WINDOWED:
            seen &= keys[None, :] >= row_lo[:, None]
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: all 0
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def merge_split(o_acc, lse_max, w_sum, o_s, lse_s):
    """Fold one split (o_s [M, D], lse_s [M]) into the running sum of the splits before it:
    o_acc [M, D] = Σ e^(lse - lse_max)·o, w_sum [M] = Σ e^(lse - lse_max). A row whose split
    is empty (lse_s -inf) keeps its bits: scale e^0 = 1, weight 0."""
    new_max = tl.maximum(lse_max, lse_s)
    ref = tl.where(new_max == float("-inf"), 0.0, new_max)
    scale = tl.exp(lse_max - ref)
    w = tl.exp(lse_s - ref)
    o_acc = o_acc * scale[:, None] + o_s * w[:, None]
    w_sum = w_sum * scale + w
    return o_acc, new_max, w_sum


@triton.jit
def finish(o_acc, w_sum):
    return o_acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]


# ---- decode ---------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    Q,
    K_buf,
    V_buf,
    Kv_indptr,
    Kv_indices,
    Partial_o,
    Partial_lse,
    qk_scale,
    window,
    cap_in,
    cap_out,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = tl.load(Kv_indptr + req).to(tl.int64)
    seq_len = (tl.load(Kv_indptr + req + 1) - kv_start).to(tl.int32)
    lo = split * SPLIT_LEN
    if lo >= seq_len:
        return
    first = 0  # the first key the token sees
    if WINDOWED:
        first = _window_start(seq_len - 1, window)
        if lo + SPLIT_LEN <= first:  # a split before the window: the merge skips it
            return
    group = tl.arange(0, BLOCK_M)  # rows: the GROUP query heads of this KV head, padded
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    mask_hd = (group < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=mask_hd, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    row_end = tl.full([BLOCK_M], 0, tl.int32) + seq_len
    acc, m, l = attend_split(
        q,
        K_buf,
        V_buf,
        Kv_indices,
        kv_start,
        kv_head,
        lo,
        tl.minimum(seq_len, lo + SPLIT_LEN),
        tl.full([BLOCK_M], 0, tl.int32) + first,
        row_end,
        qk_scale,
        cap_in,
        cap_out,
        stride_kbs,
        stride_kbh,
        stride_vbs,
        stride_vbh,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        UPCAST,
        DOT_PRECISION,
        WINDOWED,
        SOFTCAP,
    )
    o, lse = close_split(acc, m, l)
    po = Partial_o + req * stride_pob + heads[:, None] * stride_poh + split * stride_pos
    tl.store(po + dims[None, :], o, mask=mask_hd)
    tl.store(Partial_lse + req * stride_plb + heads * stride_plh + split, lse, mask=group < GROUP)


@triton.jit
def _window_start(position, window):
    """The first key a token at ``position`` sees under ``window`` (0: none)."""
    return tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)


@triton.jit
def _decode_merge_kernel(
    Partial_o,
    Partial_lse,
    Kv_indptr,
    O,
    window,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = (tl.load(Kv_indptr + req + 1) - tl.load(Kv_indptr + req)).to(tl.int32)
    group = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    mask_h = group < GROUP
    mask_hd = mask_h[:, None] & (dims < HEAD_DIM)[None, :]
    po = Partial_o + req * stride_pob + heads[:, None] * stride_poh + dims[None, :]
    pl = Partial_lse + req * stride_plb + heads * stride_plh
    o_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_M], tl.float32)
    first_split = _window_start(seq_len - 1, window) // SPLIT_LEN  # earlier ones: not written
    for split in range(first_split, tl.cdiv(seq_len, SPLIT_LEN)):
        o_s = tl.load(po + split * stride_pos, mask=mask_hd, other=0.0)
        lse_s = tl.load(pl + split, mask=mask_h, other=float("-inf"))
        o_acc, lse_max, w_sum = merge_split(o_acc, lse_max, w_sum, o_s, lse_s)
    o = finish(o_acc, w_sum)
    out = O + req * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out, o.to(O.dtype.element_ty), mask=mask_hd)


def deterministic_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    max_seq_len: int,
    workspace: DecodeWorkspace | None = None,
    config: FixedSplitConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Like ``decode_attention``, reduced over fixed splits; write into o and return it.

    ``max_seq_len`` bounds every ``kv_indptr`` segment (checked for CPU tensors; on CUDA a
    longer segment would read past the workspace) and sizes the split axis S =
    ``num_fixed_splits(max_seq_len, config)``; any bound gives the same bits. ``workspace``
    is ``[B, H, S, D]`` (``fixed_split_workspace``), reusable across layers; None allocates.
    ``window`` and ``softcap``: as ``decode_attention``'s.
    """
    check_decode_tensors(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, sm_scale)
    window_values = window_args(sm_scale, window, softcap)
    check_max_len("max_seq_len", max_seq_len, kv_indptr)
    batch, heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    masked = window is not None or softcap is not None
    cfg = config or default_fixed_split_config(head_dim, q.dtype, masked)
    splits = num_fixed_splits(max_seq_len, cfg)
    ws = workspace_for(q, splits, workspace)
    if batch == 0:
        return o
    meta = launch_meta(q.dtype, heads, kv_heads, head_dim, cfg, window, softcap)
    _decode_split_kernel[(batch, kv_heads, splits)](
        *split_kernel_args(
            q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale, ws, window_values
        ),
        **meta,
    )
    _decode_merge_kernel[(batch, kv_heads)](
        *ws,
        kv_indptr,
        o,
        window_values[0],
        *ws.strides(),
        *row_head_strides(o),
        **merge_meta(meta),
    )
    return o


# ---- extend ---------------------------------------------------------------------------------


@triton.jit
def _extend_kernel(
    Q,
    O,
    K_buf,
    V_buf,
    Qo_indptr,
    Kv_indptr,
    Kv_indices,
    qk_scale,
    window,
    cap_in,
    cap_out,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)  # last blocks (most keys) first
    head = tl.program_id(1)
    req = tl.program_id(2)
    q_start = tl.load(Qo_indptr + req).to(tl.int64)
    ext_len = (tl.load(Qo_indptr + req + 1) - q_start).to(tl.int32)
    if block_m * BLOCK_M >= ext_len:
        return
    kv_start = tl.load(Kv_indptr + req).to(tl.int64)
    prefix_len = (tl.load(Kv_indptr + req + 1) - kv_start).to(tl.int32) - ext_len
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index i, at key prefix_len + i
    row_end = prefix_len + tl.minimum(rows, ext_len - 1) + 1  # padding rows copy the last
    row_lo = _window_start(row_end - 1, window)
    block_end = prefix_len + tl.minimum(ext_len, (block_m + 1) * BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask_md = (rows < ext_len)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=mask_md,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    o_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_M], tl.float32)
    first_split = 0  # the split of the block's first row's first key
    if WINDOWED:
        first_split = _window_start(prefix_len + block_m * BLOCK_M, window) // SPLIT_LEN
    for split in range(first_split, tl.cdiv(block_end, SPLIT_LEN)):
        lo = split * SPLIT_LEN
        acc, m, l = attend_split(
            q,
            K_buf,
            V_buf,
            Kv_indices,
            kv_start,
            head // GROUP,
            lo,
            tl.minimum(block_end, lo + SPLIT_LEN),
            row_lo,
            row_end,
            qk_scale,
            cap_in,
            cap_out,
            stride_kbs,
            stride_kbh,
            stride_vbs,
            stride_vbh,
            HEAD_DIM,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            UPCAST,
            DOT_PRECISION,
            WINDOWED,
            SOFTCAP,
        )
        o_s, lse_s = close_split(acc, m, l)
        o_acc, lse_max, w_sum = merge_split(o_acc, lse_max, w_sum, o_s, lse_s)
    o = finish(o_acc, w_sum)
    out = O + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out, o.to(O.dtype.element_ty), mask=mask_md)


def deterministic_extend_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
    config: FixedSplitConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens, reduced over fixed splits; write into o, return it.

    q, o ``[T, H, D]``; k_buffer, v_buffer ``[num_slots, KH, D]``, one dtype. Request b's
    new tokens ``qo_indptr[b]:qo_indptr[b+1]`` are the LAST keys of its whole sequence
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (cached prefix, then the new tokens, whose
    K/V must already be stored). max_extend_len sizes the grid; None reads it from qo_indptr
    (a device sync on CUDA). ``window`` and ``softcap``: as ``extend_attention``'s.
    """
    check_attention_tensors(q, o, k_buffer, v_buffer)
    check_extend_index(q, qo_indptr, kv_indptr, kv_indices, k_buffer.shape[0], max_extend_len)
    if kv_indptr.device.type == "cpu" and bool((kv_indptr.diff() < qo_indptr.diff()).any()):
        raise ValueError("kv_indptr has a sequence shorter than its new tokens (qo_indptr)")
    check_sm_scale(sm_scale)
    window_values = window_args(sm_scale, window, softcap)
    if q.shape[0] == 0 or qo_indptr.numel() <= 1:
        return o
    meta = launch_meta(q.dtype, q.shape[1], k_buffer.shape[1], q.shape[2], config, window, softcap)
    _extend_kernel[extend_grid(q, qo_indptr, max_extend_len, meta["BLOCK_M"])](
        q,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        log2_scale(sm_scale),
        *window_values,
        *row_head_strides(q, o, k_buffer, v_buffer),
        **meta,
    )
    return o
