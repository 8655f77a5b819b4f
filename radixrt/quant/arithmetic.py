"""The quantized linear's arithmetic in PyTorch: the contract every CPU kernel path computes, and
the bit-exact reference (and fallback) the kernels are tested against.

A weight W [N, K] of a GGUF block type is, per output row, a run of sub-blocks of S values
(S = 32; Q6_K: 16), sub-block j holding integers w_i, a float32 scale a_j and, for the types
with a minimum, a float32 offset c_j, with gguf's dequantized value exactly a_j·w_i + c_j
(``unpack``):

    Q4_0: a = d, w = q - 8       Q5_0: a = d, w = q - 16      Q8_0: a = d, w = q (int8)
    Q4_1: a = d, w = q, c = m    Q5_1: a = d, w = q, c = m    (d, m: fp16, exact in float32)
    Q4_K, Q5_K: a = d·sc_j (float32 product), w = q, c = -(dmin·m_j)
    Q6_K: a = d·sc_j (sc int8), w = q - 32 (S = 16)

x [M, K] (bf16 or float32, taken exactly as float32) is quantized per row per block b of 32
values (``quantize_activations``): amax = max |x_i|, dx_b = amax / 127, xq_i = x_i · (127 /
amax) rounded half to even (float32 multiply, one rounding), sx_j = Σ xq_i over sub-block j.
A block whose amax is below 2^-120 (so that 127 / amax stays finite) is all zeros (dx_b = 0);
a block holding inf or NaN has dx_b = NaN (its row's outputs are NaN).

Output (m, n) is one float32 chain over the sub-blocks in ascending k, with no fused
multiply-add (``linear``):

    acc = 0
    acc = acc + (a_j · dx_b) · float(isum_j)        isum_j = Σ w_i · xq_i, exact
    acc = acc + (c_j · dx_b) · float(sx_j)          (types with an offset)
    y = acc + bias[n], rounded once to the output dtype

The integer sums are exact (|isum| < 2^24, so float(isum) is exact too); the float steps are
elementwise tensor ops here, each rounded once, in the same order as the kernels' scalar chain.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32}
BLOCK.update({"Q4_K": 256, "Q5_K": 256, "Q6_K": 256})
TYPE_SIZE = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
TYPE_SIZE.update({"Q4_K": 144, "Q5_K": 176, "Q6_K": 210})
XBLOCK = 32  # activation block (values per dx_b)
TINY = 2.0**-120  # amax below this: a zero block


class Unpacked(NamedTuple):
    """A weight as sub-blocks: w [N, K] (int16), a and c [N, K / S] float32 (c None: no offset)."""

    w: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor | None
    sub: int  # S, values per sub-block


class Activations(NamedTuple):
    """x quantized: xq [M, K] (int16 holding int8 values), dx [M, K / 32] float32, sx16 [M, K / 16]
    (sums of xq over each 16 values, int32)."""

    xq: torch.Tensor
    dx: torch.Tensor
    sx16: torch.Tensor


def check(qtype: str, raw: torch.Tensor, k: int) -> None:
    """ValueError naming what is wrong unless raw [N, row_bytes] uint8 holds K values of qtype."""
    if qtype not in BLOCK:
        raise ValueError(f"unknown quantization type {qtype!r} (one of {sorted(BLOCK)})")
    if k <= 0 or k % BLOCK[qtype] != 0:
        raise ValueError(f"{qtype}: K = {k} is not a multiple of its block of {BLOCK[qtype]}")
    want = k // BLOCK[qtype] * TYPE_SIZE[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != want:
        raise ValueError(
            f"{qtype}: raw must be uint8 [N, {want}] for K = {k}, "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 bits as float32 [...] (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., L] bytes as [..., 2L]: the L low nibbles, then the L high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).short()


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., count / 8] bytes as their `count` bits, least significant first, [..., count]."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(*b.shape[:-1], count).short()


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] as 6-bit (sc, m) [..., 8] each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def _unpack_32(
    qtype: str, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks [N, B, size] of a 32-value type: w [N, B, 32], a and c [N, B]."""
    d = _f16(b[..., 0:2])
    if qtype == "Q8_0":
        return b[..., 2:34].contiguous().view(torch.int8).short(), d, None
    has_m = qtype in ("Q4_1", "Q5_1")
    c = _f16(b[..., 2:4]) if has_m else None
    at = 4 if has_m else 2
    if qtype in ("Q4_0", "Q4_1"):
        q = _nibbles(b[..., at : at + 16])
    else:
        q = _nibbles(b[..., at + 4 : at + 20]) | (_bits(b[..., at : at + 4], 32) << 4)
    offset = {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
    return q - offset, d, c


def _unpack_k(
    qtype: str, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Super blocks [N, B, size] of a K type: w [N, B, 256], a and c [N, B, 256 / S]."""
    if qtype == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc, d = b[..., 192:208].contiguous().view(torch.int8).float(), _f16(b[..., 208:210])
        low = torch.cat([_nibbles(ql[..., 0:64]), _nibbles(ql[..., 64:128])], dim=-1)
        high = torch.cat(
            [
                (
                    (
                        qh[..., h * 32 : h * 32 + 32].unsqueeze(-2)
                        >> (2 * torch.arange(4, dtype=torch.uint8).unsqueeze(-1))
                    )
                    & 3
                ).flatten(-2)
                for h in (0, 1)
            ],
            dim=-1,
        )
        return (low | (high.short() << 4)) - 32, d.unsqueeze(-1) * sc, None
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])
    if qtype == "Q4_K":
        qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
        q = _nibbles(qs).flatten(-2)
    else:
        qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
        bits = _bits(b[..., 16:48].unsqueeze(-1), 8 * 32 // 32)  # [N, B, 32, 8]: bit j of qh[l]
        q = _nibbles(qs).flatten(-2) | (bits.transpose(-1, -2).flatten(-2) << 4)
    return q, d.unsqueeze(-1) * sc, -(dmin.unsqueeze(-1) * mn)


def unpack(qtype: str, raw: torch.Tensor, k: int) -> Unpacked:
    """raw [N, row_bytes] uint8 (each row K / block GGUF blocks, as stored) as sub-blocks."""
    check(qtype, raw, k)
    n = raw.shape[0]
    blocks = raw.reshape(n, k // BLOCK[qtype], TYPE_SIZE[qtype])
    split = _unpack_32 if BLOCK[qtype] == 32 else _unpack_k
    w, a, c = split(qtype, blocks)
    sub = 16 if qtype == "Q6_K" else 32
    a = a.reshape(n, k // sub)
    return Unpacked(w.reshape(n, k), a, None if c is None else c.reshape(n, k // sub), sub)


def dequantize(qtype: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """The weight as float32 [N, K]: a_j·w_i + c_j (gguf.quants.dequantize's values, bit for
    bit)."""
    u = unpack(qtype, raw, k)
    w = u.w.float().view(u.w.shape[0], -1, u.sub)
    y = u.a.unsqueeze(-1) * w
    if u.c is not None:
        y = y + u.c.unsqueeze(-1)
    return y.view(u.w.shape[0], k)


def quantize_activations(x: torch.Tensor) -> Activations:
    """x [M, K] (K a multiple of 32) as int8 values per block of 32 (module docstring)."""
    m, k = x.shape
    xf = x.float().reshape(m, k // XBLOCK, XBLOCK)
    amax = xf.abs().amax(-1)
    finite = amax <= torch.finfo(torch.float32).max
    live = finite & (amax >= TINY)
    safe = torch.where(live, amax, torch.ones_like(amax))
    dx = torch.where(live, safe / torch.full_like(safe, 127.0), torch.zeros_like(safe))
    dx = torch.where(finite, dx, torch.full_like(dx, float("nan")))
    inv = torch.where(live, torch.full_like(safe, 127.0) / safe, torch.zeros_like(safe))
    xq = torch.round(torch.where(live.unsqueeze(-1), xf, torch.zeros_like(xf)) * inv.unsqueeze(-1))
    xq = xq.short().reshape(m, k)
    return Activations(xq, dx, xq.view(m, k // 16, 16).sum(-1, dtype=torch.int32))


def linear(
    qtype: str,
    x: torch.Tensor,
    raw: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16 or float32) · Wᵀ (+ bias float32 [N]) for W [n, k] given as GGUF blocks
    raw [n, row_bytes]: [M, n] in out_dtype (default x's dtype), by the module's arithmetic."""
    check(qtype, raw, k)
    if raw.shape[0] != n or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{qtype}: x {tuple(x.shape)} and raw {tuple(raw.shape)} for W [{n}, {k}]")
    u, act = unpack(qtype, raw, k), quantize_activations(x)
    per = XBLOCK // u.sub  # sub-blocks per activation block
    m, subs = x.shape[0], k // u.sub
    # isum [subs, M, N]: exact integer sums (float64 products and sums of integers < 2^24)
    xs = act.xq.double().view(m, subs, u.sub).transpose(0, 1)
    ws = u.w.double().view(n, subs, u.sub).permute(1, 2, 0)
    isum = torch.bmm(xs, ws).float()
    sx = act.sx16.view(m, subs, -1).sum(-1).float() if u.c is not None else None
    acc = torch.zeros(m, n, dtype=torch.float32)
    for j in range(subs):
        dx = act.dx[:, j // per].unsqueeze(1)
        acc = acc + (u.a[:, j].unsqueeze(0) * dx) * isum[j]
        if u.c is not None:
            acc = acc + (u.c[:, j].unsqueeze(0) * dx) * sx[:, j].unsqueeze(1)
    if bias is not None:
        acc = acc + bias.float().unsqueeze(0)
    return acc.to(out_dtype or x.dtype)
