"""Shared pieces of the kernel wrappers: interpreter detection, launch arguments, checks.

Every check raises ``ValueError`` naming the offending argument. Index
*values* (bounds, monotone indptr) are checked only for CPU tensors, i.e.
under the Triton interpreter, where an out-of-bounds gather kills the whole
process; on CUDA that check would cost a device sync per call. The attention
wrappers (decode, extend, and their deterministic twins) share
``check_attention_tensors``, ``check_kv_index``, ``check_sm_scale`` and
``check_max_len``, and build their launches from ``head_meta``, ``log2_scale``
and ``row_head_strides``.

Sliding windows and logit soft-capping (every attention wrapper's ``window`` and ``softcap``):
``check_window`` checks them, ``window_args`` makes the kernels' runtime arguments (window, 0
for none; the soft cap's inner and outer scales), ``window_meta`` their ``WINDOWED`` and
``SOFTCAP`` constexprs (a layer without either compiles the code it always did), and the
kernels turn a block of raw q·k products into log2-unit scores with ``scale_scores``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

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


def group_rows(group: int) -> int:
    """Rows of a tile that holds the G query heads of one KV head, padded (tl.dot needs 16)."""
    return max(16, next_power_of_2(group))


def head_meta(dtype: torch.dtype, group: int, head_dim: int, exact: bool) -> dict[str, object]:
    """The constexprs every attention kernel takes: head dim, query heads per KV head, the
    head dim padded to a power of two >= 16, and how loads and dots treat ``dtype``."""
    return dict(
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        UPCAST=upcast_after_load(dtype),
        DOT_PRECISION=dot_precision(dtype, exact),
    )


def log2_scale(sm_scale: float) -> float:
    """The kernels' ``qk_scale``: scores in log2 units, so that softmax runs on exp2."""
    return sm_scale * math.log2(math.e)


def check_window(window: int | None, softcap: float | None) -> None:
    """A sliding window is None or a positive int; a soft cap None or positive and finite."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if softcap is not None and not (
        isinstance(softcap, (int, float))
        and not isinstance(softcap, bool)
        and 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")


def window_args(
    sm_scale: float, window: int | None, softcap: float | None
) -> tuple[int, float, float]:
    """The kernels' ``(window, cap_in, cap_out)`` arguments (window 0: none; with a soft cap c,
    the log2-unit score of a product x is cap_out·tanh(cap_in·x): cap_in = sm_scale / c,
    cap_out = c·log2(e))."""
    check_window(window, softcap)
    cap = softcap or 1.0
    return window or 0, sm_scale / cap, cap * math.log2(math.e)


def window_meta(window: int | None, softcap: float | None) -> dict[str, bool]:
    """The attention kernels' ``WINDOWED`` and ``SOFTCAP`` constexprs."""
    return dict(WINDOWED=window is not None, SOFTCAP=softcap is not None)


@triton.jit
def scale_scores(qk, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw q·k products → scores in log2 units: qk·qk_scale, or soft-capped (``window_args``):
    cap_out·tanh(cap_in·qk), tanh(y) = (1 - e) / (1 + e) with e = e^(-2|y|) and y's sign."""
    if SOFTCAP:
        y = qk * cap_in
        e = tl.exp2(-2.8853900817779268 * tl.abs(y))  # e^(-2|y|)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(y < 0, -t, t) * cap_out
    else:
        return qk * qk_scale


def row_head_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """``stride(0), stride(1)`` of each ``[rows, heads, D]`` tensor in turn (the last dim is
    contiguous): the stride arguments of the attention kernels."""
    return tuple(s for t in tensors for s in (t.stride(0), t.stride(1)))


def check_block(name: str, value: int) -> None:
    """A tile size: a power of two >= 16 (tl.dot)."""
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def check_launch_options(num_warps: int, num_stages: int) -> None:
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(f"bad launch options num_warps={num_warps} num_stages={num_stages}")


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


def check_attention_tensors(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    new_kv: dict[str, torch.Tensor] | None = None,
) -> None:
    """q and o ``[N, H, D]``, k_buffer and v_buffer ``[num_slots, KH, D]`` with KH dividing
    H, and each tensor of ``new_kv`` (name → tensor) ``[N, KH, D]``: all of q's float dtype
    and on q's device."""
    check_float("q", q, 3)
    rows, heads, head_dim = q.shape
    new_kv = new_kv or {}
    others = {"o": o, **new_kv, "k_buffer": k_buffer, "v_buffer": v_buffer}
    for name, x in others.items():
        check_float(name, x, 3, q.dtype)
    kv_heads = k_buffer.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of k_buffer's {kv_heads} KV heads")
    check_shape("o", o, (rows, heads, head_dim))
    for name, x in new_kv.items():
        check_shape(name, x, (rows, kv_heads, head_dim))
    check_shape("k_buffer", k_buffer, (k_buffer.shape[0], kv_heads, head_dim))
    check_shape("v_buffer", v_buffer, tuple(k_buffer.shape))
    for name, x in {"q": q, **others}.items():
        check_device(name, x, q.device)


def check_kv_index(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    batch: int,
    num_slots: int,
    device: torch.device,
) -> None:
    """kv_indptr ``[batch + 1]`` and kv_indices on ``device``; on CPU, kv_indptr non-decreasing
    from 0 and the kv_indices it spans within ``[0, num_slots)``."""
    check_index("kv_indptr", kv_indptr, batch + 1)
    check_index("kv_indices", kv_indices)
    check_device("kv_indptr", kv_indptr, device)
    check_device("kv_indices", kv_indices, device)
    check_indptr_values("kv_indptr", kv_indptr, None)
    if kv_indptr.device.type == "cpu":
        check_slot_values("kv_indices", kv_indices, int(kv_indptr[-1]), num_slots)


def check_sm_scale(sm_scale: float) -> None:
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")


def check_max_len(name: str, value: int, indptr: torch.Tensor) -> None:
    """A non-negative int, at least the longest ``indptr`` segment (checked on CPU only)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if indptr.device.type == "cpu" and indptr.numel() > 1:
        longest = int(indptr.diff().max())
        if value < longest:
            raise ValueError(f"{name} {value} < the longest segment, {longest}")
