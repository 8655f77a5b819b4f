"""The model's elementwise steps on the CPU, one C call each (``elementwise.c``).

In eager mode PyTorch runs each of these as several kernels, each with its
own dispatch and its own pass over memory: an RMS norm in float32 is a cast,
a square, a mean, an rsqrt, two products and a cast back. Here each is one
call into the library ``library`` builds, with the same roundings as the
PyTorch ops it replaces (see the C file). Tensors are on the CPU, float32 or
bfloat16 (``usable``); the library comes from ``library.load``.
"""

from __future__ import annotations

import ctypes

import torch

from radixrt_kernels.cpu import capture as cpu_capture

DTYPES = (torch.float32, torch.bfloat16)


def usable(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype in DTYPES


def dtype_flag(x: torch.Tensor, what: str) -> int:
    """1 for bf16, 0 for float32 (the C functions' dtype flag); other dtypes are refused."""
    if x.dtype not in DTYPES:
        raise ValueError(f"{what}: the CPU kernel takes float32 or bfloat16, got {x.dtype}")
    return int(x.dtype == torch.bfloat16)


def check_rc(rc: int, what: str) -> None:
    """Raise ValueError naming ``what`` where a C call answered -1 (a size it does not take)."""
    if rc != 0:
        raise ValueError(f"{what}: a size the CPU kernel does not take")


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) for x [T, N] (rows may be strided), weight [N] in x's
    dtype. With ``residual`` (contiguous [T, N], x's dtype) the norm is of x + residual, and
    that sum is written into ``residual``. x [T, H, N] (heads contiguous, token rows may be
    strided; no residual): each head's norm, into a new contiguous [T, H, N], or into ``out``
    laid out as x (``out`` may be x: in place)."""
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.norm(x, weight, eps, residual, out)
    if x.dim() == 3:
        return _rms_norm_heads(lib, x, weight, eps, out)
    t, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.dtype != x.dtype or (
        residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous())
    ):
        raise ValueError("rms_norm: weight and residual must be in x's dtype, residual contiguous")
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out = torch.empty(t, n, dtype=x.dtype)
    check_rc(
        lib.radixrt_rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
            weight.data_ptr(),
            t,
            n,
            eps,
            dtype_flag(x, "rms_norm"),
            torch.get_num_threads(),
        ),
        "rms_norm",
    )
    return out


def _rms_norm_heads(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    t, heads, n = x.shape
    if out is not None and (
        out.shape != x.shape or out.dtype != x.dtype or out.stride() != x.stride()
    ):
        raise ValueError("rms_norm: out must be laid out as x")
    if x.stride(2) != 1 or x.stride(1) != n:
        if out is not None:
            raise ValueError("rms_norm: a norm into out needs x's heads contiguous")
        x = x.contiguous()
    if weight.dtype != x.dtype:
        raise ValueError("rms_norm: the weight must be in x's dtype")
    weight = weight.contiguous()
    if out is None:
        out = torch.empty(t, heads, n, dtype=x.dtype)
    check_rc(
        lib.radixrt_rms_norm_heads(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            weight.data_ptr(),
            t,
            heads,
            n,
            eps,
            dtype_flag(x, "rms_norm"),
            torch.get_num_threads(),
        ),
        "rms_norm",
    )
    return out


def rope_(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
) -> torch.Tensor:
    """Neox rotary embedding of x [T, N, D] in place (token rows may be strided, heads not),
    with float32 tables cos and sin± [max_position, D] at positions (int64 [T]); returns x."""
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.rope(x, positions, cos, sin_signed)
    t, heads, d = x.shape
    if (
        x.stride(2) != 1
        or x.stride(1) != d
        or cos.dtype != torch.float32
        or sin_signed.dtype != torch.float32
        or not (cos.is_contiguous() and sin_signed.is_contiguous())
    ):
        raise ValueError(
            "rope_: x must have contiguous heads, the tables must be contiguous float32"
        )
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    check_rc(
        lib.radixrt_rope(
            x.data_ptr(),
            x.stride(0),
            t,
            heads,
            d,
            positions.data_ptr(),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            dtype_flag(x, "rope_"),
            torch.get_num_threads(),
        ),
        "rope_",
    )
    return x


def silu_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :N]) · x[:, N:] for x [T, 2N] → [T, N]."""
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.silu_mul(x)
    t, n2 = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(t, n2 // 2, dtype=x.dtype)
    check_rc(
        lib.radixrt_silu_mul(
            x.data_ptr(),
            out.data_ptr(),
            t,
            n2 // 2,
            dtype_flag(x, "silu_mul"),
            torch.get_num_threads(),
        ),
        "silu_mul",
    )
    return out
