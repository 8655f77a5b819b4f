"""Quantized linear layers on the GPU: ``quant_linear(qtype, x, raw, n, k, bias, out_dtype)`` is
``radixrt.quant.arithmetic.linear``, bit for bit, for W [n, k] kept in its GGUF blocks.

``raw`` is uint8 [n, row_bytes], the file's blocks as stored (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1:
blocks of 32 values; Q4_K, Q5_K, Q6_K: super blocks of 256, k a multiple of 256). x is
[M, k] bf16, float16 or float32 with a contiguous last dim; out_dtype one of those (default
x's dtype); bias, when given, is float [n]. Anything else raises ``ValueError`` naming it.
``quant_linear`` is ``quantize_x`` (once per x) then ``quant_matmul`` (once per weight; it
writes into a given output, e.g. a stacked weight's segment its columns).

Two kernels, both launched with ``enable_fp_fusion=False`` (no mul+add contracted to an FMA):

- ``_quantize_x_kernel``: x → xq int8 [M, k], dx float32 [M, k/32], sx int32 [M, k/32]
  (Σ xq per block), per block of 32: ``dx = amax / 127``, ``xq = rne(x · (127 / amax))``
  (correctly rounded divisions, a single multiply, round half to even by the 1.5·2^23 add);
  amax below 2^-120 gives a zero block, inf or NaN gives dx = NaN.
- ``_quant_matmul_kernel``: a program owns an output tile [BLOCK_M, BLOCK_N] and walks k one
  32-value block at a time: the block's integer sums are one ``tl.dot`` int8 × int8 → int32
  (exact: |Σ| < 2^24), Q6_K's two 16-value sub-blocks two dots on halves of xq; then per
  output, in ascending sub-block order, ``acc = acc + (a·dx)·isum`` (``+ (c·dx)·sx`` for the
  types with a minimum), each step rounded once; then the bias and one rounding to nearest
  even (to bf16 in integer arithmetic, so that the interpreter rounds alike).

The tile decides which outputs a program computes, never an output's operations, so the
decode tiling (``BLOCK_M`` 16) and the prefill tiling (``BLOCK_M`` 64) give the same bits,
and a row's bits do not depend on the rows beside it (row invariance).
Set ``TRITON_INTERPRET=1`` before import to run on CPU tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixrt.quant import arithmetic
from radixrt_kernels.triton._common import INTERPRET

TYPE_CODE = {t: i for i, t in enumerate(arithmetic.BLOCK)}  # the kernel's QTYPE constexpr
Q8_0: tl.constexpr = tl.constexpr(TYPE_CODE["Q8_0"])
Q4_0: tl.constexpr = tl.constexpr(TYPE_CODE["Q4_0"])
Q4_1: tl.constexpr = tl.constexpr(TYPE_CODE["Q4_1"])
Q5_0: tl.constexpr = tl.constexpr(TYPE_CODE["Q5_0"])
Q5_1: tl.constexpr = tl.constexpr(TYPE_CODE["Q5_1"])
Q4_K: tl.constexpr = tl.constexpr(TYPE_CODE["Q4_K"])
Q5_K: tl.constexpr = tl.constexpr(TYPE_CODE["Q5_K"])
Q6_K: tl.constexpr = tl.constexpr(TYPE_CODE["Q6_K"])
WITH_MIN = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # types whose sub-blocks carry an offset c
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = X_DTYPES
XBLOCK = arithmetic.XBLOCK
X_BLOCKS_PER_PROGRAM = 16  # activation blocks one program of _quantize_x_kernel quantizes
# An output's chain runs over all of k in one program (no split-K), so a call of few rows has
# only n / BLOCK_N programs: the decode tile is narrow in N to spread them over the SMs.
TILINGS = {
    "decode": dict(BLOCK_M=16, BLOCK_N=32, num_warps=2, num_stages=3),
    "prefill": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}
DECODE_MAX_ROWS = 16  # calls of at most this many rows take the decode tiling by default


@triton.jit
def _quantize_x_kernel(
    X,
    XQ,
    DX,
    SX,
    stride_x,
    num_blocks,
    X_BF16: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Row program_id(0), blocks [program_id(1)·BLOCKS, +BLOCKS): x [BLOCKS, 32] → xq, dx, sx."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    i = tl.arange(0, 32)
    live_blk = blk < num_blocks
    offs = row * stride_x + blk[:, None] * 32 + i[None, :]
    if X_BF16:  # bf16 bits widened by integer shift: exact, and the interpreter agrees
        bits = tl.load(X + offs, mask=live_blk[:, None], other=0).to(tl.int32)
        x = (bits << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(X + offs, mask=live_blk[:, None], other=0.0).to(tl.float32)
    ax = tl.abs(x)
    amax = tl.max(ax, axis=1)
    bad = tl.max(((x != x) | (ax > 3.4028234663852886e38)).to(tl.int32), axis=1) > 0
    live = (amax >= 7.52316384526264e-37) & (bad == 0)  # 2^-120: 127 / amax finite
    safe = tl.where(live, amax, 1.0)
    dx = tl.where(live, tl.math.div_rn(safe, tl.full(safe.shape, 127.0, tl.float32)), 0.0)
    dx = tl.where(bad, float("nan"), dx)
    inv = tl.where(live, tl.math.div_rn(tl.full(safe.shape, 127.0, tl.float32), safe), 0.0)
    y = tl.where(live[:, None], x, 0.0) * inv[:, None]
    q = ((y + 12582912.0) - 12582912.0).to(tl.int32)  # |y| <= 127: round half to even
    tl.store(
        XQ + row * num_blocks * 32 + blk[:, None] * 32 + i[None, :],
        q.to(tl.int8),
        mask=live_blk[:, None],
    )
    tl.store(DX + row * num_blocks + blk, dx, mask=live_blk)
    tl.store(SX + row * num_blocks + blk, tl.sum(q, axis=1), mask=live_blk)


@triton.jit
def _f16(P):
    """The little-endian fp16 at byte pointers P, as float32 (exact)."""
    bits = tl.load(P).to(tl.int32) | (tl.load(P + 1).to(tl.int32) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(P):
    return tl.load(P).to(tl.int32)


@triton.jit
def _nibbles_16(W, base, at):
    """[BN, 32]: 32 values in the 16 bytes at base + at, the low nibbles then the high ones."""
    i = tl.arange(0, 32)
    return (_byte(W + base[:, None] + at + (i % 16)[None, :]) >> (4 * (i // 16))[None, :]) & 15


@triton.jit
def _nibbles_32(W, base, at, shift):
    """[BN, 32]: the nibble at bit ``shift`` (0 or 4) of each of the 32 bytes at base + at."""
    i = tl.arange(0, 32)
    return (_byte(W + base[:, None] + at + i[None, :]) >> shift) & 15


@triton.jit
def _bits_32(W, base, at):
    """[BN, 32]: bit i of the 4 little-endian bytes at base + at (a Q5 block's fifth bits)."""
    i = tl.arange(0, 32)
    return (_byte(W + base[:, None] + at + (i // 8)[None, :]) >> (i % 8)[None, :]) & 1


@triton.jit
def _bit_of_32(W, base, at, bit):
    """[BN, 32]: bit ``bit`` of each of the 32 bytes at base + at (Q5_K's fifth bits)."""
    i = tl.arange(0, 32)
    return (_byte(W + base[:, None] + at + i[None, :]) >> bit) & 1


@triton.jit
def _scale_min_k4(W, base, j):
    """Sub-block j's 6-bit scale and minimum from a Q4_K/Q5_K super block's 12 bytes at 4."""
    lo = _byte(W + base + 4 + j % 4)
    hi = _byte(W + base + 8 + j)
    mid = _byte(W + base + 8 + j % 4)
    first = j < 4
    sc = tl.where(first, lo & 63, (hi & 15) | ((lo >> 2) & 48))
    mn = tl.where(first, hi & 63, (hi >> 4) | ((mid >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _weights_32(W, rows_off, b, TS: tl.constexpr, QTYPE: tl.constexpr):
    """Block b of a 32-value type for rows at byte offsets rows_off [BN]: w [BN, 32] int8,
    scale a [BN] and offset c [BN] float32 (c = a where the type has none)."""
    base = rows_off + b * TS
    d = _f16(W + base)
    if QTYPE == Q8_0:
        i = tl.arange(0, 32)
        w = tl.load(W + base[:, None] + 2 + i[None, :]).to(tl.int8, bitcast=True)
        c = d
    elif QTYPE == Q4_0:
        w = (_nibbles_16(W, base, 2) - 8).to(tl.int8)
        c = d
    elif QTYPE == Q4_1:
        w = _nibbles_16(W, base, 4).to(tl.int8)
        c = _f16(W + base + 2)
    elif QTYPE == Q5_0:
        w = (_nibbles_16(W, base, 6) | (_bits_32(W, base, 2) << 4)) - 16
        w = w.to(tl.int8)
        c = d
    else:  # Q5_1
        w = (_nibbles_16(W, base, 8) | (_bits_32(W, base, 4) << 4)).to(tl.int8)
        c = _f16(W + base + 2)
    return w, d, c


@triton.jit
def _weights_k(W, rows_off, b, TS: tl.constexpr, QTYPE: tl.constexpr):
    """Values [32·b, 32·b + 32) of a K type's rows: w [BN, 32] int8, the scales of its first and
    second 16 values a0, a1 [BN] (equal but for Q6_K) and its offset c [BN] float32."""
    base = rows_off + (b // 8) * TS
    j = b % 8  # 32-value run within the super block
    if QTYPE == Q6_K:
        d = _f16(W + base + 208)
        low = _nibbles_32(W, base, (j // 4) * 64 + (j % 2) * 32, 4 * ((j % 4) // 2))
        high = (
            _byte(W + base[:, None] + 128 + (j // 4) * 32 + tl.arange(0, 32)[None, :])
            >> (2 * (j % 4))
        ) & 3
        w = ((low | (high << 4)) - 32).to(tl.int8)
        a0 = d * tl.load(W + base + 192 + 2 * j).to(tl.int8, bitcast=True).to(tl.float32)
        a1 = d * tl.load(W + base + 193 + 2 * j).to(tl.int8, bitcast=True).to(tl.float32)
        return w, a0, a1, a0
    d = _f16(W + base)
    dmin = _f16(W + base + 2)
    sc, mn = _scale_min_k4(W, base, j)
    if QTYPE == Q4_K:
        w = _nibbles_32(W, base, 16 + (j // 2) * 32, 4 * (j % 2))
    else:  # Q5_K
        fifth = _bit_of_32(W, base, 16, j) << 4
        w = _nibbles_32(W, base, 48 + (j // 2) * 32, 4 * (j % 2)) | fifth
    a = d * sc
    return w.to(tl.int8), a, a, -(dmin * mn)


@triton.jit
def _bf16_bits(v):
    """float32 → bf16 bits (int16), rounded to nearest even; NaN → 0x7FC0 (torch's)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _quant_matmul_kernel(
    XQ,
    DX,
    SX,
    W,
    Bias,
    Out,
    M,
    N,
    num_blocks,
    stride_w,
    stride_o,
    QTYPE: tl.constexpr,
    TS: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Out[m, n] for the tile (program_id(0), program_id(1)); module docstring's chain."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: padding rows are never stored
    rows_off = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_w
    i = tl.arange(0, 32)
    first_half = (i < 16)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, num_blocks):
        xq = tl.load(XQ + rows_m[:, None] * num_blocks * 32 + b * 32 + i[None, :])
        dx = tl.load(DX + rows_m * num_blocks + b)[:, None]
        if QTYPE >= Q4_K:
            w, a0, a1, c = _weights_k(W, rows_off, b, TS, QTYPE)
        else:
            w, a0, c = _weights_32(W, rows_off, b, TS, QTYPE)
            a1 = a0
        wt = tl.trans(w)
        if QTYPE == Q6_K:
            lo = tl.dot(tl.where(first_half, xq, 0).to(tl.int8), wt, out_dtype=tl.int32)
            hi = tl.dot(tl.where(first_half, 0, xq).to(tl.int8), wt, out_dtype=tl.int32)
            acc = acc + (a0[None, :] * dx) * lo.to(tl.float32)
            acc = acc + (a1[None, :] * dx) * hi.to(tl.float32)
        else:
            isum = tl.dot(xq, wt, out_dtype=tl.int32)
            acc = acc + (a0[None, :] * dx) * isum.to(tl.float32)
            if HAS_MIN:
                sx = tl.load(SX + rows_m * num_blocks + b).to(tl.float32)[:, None]
                acc = acc + (c[None, :] * dx) * sx
    if HAS_BIAS:
        acc = acc + tl.load(Bias + tl.minimum(offs_n, N - 1))[None, :]
    out = Out + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if OUT_BF16:
        tl.store(out, _bf16_bits(acc), mask=mask)
    else:  # float32, or float16 rounded to nearest even
        tl.store(out, acc.to(Out.dtype.element_ty), mask=mask)


class QuantizedX(NamedTuple):
    """x quantized per block of 32: xq int8 [M, k], dx float32 [M, k/32], sx int32 [M, k/32]."""

    xq: torch.Tensor
    dx: torch.Tensor
    sx: torch.Tensor


def quantize_x(x: torch.Tensor) -> QuantizedX:
    """x [M, k] (k a multiple of 32, last dim contiguous) quantized: the values of
    ``arithmetic.quantize_activations`` (sx: its 16-value sums added in pairs)."""
    _check_x(x, x.shape[-1] if x.dim() == 2 else -1)
    m, k = x.shape
    blocks = k // XBLOCK
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(m, blocks, dtype=torch.float32, device=x.device)
    sx = torch.empty(m, blocks, dtype=torch.int32, device=x.device)
    if m:
        bf16 = x.dtype == torch.bfloat16
        grid = (m, triton.cdiv(blocks, X_BLOCKS_PER_PROGRAM))
        _quantize_x_kernel[grid](
            x.view(torch.int16) if bf16 else x,
            xq,
            dx,
            sx,
            x.stride(0),
            blocks,
            X_BF16=bf16,
            BLOCKS=X_BLOCKS_PER_PROGRAM,
            enable_fp_fusion=False,
        )
    return QuantizedX(xq, dx, sx)


def quant_linear(
    qtype: str,
    x: torch.Tensor,
    raw: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tiling: str | None = None,
) -> torch.Tensor:
    """x [M, k] · Wᵀ (+ bias) → [M, n] in out_dtype (default x's) for W [n, k] of ``qtype`` given
    as its GGUF blocks ``raw`` uint8 [n, row_bytes] (module docstring). ``tiling``: "decode" or
    "prefill" (default: decode for M <= 16); both give the same bits."""
    out_dtype = out_dtype or x.dtype
    arithmetic.check(qtype, raw, k)
    _check_x(x, k)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not one of {OUT_DTYPES}")
    out = torch.empty(x.shape[0], n, dtype=out_dtype, device=x.device)
    quant_matmul(qtype, quantize_x(x), raw, k, bias, out, tiling)
    return out


def quant_matmul(
    qtype: str,
    act: QuantizedX,
    raw: torch.Tensor,
    k: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiling: str | None = None,
) -> None:
    """out [M, n] = x · Wᵀ (+ bias float [n]) for x quantized as ``act`` (``quantize_x``) and W
    [n, k] of ``qtype`` as ``raw``; ``out`` may be a column slice of a wider output (its last
    dim contiguous), so that the segments of a stacked weight write their columns."""
    meta = _check_matmul(qtype, act, raw, k, bias, out, tiling)
    m, n = out.shape
    if m == 0 or n == 0:
        return
    bf16 = out.dtype == torch.bfloat16
    grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
    _quant_matmul_kernel[grid](
        act.xq,
        act.dx,
        act.sx,
        raw,
        bias.float().contiguous() if bias is not None else act.dx,
        out.view(torch.int16) if bf16 else out,
        m,
        n,
        k // XBLOCK,
        raw.stride(0),
        out.stride(0),
        **kernel_meta(qtype, bias is not None, out.dtype, meta),
    )


def kernel_meta(
    qtype: str, has_bias: bool, out_dtype: torch.dtype, tile: dict[str, int]
) -> dict[str, object]:
    """``_quant_matmul_kernel``'s constexprs and launch options for a type and a tiling."""
    return dict(
        QTYPE=TYPE_CODE[qtype],
        TS=arithmetic.TYPE_SIZE[qtype],
        HAS_MIN=qtype in WITH_MIN,
        HAS_BIAS=has_bias,
        OUT_BF16=out_dtype == torch.bfloat16,
        enable_fp_fusion=False,
        **tile,
    )


def tiling_for(rows: int, tiling: str | None = None) -> dict[str, int]:
    """The tile and launch options of ``tiling`` (None: decode up to 16 rows, else prefill)."""
    name = tiling or ("decode" if rows <= DECODE_MAX_ROWS else "prefill")
    if name not in TILINGS:
        raise ValueError(f"unknown tiling {tiling!r} (one of {sorted(TILINGS)})")
    return TILINGS[name]


def _check_x(x: torch.Tensor, k: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k or k % XBLOCK:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [M, {k}] with K a multiple of {XBLOCK}, got {shape}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}, expected one of {X_DTYPES}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim, got strides {x.stride()}")
    _check_device("x", x)


def _check_device(name: str, t: torch.Tensor) -> None:
    if not INTERPRET and t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}: Triton kernels need a CUDA tensor "
            "(or TRITON_INTERPRET=1 set before import)"
        )


def _check_matmul(
    qtype: str,
    act: QuantizedX,
    raw: torch.Tensor,
    k: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiling: str | None,
) -> dict[str, int]:
    """ValueError naming the first argument ``quant_matmul`` does not take; else the tiling."""
    arithmetic.check(qtype, raw, k)
    m, n = out.shape if out.dim() == 2 else (-1, -1)
    if out.dtype not in OUT_DTYPES or m < 0 or (n > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be [M, N] of {OUT_DTYPES} with a contiguous last dim, "
            f"got {out.dtype} {tuple(out.shape)} (strides {out.stride()})"
        )
    if raw.shape[0] != n or (raw.shape[1] > 1 and raw.stride(1) != 1):
        raise ValueError(
            f"{qtype}: raw {tuple(raw.shape)} (strides {raw.stride()}) for {n} outputs"
        )
    want = ((m, k), (m, k // XBLOCK), (m, k // XBLOCK))
    if tuple(tuple(t.shape) for t in act) != want or not all(t.is_contiguous() for t in act):
        raise ValueError(f"act must be quantize_x's of an x [{m}, {k}]")
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != n or not bias.dtype.is_floating_point
    ):
        raise ValueError(f"bias must be a float [{n}], got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("raw", raw), ("bias", bias), ("out", out)):
        if t is not None and t.device != act.xq.device:
            raise ValueError(f"{name} is on {t.device}, x on {act.xq.device}")
    return tiling_for(m, tiling)
