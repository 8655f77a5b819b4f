"""Split-KV (flash-decoding) attention of one new token per request over the paged KV buffers.

Request b's query ``q[b]`` (``[H, D]``) attends to the keys/values in slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of k_buffer/v_buffer
(``[num_slots, KH, D]``); the new token's own K/V must already be stored.

Stage 1, grid ``(B, KH, num_kv_splits)``: the program for (b, KV head j,
split s) takes the G = H / KH query heads of KV head j as the rows of one
``[BLOCK_H, D]`` tile (BLOCK_H = max(16, G), padding rows masked), so each
K/V tile it gathers is read once for all G heads and the scores are one
tl.dot. Split s covers keys ``[s·L, min((s+1)·L, seq_len))`` with
L = ceil(seq_len / num_kv_splits) rounded up to BLOCK_N; it writes its
normalised partial output and its log-sum-exp (natural log, of the scaled
scores; ``close_split``), both float32, to ``partial_o [B, H, S, D]`` /
``partial_lse [B, H, S]``. An empty split writes o = 0, lse = -inf.

Stage 2, grid ``(B, H)``: ``o = Σ_s e^(lse_s - m) · o_s / Σ_s e^(lse_s - m)``,
m = max_s lse_s, all S splits loaded as one ``[BLOCK_S, D]`` tile.

With a sliding window W the token (the request's last key) sees only the keys
``[max(0, seq_len - W), seq_len)``: the splits divide those keys alone, so no slot
before them is read and the work follows W. A soft cap c turns each score into
c·tanh(s / c) (``scale_scores``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixrt_kernels.triton._common import (
    INTERPRET,
    check_attention_tensors,
    check_block,
    check_device,
    check_kv_index,
    check_launch_options,
    check_shape,
    check_sm_scale,
    group_rows,
    head_meta,
    log2_scale,
    next_power_of_2,
    row_head_strides,
    scale_scores,
    window_args,
    window_meta,
)

MAX_KV_SPLITS = 64


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Stage-1 tile and launch options; block_n a power of two >= 16 (tl.dot)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_block("block_n", self.block_n)
        check_launch_options(self.num_warps, self.num_stages)


INTERPRETER_CONFIG = DecodeConfig(block_n=16, num_warps=4, num_stages=1)


def default_decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """Untuned GPU defaults, checked to compile for sm_90 without register spills (fp32 runs
    exact FMA dots, which need smaller tiles at large head dims); small tiles under the
    interpreter."""
    if INTERPRET:
        return INTERPRETER_CONFIG
    if head_dim > 128:
        if dtype == torch.float32:
            return DecodeConfig(block_n=32, num_warps=8, num_stages=1)
        return DecodeConfig(block_n=64, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3)


def launch_meta(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    config: DecodeConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> dict[str, object]:
    """Stage 1's constexprs and launch options for these shapes and a layer's window and soft
    cap (also used by the compile test)."""
    cfg = config or default_decode_config(head_dim, dtype)
    group = heads // kv_heads
    return (
        head_meta(dtype, group, head_dim, exact=True)
        | dict(
            BLOCK_H=group_rows(group),
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        | window_meta(window, softcap)
    )


class DecodeWorkspace(NamedTuple):
    """Stage-1 outputs: float32 ``partial_o [B, H, S, D]`` and ``partial_lse [B, H, S]``."""

    partial_o: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(
        cls, batch: int, heads: int, head_dim: int, num_kv_splits: int, device: torch.device | str
    ) -> DecodeWorkspace:
        return cls(
            torch.empty(batch, heads, num_kv_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, heads, num_kv_splits, dtype=torch.float32, device=device),
        )

    def strides(self) -> tuple[int, ...]:
        """The kernels' workspace strides: stride_pob, stride_poh, stride_pos, stride_plb,
        stride_plh (both last dims contiguous)."""
        po, pl = self
        return (po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1))


def workspace_for(
    q: torch.Tensor, num_kv_splits: int, workspace: DecodeWorkspace | None = None
) -> DecodeWorkspace:
    """``workspace``, checked to fit q ``[B, H, D]`` and ``num_kv_splits``; None allocates one."""
    batch, heads, head_dim = q.shape
    if workspace is None:
        return DecodeWorkspace.allocate(batch, heads, head_dim, num_kv_splits, q.device)
    check_workspace(workspace, (batch, heads, num_kv_splits, head_dim), q.device)
    return workspace


def choose_num_kv_splits(
    batch: int, kv_heads: int, max_seq_len: int, num_sms: int, min_split_len: int = 256
) -> int:
    """Enough splits for ~4 stage-1 programs per SM, none shorter than ``min_split_len`` keys."""
    wanted = -(-4 * num_sms // max(1, batch * kv_heads))
    longest = -(-max_seq_len // min_split_len)
    return max(1, min(wanted, longest, MAX_KV_SPLITS))


@triton.jit
def _decode_stage1(
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
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    first = 0  # the first key the token sees
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(seq_len, lo + split_len)

    group = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    mask_d = dims < HEAD_DIM
    mask_hd = (group < GROUP)[:, None] & mask_d[None, :]
    q = tl.load(
        Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=mask_hd, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        mask_n = start + cols < hi
        slots = tl.load(Kv_indices + kv_start + start + cols, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_buf + slots[:, None] * stride_kbs + kv_head * stride_kbh + dims[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [N, D]
        v = tl.load(
            V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + dims[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = scale_scores(qk, qk_scale, cap_in, cap_out, SOFTCAP)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    o, lse = close_split(acc, m_i, l_i)
    tl.store(
        Partial_o
        + req * stride_pob
        + heads[:, None] * stride_poh
        + split * stride_pos
        + dims[None, :],
        o,
        mask=mask_hd,
    )
    tl.store(Partial_lse + req * stride_plb + heads * stride_plh + split, lse, mask=group < GROUP)


@triton.jit
def close_split(acc, m, l):
    """One split's normalised output [M, D] and log-sum-exp [M] (natural log) from its online
    softmax state (acc [M, D], m [M] in log2 units, l [M]); a row that saw no key (l = 0)
    gets an output of 0 and -inf."""
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return o, lse


@triton.jit
def _decode_stage2(
    Partial_o,
    Partial_lse,
    O,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    mask_s = splits < NUM_SPLITS
    mask_sd = mask_s[:, None] & (dims < HEAD_DIM)[None, :]
    lse = tl.load(
        Partial_lse + req * stride_plb + head * stride_plh + splits,
        mask=mask_s,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # only for an empty sequence: output 0
    w = tl.exp(lse - m)
    part = tl.load(
        Partial_o
        + req * stride_pob
        + head * stride_poh
        + splits[:, None] * stride_pos
        + dims[None, :],
        mask=mask_sd,
        other=0.0,
    )
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        O + req * stride_ob + head * stride_oh + dims,
        o.to(O.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    workspace: DecodeWorkspace | None = None,
    config: DecodeConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write each request's attention over its KV slots into o; return o.

    q, o ``[B, H, D]``; k_buffer, v_buffer ``[num_slots, KH, D]``, one dtype;
    H a multiple of KH; kv_indptr int32/int64 ``[B + 1]``, every segment
    non-empty; kv_indices int32/int64. ``workspace`` (from
    ``DecodeWorkspace.allocate(B, H, D, num_kv_splits, device)``) may be
    reused across layers; None allocates one. ``window``: only each request's
    last ``window`` keys are read and attended; ``softcap``: scores soft-capped.
    """
    check_decode_tensors(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, sm_scale)
    window_values = window_args(sm_scale, window, softcap)
    if not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(
            f"num_kv_splits must be an int in [1, {MAX_KV_SPLITS}], got {num_kv_splits!r}"
        )
    ws = workspace_for(q, num_kv_splits, workspace)
    batch, heads, head_dim = q.shape
    if batch == 0:
        return o
    meta = launch_meta(q.dtype, heads, k_buffer.shape[1], head_dim, config, window, softcap)
    _decode_stage1[(batch, k_buffer.shape[1], num_kv_splits)](
        *split_kernel_args(
            q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale, ws, window_values
        ),
        **meta,
    )
    _decode_stage2[(batch, heads)](
        *ws,
        o,
        *ws.strides(),
        *row_head_strides(o),
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=next_power_of_2(num_kv_splits),
        BLOCK_D=meta["BLOCK_D"],
        num_warps=4,
    )
    return o


def split_kernel_args(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    ws: DecodeWorkspace,
    window_values: tuple[int, float, float],
) -> tuple[object, ...]:
    """The positional arguments, Q to stride_plh, of a kernel writing one split per program
    (``_decode_stage1`` here, the deterministic ``_decode_split_kernel`` too);
    ``window_values``: ``window_args``'s first part."""
    return (
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        *ws,
        log2_scale(sm_scale),
        *window_values,
        *row_head_strides(q, k_buffer, v_buffer),
        *ws.strides(),
    )


def check_decode_tensors(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
) -> None:
    """The arguments every decode kernel takes (also checked by the deterministic one)."""
    check_attention_tensors(q, o, k_buffer, v_buffer)
    check_kv_index(kv_indptr, kv_indices, q.shape[0], k_buffer.shape[0], q.device)
    check_sm_scale(sm_scale)


def check_workspace(
    ws: DecodeWorkspace, shape: tuple[int, int, int, int], device: torch.device
) -> None:
    """float32 ``partial_o`` of ``shape`` [B, H, S, D] and ``partial_lse`` [B, H, S] on device."""
    for name, t, want in (
        ("workspace.partial_o", ws.partial_o, shape),
        ("workspace.partial_lse", ws.partial_lse, shape[:3]),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor")
        check_shape(name, t, want)
        check_device(name, t, device)
    if ws.partial_o.stride(-1) != 1 or ws.partial_lse.stride(-1) != 1:
        raise ValueError("workspace tensors must have a contiguous last dim")
