"""Linear layers on GGUF-quantized weights on the CPU (``quant.c``, ``quant_x86.c``,
``quant_amx.c``).

Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32 values) and Q4_K, Q5_K, Q6_K (super blocks
of 256). ``pack(lib, qtype, raw, k)`` turns a weight's GGUF blocks (uint8 [N, row_bytes], as
stored in the file; never written) into the kernels' layout (panels of 16 rows; at most 1.03×
raw's bytes, plus N's padding to a multiple of 16); ``linear(lib, qtype, x, packed, n, k)``
multiplies; ``rows`` dequantizes an embedding's looked-up rows from the raw blocks;
``linear_stacked`` multiplies by a weight stacked from segments of several types
into one output. The arithmetic is ``radixrt.quant.arithmetic``'s (x quantized to int8 per block of
32, exact integer dot products, one float32 chain per output): every path (``portable``,
``avx2``, ``avx512_vnni``, and ``amx_int8``, which calls of many rows take where the CPU has it)
gives its bits, whatever the rows in a call or the thread count, so a row's outputs are the same
alone or in any batch.

Without the library (``lib`` None) ``pack`` returns raw itself and ``linear`` runs the
reference (slow, same bits). A type, K or shape the kernels do not take is refused with a
ValueError naming it. Under ``capture.capture`` a call is noted as a chain step
(``chain.Chain.quant_linear``), one per segment, instead of computed.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import gguf
import torch

from radixrt.quant import arithmetic as reference
from radixrt.quant.formats import QuantTensor
from radixrt_kernels.cpu import capture as cpu_capture

QTYPES: dict[str, int] = {name: int(gguf.GGMLQuantizationType[name]) for name in reference.BLOCK}
PATHS = ("portable", "avx2", "avx512_vnni", "amx_int8")  # radixrt_quant_linear's path numbers


def _type(qtype: str) -> int:
    if qtype not in QTYPES:
        raise ValueError(f"unknown quantization type {qtype!r} (one of {sorted(QTYPES)})")
    return QTYPES[qtype]


def supported(lib: ctypes.CDLL | None, qtype: str) -> bool:
    """Whether the kernels run qtype here (the reference runs every type)."""
    return lib is not None and qtype in QTYPES and lib.radixrt_quant_path(QTYPES[qtype], 1) >= 0


def path(lib: ctypes.CDLL | None, qtype: str, rows: int) -> str:
    """The path a call of ``rows`` rows runs (``reference`` without the library)."""
    t = _type(qtype)
    return "reference" if lib is None else PATHS[lib.radixrt_quant_path(t, rows)]


def path_available(lib: ctypes.CDLL, qtype: str, name: str) -> bool:
    """Whether ``linear(..., force_path=name)`` runs here (False for a name not in PATHS)."""
    return (
        lib is not None
        and name in PATHS
        and bool(lib.radixrt_quant_path_available(_type(qtype), PATHS.index(name)))
    )


def packed_bytes(lib: ctypes.CDLL, qtype: str, n: int, k: int) -> int:
    size = lib.radixrt_quant_packed_bytes(_type(qtype), n, k)
    if size < 0:
        raise ValueError(
            f"{qtype}: K = {k} is not a multiple of {reference.BLOCK[qtype]} (or N = {n} < 1)"
        )
    return size


def pack(lib: ctypes.CDLL | None, qtype: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """raw uint8 [N, row_bytes] (K / block GGUF blocks per row) in the kernels' layout: a flat
    uint8 tensor (raw itself without the library)."""
    _type(qtype)
    reference.check(qtype, raw, k)
    if lib is None:
        return raw
    if raw.stride(1) != 1:
        raw = raw.contiguous()
    n = raw.shape[0]
    packed = torch.empty(packed_bytes(lib, qtype, n, k), dtype=torch.uint8)
    if (
        lib.radixrt_quant_pack(
            QTYPES[qtype], raw.data_ptr(), raw.stride(0), n, k, packed.data_ptr()
        )
        != 0
    ):
        raise ValueError(f"{qtype}: pack does not take [{n}, {k}]")
    return packed


def _check_packed(
    lib: ctypes.CDLL | None, qtype: str, packed: torch.Tensor, n: int, k: int
) -> None:
    if lib is None:
        reference.check(qtype, packed, k)
        if packed.shape[0] != n:
            raise ValueError(f"{qtype}: raw {tuple(packed.shape)} does not hold [{n}, {k}]")
    elif packed.dtype != torch.uint8 or packed.numel() != packed_bytes(lib, qtype, n, k):
        raise ValueError(f"{qtype}: the packed weight does not hold [{n}, {k}]")


def dequantize(
    lib: ctypes.CDLL | None, qtype: str, packed: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """The packed weight as float32 [n, k], read back by the kernels' unpacking: gguf's
    dequantized values (a·w + c), bit for bit."""
    _type(qtype)
    _check_packed(lib, qtype, packed, n, k)
    if lib is None:
        return reference.dequantize(qtype, packed, k)
    out = torch.empty(n, k, dtype=torch.float32)
    if lib.radixrt_quant_dequantize(QTYPES[qtype], packed.data_ptr(), n, k, out.data_ptr()) != 0:
        raise ValueError(f"{qtype}: dequantize does not take [{n}, {k}]")
    return out


class Segment(NamedTuple):
    """One run of a stacked weight: its GGUF type, its blocks packed by ``pack`` (the raw blocks
    without the library), its output rows and the path its call runs (one of ``PATHS``; None:
    ``path``'s choice for the call's rows)."""

    qtype: str
    packed: torch.Tensor
    n: int
    path: str | None = None


def rows_packed(
    lib: ctypes.CDLL,
    qtype: str,
    packed: torch.Tensor,
    n: int,
    k: int,
    ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows ``ids`` (int64 [T]) of a weight [n, k] packed by ``pack``, as [T, k] in dtype (float32
    or bf16): ``dequantize``'s values of those rows, rounded once (a tied LM head's blocks as its
    embedding)."""
    _type(qtype)
    _check_packed(lib, qtype, packed, n, k)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{qtype}: rows come out float32 or bf16, not {dtype}")
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], k, dtype=dtype)
    rc = lib.radixrt_quant_rows_packed(
        QTYPES[qtype], packed.data_ptr(), n, k, ids.data_ptr(), ids.shape[0], out.data_ptr(),
        dtype == torch.bfloat16,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"{qtype}: an id outside [0, {n}) or a weight [{n}, {k}] it does not take")
    return out


def rows(
    lib: ctypes.CDLL | None,
    qtype: str,
    raw: torch.Tensor,
    ids: torch.Tensor,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows ``ids`` (int64 [T]) of raw uint8 [N, row_bytes] GGUF blocks (as stored in the file,
    not packed) as [T, k] in dtype, gguf's dequantized float32 values rounded once: an embedding's
    lookup. Without the library (or for a dtype other than float32 and bf16), ``formats``'
    dequantization of the rows."""
    _type(qtype)
    reference.check(qtype, raw, k)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if lib is None or dtype not in (torch.float32, torch.bfloat16):
        return QuantTensor(qtype, raw[ids], k).dequantize().to(dtype)
    if raw.stride(1) != 1:
        raw = raw.contiguous()
    out = torch.empty(ids.shape[0], k, dtype=dtype)
    rc = lib.radixrt_quant_rows(
        QTYPES[qtype],
        raw.data_ptr(),
        raw.stride(0),
        raw.shape[0],
        ids.data_ptr(),
        ids.shape[0],
        k,
        out.data_ptr(),
        dtype == torch.bfloat16,
    )
    if rc != 0:
        raise ValueError(f"{qtype}: rows {ids.tolist()} are not all in 0 .. {raw.shape[0] - 1}")
    return out


def linear(
    lib: ctypes.CDLL | None,
    qtype: str,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    force_path: str | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or float32; rows may be strided) · Wᵀ + bias (float32 or bf16 [n], or
    None) for W [n, k] packed by ``pack``: [..., n] in out_dtype (bf16 or float32; default x's
    dtype). ``force_path``: one of ``PATHS`` instead of ``path``'s choice (tests, benchmarks)."""
    return linear_stacked(lib, x, [Segment(qtype, packed, n)], k, bias, out_dtype, force_path)


def _check_call(x, segments, k, bias, out_dtype) -> int:
    """The stacked weight's rows, after checking the call's arguments."""
    n = sum(s.n for s in segments)
    if x.shape[-1] != k or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"quantized linear: x must be bf16 or float32 [..., {k}], "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantized linear: out_dtype must be bf16 or float32, got {out_dtype}")
    if bias is not None and (
        bias.dtype not in (torch.float32, torch.bfloat16) or bias.shape != (n,)
    ):
        raise ValueError(
            f"quantized linear: the bias must be float32 or bf16 [{n}], "
            f"got {bias.dtype} {tuple(bias.shape)}"
        )
    return n


def linear_stacked(
    lib: ctypes.CDLL | None,
    x: torch.Tensor,
    segments: list[Segment],
    k: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    force_path: str | None = None,
) -> torch.Tensor:
    """``linear`` for W the segments' weights stacked in order (a q/k/v or gate/up weight whose
    parts may differ in type): each segment's call writes its columns of one output [..., Σ n]."""
    out_dtype = out_dtype or x.dtype
    n = _check_call(x, segments, k, bias, out_dtype)
    for s in segments:
        _type(s.qtype)
        _check_packed(lib, s.qtype, s.packed, s.n, k)
    x2 = x.reshape(-1, k)
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.quant_linear(x2, segments, k, bias, out_dtype, force_path).view(
            *x.shape[:-1], n
        )
    if lib is None:
        return _reference(x2, segments, k, bias, out_dtype).view(*x.shape[:-1], n)
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    y, row = torch.empty(x2.shape[0], n, dtype=out_dtype), 0
    for s in segments:
        b = None if bias is None else bias[row : row + s.n].contiguous()
        _call(lib, s, x2, k, b, y[:, row : row + s.n], force_path)
        row += s.n
    return y.view(*x.shape[:-1], n)


def _reference(x2, segments, k, bias, out_dtype) -> torch.Tensor:
    outs, row = [], 0
    for s in segments:
        b = None if bias is None else bias[row : row + s.n].float()
        outs.append(reference.linear(s.qtype, x2, s.packed, s.n, k, b, out_dtype))
        row += s.n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _call(lib, s: Segment, x2, k, bias, y, force_path) -> None:
    """One segment's C call: x2 [m, k] (unit column stride) into y [m, s.n] (a view, rows
    y.stride(0) apart)."""
    force_path = force_path or s.path
    chosen = -1 if force_path is None else PATHS.index(force_path)
    rc = lib.radixrt_quant_linear(
        QTYPES[s.qtype],
        x2.data_ptr(),
        x2.stride(0),
        x2.dtype == torch.bfloat16,
        s.packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        bias is not None and bias.dtype == torch.bfloat16,
        y.data_ptr(),
        y.stride(0),
        y.dtype == torch.bfloat16,
        x2.shape[0],
        s.n,
        k,
        torch.get_num_threads(),
        chosen,
    )
    if rc != 0:
        raise ValueError(
            f"{s.qtype}: the {force_path or 'chosen'} path does not take x {tuple(x2.shape)} here"
        )
