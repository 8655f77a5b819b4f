"""Round-to-nearest quantization of float weights into GGUF blocks (``--quantization``).

``quantize(w, qtype)`` turns a weight [N, K] into a ``QuantTensor`` of ``qtype``: the legacy
types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) with the ``gguf`` package's quantizer, Q4_K here (the
package has none): per 32-weight sub-block a scale (max - min) / 15 and a min (min(0, min)),
their 6-bit codes against the super block's fp16 ``d`` and ``dmin`` (the largest scale and
min over 63), each weight the nearest code in 0..15 of ``d·sc·q - dmin·m``.

``QUANTIZATIONS`` are the ``--quantization`` values; a weight whose K is not a whole number
of its type's blocks takes ``FALLBACK[qtype]`` (as llama.cpp's quantizer does), and the
caller logs it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from radixrt.quant.formats import BLOCK_TYPES, QuantTensor

QUANTIZATIONS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}
FALLBACK = {"Q4_K": "Q5_0"}
logger = logging.getLogger(__name__)


def type_for(qtype: str, k: int) -> str:
    """``qtype``, or its fallback where rows of ``k`` weights are not whole blocks of it."""
    if k % BLOCK_TYPES[qtype].block == 0:
        return qtype
    fallback = FALLBACK.get(qtype)
    if fallback is None or k % BLOCK_TYPES[fallback].block:
        raise ValueError(f"a weight of {k} input features cannot be quantized to {qtype}")
    return fallback


def quantize(w: torch.Tensor, qtype: str) -> QuantTensor:
    """``w`` [N, K] as blocks of ``qtype`` (module text)."""
    if qtype == "Q4_K":
        return QuantTensor(qtype, _q4_k(w.detach().float()), w.shape[1])
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"cannot quantize to {qtype!r} (types: {', '.join(BLOCK_TYPES)})")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    raw = gguf_quantize(w.detach().float().numpy(), GGMLQuantizationType[qtype])
    return QuantTensor(qtype, torch.from_numpy(np.ascontiguousarray(raw)), w.shape[1])


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16)


def _q4_k(w: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 256 · 144]: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes
    of 4-bit codes (sub-blocks 2p and 2p + 1 in the low and high nibbles of 32 bytes)."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32)
    lo = x.amin(-1).clamp(max=0.0)
    scale, mins = (x.amax(-1) - lo) / 15.0, -lo  # [n, blocks, 8]
    d, dmin = _fp16(scale.amax(-1) / 63.0), _fp16(mins.amax(-1) / 63.0)
    df, dminf = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
    sc = torch.where(df > 0, (scale / df).round(), 0.0).clamp(0, 63).to(torch.uint8)
    m = torch.where(dminf > 0, (mins / dminf).round(), 0.0).clamp(0, 63).to(torch.uint8)
    step = (df * sc.float()).unsqueeze(-1)
    offset = (dminf * m.float()).unsqueeze(-1)
    q = torch.where(step > 0, ((x + offset) / step).round(), 0.0).clamp(0, 15).to(torch.uint8)
    qs = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # [n, blocks, 4, 32]
    scales = torch.cat(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        dim=-1,
    )
    head = torch.stack([d, dmin], -1).view(torch.uint8).reshape(n, k // 256, 4)
    return torch.cat([head, scales, qs.reshape(n, k // 256, 128)], -1).reshape(n, -1)


def quantized_weights(weights, quantization: str):
    """``weights`` ((name, tensor) pairs) with every 2-D tensor quantized for ``quantization``
    (a ``QUANTIZATIONS`` key); the others as they are. Logs the tensors that took a fallback."""
    qtype, fell_back = QUANTIZATIONS[quantization], []
    for name, w in weights:
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            kind = type_for(qtype, w.shape[1])
            if kind != qtype:
                fell_back.append(name)
            w = quantize(w, kind)
        yield name, w
    if fell_back:
        logger.warning(
            "%d weights are not whole %s blocks wide and were quantized to %s instead (%s, ...)",
            len(fell_back),
            qtype,
            FALLBACK[qtype],
            fell_back[0],
        )
