"""Write new K/V rows into the paged KV buffers: ``k_buffer[slots[i]] = k[i]``.

Shapes: k, v ``[n, kv_heads, head_dim]``; k_buffer, v_buffer
``[num_slots, kv_heads, head_dim]``; slots int32/int64 ``[n]``. Values are
cast to the buffer dtype on store. Grid: one program per (token, block of
BLOCK_H heads); each copies a ``[BLOCK_H, BLOCK_D]`` tile of K and of V.
Duplicate slots are a race (one of the rows wins), as in ``index_put_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrt_kernels.triton._common import (
    check_device,
    check_float,
    check_index,
    check_shape,
    check_slot_values,
    next_power_of_2,
)

MAX_TILE = 4096  # elements per program: BLOCK_H · BLOCK_D


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_buf,
    V_buf,
    Slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (dims < head_dim)[None, :]
    slot = tl.load(Slots + token).to(tl.int64)
    k = tl.load(K + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(V + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(
        K_buf + slot * stride_kbs + heads[:, None] * stride_kbh + dims[None, :],
        k.to(K_buf.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        V_buf + slot * stride_vbs + heads[:, None] * stride_vbh + dims[None, :],
        v.to(V_buf.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write ``k[i]``, ``v[i]`` (``[kv_heads, head_dim]`` each) into row ``slots[i]`` of the
    buffers."""
    _check_store_args(k, v, k_buffer, v_buffer, slots)
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    meta = launch_meta(kv_heads, head_dim)
    grid = (n, triton.cdiv(kv_heads, meta["BLOCK_H"]))
    _store_kv_kernel[grid](
        k,
        v,
        k_buffer,
        v_buffer,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv_heads,
        head_dim,
        **meta,
    )


def launch_meta(kv_heads: int, head_dim: int) -> dict[str, int]:
    """The kernel's constexprs and launch options (also used by the compile test)."""
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(kv_heads), max(1, MAX_TILE // block_d))
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)


def _check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    check_float("k", k, 3)
    check_float("v", v, 3)
    check_float("k_buffer", k_buffer, 3)
    check_float("v_buffer", v_buffer, 3, k_buffer.dtype)
    check_shape("k_buffer", k_buffer, (k_buffer.shape[0], *k.shape[1:]))  # rows shaped like k's
    check_shape("v", v, tuple(k.shape))
    check_shape("v_buffer", v_buffer, tuple(k_buffer.shape))
    check_index("slots", slots, k.shape[0])
    for name, t in (
        ("k", k),
        ("v", v),
        ("k_buffer", k_buffer),
        ("v_buffer", v_buffer),
        ("slots", slots),
    ):
        check_device(name, t, k_buffer.device)
    check_slot_values("slots", slots, slots.numel(), k_buffer.shape[0])
