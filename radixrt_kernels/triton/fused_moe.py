"""Fused mixture-of-experts MLP: each token's k experts' SiLU-gated MLPs, weighted and summed.

``fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights)``: x [T, H]; w_gate_up [E, 2I, H]
(expert e's gate rows, then its up rows); w_down [E, H, I]; topk_ids [T, k] (int, rank order);
topk_weights [T, k] (float32, or x's dtype) → out [T, H] in x's dtype, where

    out[t] = Σ_r down_e(silu(x[t]·gate_eᵀ) · (x[t]·up_eᵀ)) · topk_weights[t, r],  e = topk_ids[t, r]

with transformers' roundings: gate and up rounded to x's dtype, silu(gate) rounded, its
product with up rounded, the down projection rounded, its product with the weight in the
promoted dtype (float32 weights: float32), the k products added in float32 in rank order and
rounded once. ``fused_moe_reference`` is the same in PyTorch.

Steps, without a host sync:

1. ``align_by_expert``: the T·k (token, rank) pairs p = t·k + r sorted by expert (by p within
   one), each expert's run padded to a multiple of ``BLOCK_M`` with the sentinel T·k; each
   block of ``BLOCK_M`` pairs has one expert (``E`` past the last run: its programs exit).
2. ``_gate_up_kernel``, grid (blocks, I / BLOCK_N): a block's tokens times its expert's gate
   and up tiles, two float32 accumulators over H in ``BLOCK_K`` chunks → h [T·k, I].
3. ``_down_kernel``, grid (blocks, H / BLOCK_N): h times the expert's down tile, times the
   pair's weight → pair outputs [T·k, H].
4. ``_combine_kernel``, grid (T, H / BLOCK_H): each token's k pair outputs in rank order.

Every output element is written by one program (no atomics), and the tiling (``MoeTiling``)
does not depend on T: a token's reductions run in the same chunks whatever tokens share the
call. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (bf16 is widened after each
load there, ``UPCAST``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixrt_kernels.triton._common import (
    INDEX_DTYPES,
    check_block,
    check_device,
    check_float,
    check_launch_options,
    check_shape,
    dot_precision,
    upcast_after_load,
)


class MoeTiling(NamedTuple):
    """Tile sizes (powers of two >= 16) and launch options of the kernels."""

    block_m: int = 16  # pairs per block: few tokens reach one expert in a decode step
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2


COMBINE_BLOCK = 256  # columns of H per combine program


def default_tiling(dtype: torch.dtype) -> MoeTiling:
    """The tiling for ``dtype`` (float32 tiles take twice the bytes: a shorter K chunk)."""
    return MoeTiling(block_k=32, num_stages=2) if dtype == torch.float32 else MoeTiling()


def launch_meta(dtype: torch.dtype, tiling: MoeTiling) -> dict[str, object]:
    """The constexprs and launch options the gate-up and down kernels share."""
    return dict(
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        UPCAST=upcast_after_load(dtype),
        DOT_PRECISION=dot_precision(dtype, exact=True),
        BF16=dtype == torch.bfloat16,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        enable_fp_fusion=False,
    )


def combine_meta(dtype: torch.dtype, top_k: int) -> dict[str, object]:
    """The combine kernel's constexprs and launch options."""
    return dict(
        TOP_K=top_k, BLOCK_H=COMBINE_BLOCK, BF16=dtype == torch.bfloat16, enable_fp_fusion=False
    )


@triton.jit
def _load(ptrs, mask, UPCAST: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _rounded(x, Like, BF16: tl.constexpr):
    """float32 x rounded to nearest (even) in the element type of pointer ``Like`` and widened
    back. bf16 rounds by its bits: the interpreter's float32 → bf16 cast truncates, and the
    cast of an already rounded value is exact on both."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(Like.dtype.element_ty).to(tl.float32)


@triton.jit
def _gate_up_kernel(
    X,
    W,
    Hbuf,
    Pairs,
    BlockExpert,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    hidden,
    inter,
    num_pairs,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(Pairs + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = X + tokens[:, None] * stride_xt + ks[None, :]  # [M, K]
    gate_ptrs = W + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [K, N]
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        a = _load(a_ptrs, valid[:, None] & k_ok[None, :], UPCAST)
        gate = _load(gate_ptrs, k_ok[:, None] & col_ok[None, :], UPCAST)
        up = _load(up_ptrs, k_ok[:, None] & col_ok[None, :], UPCAST)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    gate = _rounded(acc_gate, Hbuf, BF16)
    act = _rounded(gate / (1.0 + tl.exp(-gate)), Hbuf, BF16)
    h = _rounded(act * _rounded(acc_up, Hbuf, BF16), Hbuf, BF16)
    mask = valid[:, None] & col_ok[None, :]
    tl.store(
        Hbuf + pairs[:, None] * stride_ht + cols[None, :], h.to(Hbuf.dtype.element_ty), mask=mask
    )


@triton.jit
def _down_kernel(
    Hbuf,
    W,
    Weights,
    P,
    Pairs,
    BlockExpert,
    stride_ht,
    stride_we,
    stride_wn,
    stride_pt,
    hidden,
    inter,
    num_pairs,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16: tl.constexpr,
    P_BF16: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(Pairs + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = Hbuf + pairs[:, None] * stride_ht + ks[None, :]  # [M, K]
    w_ptrs = W + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + ks < inter
        a = _load(a_ptrs, valid[:, None] & k_ok[None, :], UPCAST)
        down = _load(w_ptrs, k_ok[:, None] & col_ok[None, :], UPCAST)
        acc = tl.dot(a, down, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = _rounded(acc, Hbuf, BF16)
    weight = tl.load(Weights + pairs, mask=valid, other=0.0).to(tl.float32)
    mask = valid[:, None] & col_ok[None, :]
    out = _rounded(y * weight[:, None], P, P_BF16).to(P.dtype.element_ty)
    tl.store(P + pairs[:, None] * stride_pt + cols[None, :], out, mask=mask)


@triton.jit
def _combine_kernel(
    P,
    Out,
    stride_pt,
    stride_ot,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    row = P + token * TOP_K * stride_pt + cols
    acc = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, TOP_K):
        acc += tl.load(row + r * stride_pt, mask=mask, other=0.0).to(tl.float32)
    out = _rounded(acc, Out, BF16).to(Out.dtype.element_ty)
    tl.store(Out + token * stride_ot + cols, out, mask=mask)


class Alignment(NamedTuple):
    """``align_by_expert``'s result: ``pairs`` int32 [blocks · block_m] (pair ids, the
    sentinel T·k as padding) and ``block_expert`` int32 [blocks] (E past the last run)."""

    pairs: torch.Tensor
    block_expert: torch.Tensor


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The (token, rank) pairs of ``topk_ids`` [T, k] in blocks of ``block_m`` of one expert
    each (module text, step 1); the block count is a bound from the shapes alone, so nothing
    waits for the device (a CUDA graph may hold it)."""
    flat = topk_ids.reshape(-1).long()
    n, device = flat.numel(), flat.device
    capacity = -(-(n + min(n, num_experts) * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount's size would need a sync
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in ``order``
    rank = torch.arange(n, device=device) - first[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    pairs = torch.full((capacity,), n, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return Alignment(pairs, block_expert)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiling: MoeTiling | None = None,
) -> torch.Tensor:
    """The experts' weighted sum per token (module text) → [T, H] in x's dtype."""
    _check_args(x, w_gate_up, w_down, topk_ids, topk_weights)
    tiling = tiling or default_tiling(x.dtype)
    _check_tiling(tiling)
    (t, hidden), (num_experts, two_inter, _), k = x.shape, w_gate_up.shape, topk_ids.shape[1]
    inter, num_pairs = two_inter // 2, t * k
    out = torch.empty_like(x)
    if t == 0:
        return out
    align = align_by_expert(topk_ids, num_experts, tiling.block_m)
    blocks = align.block_expert.numel()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    product = torch.promote_types(x.dtype, topk_weights.dtype)  # the weighted outputs' dtype
    p = torch.empty(num_pairs, hidden, dtype=product, device=x.device)
    meta = launch_meta(x.dtype, tiling)
    _gate_up_kernel[(blocks, triton.cdiv(inter, tiling.block_n))](
        x,
        w_gate_up,
        h,
        align.pairs,
        align.block_expert,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        h.stride(0),
        hidden,
        inter,
        num_pairs,
        num_experts,
        TOP_K=k,
        **meta,
    )
    weights = topk_weights.reshape(-1)
    _down_kernel[(blocks, triton.cdiv(hidden, tiling.block_n))](
        h,
        w_down,
        weights,
        p,
        align.pairs,
        align.block_expert,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        p.stride(0),
        hidden,
        inter,
        num_pairs,
        num_experts,
        P_BF16=p.dtype == torch.bfloat16,
        **meta,
    )
    _combine_kernel[(t, triton.cdiv(hidden, COMBINE_BLOCK))](
        p,
        out,
        p.stride(0),
        out.stride(0),
        hidden,
        **combine_meta(x.dtype, k),
    )
    return out


def fused_moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe`` in PyTorch: matmuls in float32, the same roundings, one expert at a time."""
    t, k = topk_ids.shape
    dtype, inter = x.dtype, w_down.shape[2]
    flat = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    outputs = torch.empty(t * k, x.shape[1], dtype=torch.promote_types(dtype, weights.dtype))
    outputs = outputs.to(x.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        gate_up = (x[pairs // k].float() @ w_gate_up[e].float().T).to(dtype).float()
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        h = (F.silu(gate).to(dtype).float() * up).to(dtype).float()
        y = (h @ w_down[e].float().T).to(dtype)
        outputs[pairs] = y * weights[pairs, None]
    acc = outputs.view(t, k, -1)[:, 0].float()
    for r in range(1, k):
        acc = acc + outputs.view(t, k, -1)[:, r]
    return acc.to(dtype)


def _check_args(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    """Shapes, dtypes, layouts and devices (and, on CPU, the expert ids' range)."""
    check_float("x", x, 2)
    check_float("w_gate_up", w_gate_up, 3, x.dtype)
    check_float("w_down", w_down, 3, x.dtype)
    (t, hidden), num_experts = x.shape, w_gate_up.shape[0]
    if w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != hidden:
        raise ValueError(f"w_gate_up must be [E, 2I, {hidden}], got {tuple(w_gate_up.shape)}")
    check_shape("w_down", w_down, (num_experts, hidden, w_gate_up.shape[1] // 2))
    _check_routing(topk_ids, topk_weights, t, num_experts, x.dtype)
    tensors = dict(x=x, w_gate_up=w_gate_up, w_down=w_down)
    for name, tensor in {**tensors, "topk_ids": topk_ids, "topk_weights": topk_weights}.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        check_device(name, tensor, x.device)


def _check_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tokens: int,
    num_experts: int,
    dtype: torch.dtype,
) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError("topk_ids must be an int32 or int64 tensor")
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != tokens
        or not 0 < topk_ids.shape[1] <= num_experts
    ):
        raise ValueError(
            f"topk_ids must be [{tokens}, k] with 0 < k <= {num_experts}, got "
            f"{tuple(topk_ids.shape)}"
        )
    check_float("topk_weights", topk_weights, 2)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_weights.dtype not in (torch.float32, dtype):
        raise ValueError(
            f"topk_weights has dtype {topk_weights.dtype}, expected float32 or {dtype} (x's)"
        )
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        if int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts:
            raise ValueError(f"topk_ids holds expert ids outside [0, {num_experts})")


def _check_tiling(tiling: MoeTiling) -> None:
    for name in ("block_m", "block_n", "block_k"):
        check_block(name, getattr(tiling, name))
    check_launch_options(tiling.num_warps, tiling.num_stages)
