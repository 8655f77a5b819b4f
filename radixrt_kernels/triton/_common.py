"""Shared pieces of the kernel wrappers: interpreter detection and argument checks.

Every check raises ``ValueError`` naming the offending argument. Index
*values* (bounds, monotone indptr) are checked only for CPU tensors, i.e.
under the Triton interpreter, where an out-of-bounds gather kills the whole
process; on CUDA that check would cost a device sync per call.
"""

from __future__ import annotations

import os

import torch

#: Read once: ``triton.jit`` picks the interpreter at decoration time, so the
#: environment variable must be set before these modules are imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def upcast_after_load(dtype: torch.dtype) -> bool:
    """The interpreter keeps bf16 as raw bits: dots and arithmetic on it are garbage."""
    return INTERPRET and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype, exact: bool) -> str:
    """How tl.dot treats fp32 operands (fp16/bf16 ignore it): plain TF32 would drift from
    the torch backend, so ``exact`` asks for FMA dots (cheap beside a memory-bound loop),
    otherwise three TF32 passes (near-fp32 accuracy on tensor cores)."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if exact else "tf32x3"


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not INTERPRET and device.type != "cuda":
        raise ValueError(
            f"{name} is on {device}: Triton kernels need a CUDA tensor "
            "(or TRITON_INTERPRET=1 set before import)"
        )


def check_float(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype | None = None) -> None:
    """A floating tensor of ``ndim`` dims whose last dim is contiguous (stride 1)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {FLOAT_DTYPES}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} (like q)")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def check_index(name: str, t: torch.Tensor, length: int | None = None) -> None:
    """A contiguous 1-D int32/int64 tensor (of ``length`` elements when given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected int32 or int64")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} has {t.numel()} elements, expected {length}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def check_indptr_values(name: str, indptr: torch.Tensor, total: int | None) -> None:
    """indptr starts at 0, never decreases, and ends at ``total`` (at most, when None)."""
    if indptr.device.type != "cpu":
        return
    if indptr.numel() == 0 or int(indptr[0]) != 0:
        raise ValueError(f"{name} must start at 0")
    if bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if total is not None and int(indptr[-1]) != total:
        raise ValueError(f"{name}[-1] is {int(indptr[-1])}, expected {total}")


def check_slot_values(name: str, slots: torch.Tensor, used: int, num_slots: int) -> None:
    """The first ``used`` entries of ``slots`` index rows of a buffer of ``num_slots`` rows."""
    if slots.device.type != "cpu":
        return
    if used > slots.numel():
        raise ValueError(f"{name} has {slots.numel()} entries, the indptr needs {used}")
    head = slots[:used]
    if used and (int(head.min()) < 0 or int(head.max()) >= num_slots):
        raise ValueError(f"{name} holds slots outside [0, {num_slots})")
