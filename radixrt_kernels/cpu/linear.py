"""bfloat16 linear layers on the CPU, on weights packed once (``pack``), by one of three kernels.

- ``"amx"`` (``linear_amx.c``): AMX tile products. A decode step is bound by
  streaming the weights; this kernel reads each weight as one sequential
  stream per thread. Its sums are added in the order oneDNN's AMX kernels add
  them, so for up to 32 rows its results equal ``F.linear``'s bit for bit
  (beyond, within the last bf16 bit: oneDNN picks kernels of other orders).
- ``"avx512_bf16"`` (``linear_vec.c``): vdpbf16ps dot products.
- ``"fma"`` (``linear_vec.c``): the bf16 weights widened to float32 as
  they are read and multiplied with float32 FMA (AVX-512, or AVX2 on CPUs
  without it), x widened once per call.
All three read the same packed weights, add in float32 and round once to
bf16 (the bias added in float32 first), so a layer may run a different kernel
for decode-sized and prefill-sized batches. ``available(lib)`` says whether
AMX runs here (the CPU has it and the OS grants it), ``kernel_available(lib,
name)`` for any of the three; ``pack(lib, w)`` packs a [N, K] bf16 weight (K
a multiple of 32); ``linear(lib, x, packed, n, bias, float_out, ...,
kernel=...)`` multiplies.

Gated: a weight [gate; up] (2N' rows, N' a multiple of 32) packed with
``gated=True`` gives silu(x·gateᵀ)·(x·upᵀ) [M, N'] in the same pass, rounded
as ``elementwise.silu_mul`` of the two products rounds: the MLP's SiLU-and-mul
without its own call, and without writing and re-reading the [M, 2N'] products
(a prefill's are megabytes).

Rotary: ``linear(..., rope=Rope(positions, cos, sin_signed, head_dim, cols))``
rotates the output's first ``cols`` features (q and k heads of ``head_dim``,
a multiple of 64) in the same pass, as ``elementwise.rope_`` rotates them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from radixrt_kernels.cpu import capture as cpu_capture

K_MULTIPLE = 32  # in_features must be a multiple of this (the kernel's chunk)


KERNELS = ("amx", "avx512_bf16", "fma")
_VEC_KERNEL = {"fma": 0, "avx512_bf16": 1}  # radixrt_linear_vec's kernel numbers


def available(lib: ctypes.CDLL | None) -> bool:
    return lib is not None and bool(lib.radixrt_linear_available())


def kernel_available(lib: ctypes.CDLL | None, kernel: str) -> bool:
    """Whether ``linear(..., kernel=kernel)`` runs here."""
    if kernel == "amx":
        return available(lib)
    if kernel not in _VEC_KERNEL:
        raise ValueError(f"unknown linear kernel {kernel!r} (one of {KERNELS})")
    return lib is not None and bool(lib.radixrt_linear_vec_available(_VEC_KERNEL[kernel]))


def packable(w: torch.Tensor, gated: bool = False) -> bool:
    return (
        w.dim() == 2
        and w.is_cpu
        and w.dtype == torch.bfloat16
        and w.shape[1] % K_MULTIPLE == 0
        and (not gated or w.shape[0] % 64 == 0)
    )


def pack(lib: ctypes.CDLL, w: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """w [N, K] (bf16, K a multiple of 32) in the kernel's layout: a flat bf16 tensor. ``gated``:
    w is [gate; up] and their blocks of 32 rows are interleaved (N a multiple of 64)."""
    if not packable(w, gated):
        raise ValueError(
            f"pack: needs a 2-D bf16 CPU weight with in_features a multiple of {K_MULTIPLE}"
            f"{' and [gate; up] halves a multiple of 32 rows' if gated else ''}, "
            f"got {w.dtype} {tuple(w.shape)}"
        )
    n, k = w.shape
    if gated:  # gate block i, then up block i
        w = w.view(2, n // 64, 32, k).transpose(0, 1)
    w = w.contiguous()
    packed = torch.empty(packed_elems(n, k), dtype=torch.bfloat16)
    if lib.radixrt_linear_pack(w.data_ptr(), n, k, packed.data_ptr()) != 0:
        raise ValueError(f"pack: the kernel does not take a weight of shape {tuple(w.shape)}")
    return packed


class Rope(NamedTuple):
    """The rotary embedding a linear's output gets in its own pass: row r at positions[r]
    (int64) of the float32 tables cos and sin± [max_position, head_dim]; features [0, cols)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin_signed: torch.Tensor
    head_dim: int
    cols: int


def rope_fusable(head_dim: int) -> bool:
    """Whether the kernel rotates heads of this size (a head's halves are whole blocks of 32,
    and at most 4 blocks are written together)."""
    return head_dim % 64 == 0 and head_dim <= 128


def packed_elems(n: int, k: int) -> int:
    """The size of a packed [n, k] weight (n padded to a multiple of 32), as the C side has it."""
    return -(-n // 32) * 32 * k


def linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    float_out: bool = False,
    gated: bool = False,
    rope: Rope | None = None,
    kernel: str = "amx",
) -> torch.Tensor:
    """x [..., K] (bf16) · Wᵀ + bias for W [n, K] packed by ``pack``: [..., n] in bf16, or the
    bf16 results widened to float32 with ``float_out``; for a weight packed ``gated``,
    silu(gate)·up [..., n / 2] (bf16, no bias); with ``rope``, rotated (see ``Rope``); by
    ``kernel`` (one of ``KERNELS``). Called for every linear of every step: the checks are
    kept to a few attribute reads."""
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.linear(kernel, x, packed, n, bias, float_out, gated, rope)
    k = x.shape[-1]
    if x.dtype != torch.bfloat16 or (
        bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,))
    ):
        raise ValueError("linear: x and the bias must be bf16, the bias [n]")
    if packed.numel() != packed_elems(n, k):
        raise ValueError(f"linear: the packed weight does not hold [{n}, {k}]")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    m, width = x2.shape[0], n // 2 if gated else n
    if gated and (bias is not None or float_out):
        raise ValueError("linear: a gated linear has no bias and a bf16 output")
    rope_args = (None, None, None, 0, 0)
    if rope is not None:
        pos = rope.positions
        if (
            x.dim() != 2
            or pos.dtype != torch.int64
            or pos.shape != (x.shape[0],)
            or not pos.is_contiguous()
            or rope.cos.dtype != torch.float32
            or rope.sin_signed.dtype != torch.float32
            or not (rope.cos.is_contiguous() and rope.sin_signed.is_contiguous())
            or rope.cos.shape[1] != rope.head_dim
        ):
            raise ValueError(
                "linear: rope needs 2-D x, int64 positions [M] and float32 tables [*, head_dim]"
            )
        rope_args = (
            pos.data_ptr(),
            rope.cos.data_ptr(),
            rope.sin_signed.data_ptr(),
            rope.head_dim,
            rope.cols,
        )
    y = torch.empty(m, width, dtype=torch.float32 if float_out else torch.bfloat16)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    call = lib.radixrt_linear
    if kernel != "amx":
        call = functools.partial(lib.radixrt_linear_vec, _VEC_KERNEL[kernel])
    rc = call(
        x2.data_ptr(),
        x2.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        width,
        float_out,
        gated,
        *rope_args,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"linear: the kernel does not take x {tuple(x.shape)} with W [{n}, {k}] here"
        )
    return y if x.dim() == 2 else y.view(*x.shape[:-1], width)


# ---- float32 ------------------------------------------------------------------------------------

F32_BLOCK = 64  # output features per block of a packed float32 weight (linear_f32.c's FB)


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (float32, any K) in ``linear_f32.c``'s layout: per block of 64 output features
    (N padded with zero rows), [K][64]; a flat float32 tensor."""
    if w.dim() != 2 or not w.is_cpu or w.dtype != torch.float32:
        raise ValueError(
            f"pack_f32: needs a 2-D float32 CPU weight, got {w.dtype} {tuple(w.shape)}"
        )
    n, k = w.shape
    blocks = -(-n // F32_BLOCK)
    padded = torch.nn.functional.pad(w, (0, 0, 0, blocks * F32_BLOCK - n))
    return padded.view(blocks, F32_BLOCK, k).transpose(1, 2).contiguous().view(-1)


def linear_f32(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (float32) · Wᵀ + bias for W [n, K] packed by ``pack_f32``: [..., n] float32.
    Each row's results are the same bits whatever the rows beside it (``linear_f32.c``)."""
    if (recorder := cpu_capture.capturing()) is not None:
        recorder.refuse("the float32 linear")
    k = x.shape[-1]
    if x.dtype != torch.float32 or (
        bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,))
    ):
        raise ValueError("linear_f32: x and the bias must be float32, the bias [n]")
    if packed.numel() != -(-n // F32_BLOCK) * F32_BLOCK * k:
        raise ValueError(f"linear_f32: the packed weight does not hold [{n}, {k}]")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    rc = lib.radixrt_linear_f32(
        x2.data_ptr(),
        x2.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        x2.shape[0],
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"linear_f32: the kernel does not take x {tuple(x.shape)}, W [{n}, {k}]")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
