"""Prefix + causal attention for an extend (prefill) batch over the paged KV buffers.

Request b owns the new tokens ``qo_indptr[b]:qo_indptr[b+1]`` of q, k_new,
v_new (``[T, H, D]``, ``[T, KH, D]``) and the prefix whose KV slots are
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` in k_buffer/v_buffer
(``[num_slots, KH, D]``). New token i of request b attends to its whole
prefix and to new tokens 0..i of the same request. The new tokens' K/V are
read from k_new/v_new, so they need not be stored in the buffers first.

Grid ``(cdiv(max_extend_len, BLOCK_M), H, B)``: one program per block of
BLOCK_M queries of one query head of one request (blocks past the request's
length exit at once; the last blocks, which carry the most causal work, start
first). GQA: query head h reads KV head ``h // (H / KH)``;
the G query heads of a KV head are neighbours on grid axis 1, so they run
close together and share its K/V tiles through L2. Per program: a flash
attention loop (online softmax in fp32, exp2 with the scale folded in) over
(1) the prefix in BLOCK_N chunks gathered through kv_indices, (2) the new
keys wholly below the block's diagonal, unmasked, (3) the diagonal chunks,
causally masked. A chunk where a row sees no key yet leaves it as it was
(``_softmax_step``: an all -inf maximum counts as 0).

With a sliding window W, new token i (at key prefix_len + i) sees only the keys from
prefix_len + i - W + 1 on: each row is masked to its own window, and each phase
starts at the block's first row's window start (the prefix phase at that key: no
cached slot before it is read; the new-key phase at the BLOCK_N chunk that holds
it). A soft cap c turns each score into c·tanh(s / c) (``scale_scores``).
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
    check_device,
    check_index,
    check_indptr_values,
    check_kv_index,
    check_launch_options,
    check_max_len,
    check_sm_scale,
    head_meta,
    log2_scale,
    row_head_strides,
    scale_scores,
    window_args,
    window_meta,
)


@dataclass(frozen=True, slots=True)
class ExtendConfig:
    """Tile sizes and launch options; block sizes are powers of two >= 16 (tl.dot)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        if self.block_m % self.block_n:
            raise ValueError(
                f"block_m ({self.block_m}) must be a multiple of block_n ({self.block_n})"
            )
        check_launch_options(self.num_warps, self.num_stages)


#: Small tiles for the interpreter: short test sequences still span several chunks.
INTERPRETER_CONFIG = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


def default_extend_config(
    head_dim: int, dtype: torch.dtype = torch.bfloat16, masked: bool = False
) -> ExtendConfig:
    """Untuned GPU defaults: checked to compile for sm_90 within 227 KB of shared memory and
    without register spills for fp16/bf16 (fp32 runs three-pass TF32 dots and spills a little),
    ``masked`` (a layer with a sliding window or a soft cap) too. Small tiles under the
    interpreter."""
    if INTERPRET:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        if head_dim <= 64:
            return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
        if head_dim <= 128:
            return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
        return ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if head_dim <= 64:  # a window's masks or a soft cap need more registers: 8 warps share them
        return ExtendConfig(block_m=128, block_n=64, num_warps=8 if masked else 4, num_stages=3)
    if head_dim <= 128:
        return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def launch_meta(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    config: ExtendConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> dict[str, object]:
    """The kernel's constexprs and launch options for these shapes and a layer's window and
    soft cap (also used by the compile test)."""
    masked = window is not None or softcap is not None
    cfg = config or default_extend_config(head_dim, dtype, masked)
    return (
        head_meta(dtype, heads // kv_heads, head_dim, exact=False)
        | dict(
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        | window_meta(window, softcap)
    )


@triton.jit
def _load(ptrs, mask, UPCAST: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION: tl.constexpr, WINDOWED: tl.constexpr):
    """Fold one chunk in: qk [M, N] scores in log2 units (-inf where masked), v [N, D]. Under a
    window a row with no key yet and none here keeps acc 0, m -inf, l 0 (without one, every
    row sees a key of its first chunk)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if WINDOWED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _in_window(qk, keys, rows, window, WINDOWED: tl.constexpr):
    """qk [M, N] with -inf where new-key index ``keys[n]`` (negative: a cached key) is before
    the window of new token ``rows[m]`` (keys[n] <= rows[m] - window); as it is without a
    window."""
    if WINDOWED:
        qk = tl.where(keys[None, :] + window > rows[:, None], qk, float("-inf"))
    return qk


@triton.jit
def _extend_kernel(
    Q,
    K_new,
    V_new,
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
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
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
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # Last blocks first: under the causal mask they carry the most work.
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(Qo_indptr + req).to(tl.int64)
    ext_len = (tl.load(Qo_indptr + req + 1) - q_start).to(tl.int32)
    if block_m * BLOCK_M >= ext_len:
        return
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index i within the request
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    mask_d = dims < HEAD_DIM
    mask_md = (rows < ext_len)[:, None] & mask_d[None, :]
    q = _load(
        Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask_md,
        UPCAST,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # (1) the cached prefix, gathered slot by slot
    kv_start = tl.load(Kv_indptr + req).to(tl.int64)
    prefix_len = (tl.load(Kv_indptr + req + 1) - kv_start).to(tl.int32)
    # under a window, row i sees new keys j > i - window (cached keys p > prefix_len + i -
    # window); each phase starts at the block's first row's window
    diag = block_m * BLOCK_M
    prefix_start = 0
    new_start = 0
    if WINDOWED:
        prefix_start = tl.maximum(prefix_len + diag - window + 1, 0)
        new_start = tl.maximum(diag - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(prefix_start, prefix_len, BLOCK_N):
        mask_n = start + cols < prefix_len
        slots = tl.load(Kv_indices + kv_start + start + cols, mask=mask_n, other=0).to(tl.int64)
        kt = _load(
            K_buf + slots[None, :] * stride_kbs + kv_head * stride_kbh + dims[:, None],
            mask_d[:, None] & mask_n[None, :],
            UPCAST,
        )  # [D, N]
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        qk = scale_scores(qk, qk_scale, cap_in, cap_out, SOFTCAP)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        qk = _in_window(qk, start + cols - prefix_len, rows, window, WINDOWED)
        v = _load(
            V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + dims[None, :],
            mask_n[:, None] & mask_d[None, :],
            UPCAST,
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION, WINDOWED)

    # (2) new keys j < block_m·BLOCK_M <= i: causally visible to every row, all < ext_len
    for start in range(new_start, diag, BLOCK_N):
        toks = (q_start + start + cols).to(tl.int64)
        kt = _load(
            K_new + toks[None, :] * stride_knt + kv_head * stride_knh + dims[:, None],
            mask_d[:, None],
            UPCAST,
        )
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        qk = scale_scores(qk, qk_scale, cap_in, cap_out, SOFTCAP)
        qk = _in_window(qk, start + cols, rows, window, WINDOWED)
        v = _load(
            V_new + toks[:, None] * stride_vnt + kv_head * stride_vnh + dims[None, :],
            mask_d[None, :],
            UPCAST,
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION, WINDOWED)

    # (3) the diagonal chunks: key j visible to query i iff j <= i (and j < ext_len)
    for start in range(diag, tl.minimum(ext_len, diag + BLOCK_M), BLOCK_N):
        mask_n = start + cols < ext_len
        toks = (q_start + start + cols).to(tl.int64)
        kt = _load(
            K_new + toks[None, :] * stride_knt + kv_head * stride_knh + dims[:, None],
            mask_d[:, None] & mask_n[None, :],
            UPCAST,
        )
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        qk = scale_scores(qk, qk_scale, cap_in, cap_out, SOFTCAP)
        visible = (start + cols[None, :] <= rows[:, None]) & mask_n[None, :]
        qk = _in_window(tl.where(visible, qk, float("-inf")), start + cols, rows, window, WINDOWED)
        v = _load(
            V_new + toks[:, None] * stride_vnt + kv_head * stride_vnh + dims[None, :],
            mask_n[:, None] & mask_d[None, :],
            UPCAST,
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION, WINDOWED)

    if WINDOWED:  # a padding row may see no key
        l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(
        O + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        o.to(O.dtype.element_ty),
        mask=mask_md,
    )


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
    config: ExtendConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write attention of the new tokens over prefix + themselves (causal) into o; return o.

    q, o ``[T, H, D]``; k_new, v_new ``[T, KH, D]``; k_buffer, v_buffer
    ``[num_slots, KH, D]``, all one dtype; H a multiple of KH. qo_indptr,
    kv_indptr int32/int64 ``[B + 1]``; kv_indices int32/int64. max_extend_len
    (the longest ``qo_indptr`` segment) sizes the grid; None reads it from
    qo_indptr (a device sync on CUDA). A smaller value leaves rows unwritten.
    ``window``: each new token sees only its last ``window`` keys (no cached slot
    before the first token's window is read); ``softcap``: scores soft-capped.
    """
    check_attention_tensors(q, o, k_buffer, v_buffer, {"k_new": k_new, "v_new": v_new})
    check_extend_index(q, qo_indptr, kv_indptr, kv_indices, k_buffer.shape[0], max_extend_len)
    check_sm_scale(sm_scale)
    window_values = window_args(sm_scale, window, softcap)
    if q.shape[0] == 0 or qo_indptr.numel() <= 1:
        return o
    meta = launch_meta(q.dtype, q.shape[1], k_buffer.shape[1], q.shape[2], config, window, softcap)
    _extend_kernel[extend_grid(q, qo_indptr, max_extend_len, meta["BLOCK_M"])](
        q,
        k_new,
        v_new,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        log2_scale(sm_scale),
        *window_values,
        *row_head_strides(q, k_new, v_new, o, k_buffer, v_buffer),
        **meta,
    )
    return o


def extend_grid(
    q: torch.Tensor, qo_indptr: torch.Tensor, max_extend_len: int | None, block_m: int
) -> tuple[int, int, int]:
    """``(cdiv(max_extend_len, block_m), H, B)``: a program per ``block_m`` new tokens of one
    query head of one request. None reads max_extend_len from qo_indptr (a device sync on
    CUDA)."""
    if max_extend_len is None:
        max_extend_len = int(qo_indptr.diff().max())
    return (triton.cdiv(max_extend_len, block_m), q.shape[1], qo_indptr.numel() - 1)


def check_extend_index(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_slots: int,
    max_extend_len: int | None,
) -> None:
    """qo_indptr ``[B + 1]`` over q's tokens, kv_indptr/kv_indices (``check_kv_index``) on
    q's device, and ``max_extend_len``, when given, at least the longest qo segment (values
    checked on CPU only; also checked by the deterministic extend)."""
    check_index("qo_indptr", qo_indptr)
    check_device("qo_indptr", qo_indptr, q.device)
    check_indptr_values("qo_indptr", qo_indptr, q.shape[0])
    check_kv_index(kv_indptr, kv_indices, qo_indptr.numel() - 1, num_slots, q.device)
    if max_extend_len is not None:
        check_max_len("max_extend_len", max_extend_len, qo_indptr)
