"""GGUF block formats and quantized tensors.

A quantized weight [N, K] is N rows of K // block GGUF blocks each, stored as the file stores
them: ``raw`` uint8 [N, K // block · type_size]. Rows are independent, so a row permutation or
a stack of weights (q, k, v) is a permutation or concatenation of raw rows.
``BLOCK_TYPES`` names the types radixrt serves (their layouts are the ``gguf`` package's and
llama.cpp's); ``dequantize`` gives their values with the ``gguf`` package's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class BlockType(NamedTuple):
    name: str
    ggml: int  # gguf.GGMLQuantizationType value
    block: int  # weights per block
    type_size: int  # bytes per block


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q5_0", 6, 32, 22),
        BlockType("Q5_1", 7, 32, 24),
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q4_K", 12, 256, 144),
        BlockType("Q5_K", 13, 256, 176),
        BlockType("Q6_K", 14, 256, 210),
    )
}
DENSE_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def block_type(name: str) -> BlockType:
    """The block type ``name``; ValueError naming the types served for any other."""
    try:
        return BLOCK_TYPES[name]
    except KeyError:
        raise ValueError(
            f"quantized type {name!r} is not served (served: {', '.join(BLOCK_TYPES)})"
        ) from None


def row_bytes(name: str, k: int) -> int:
    """Bytes of one row of ``k`` weights of type ``name``; ValueError where k is not a whole
    number of blocks."""
    t = block_type(name)
    if k <= 0 or k % t.block:
        raise ValueError(f"{name} rows hold whole blocks of {t.block} weights; got {k} weights")
    return k // t.block * t.type_size


@dataclass
class QuantTensor:
    """A quantized weight [n, k] of type ``qtype``: ``raw`` uint8 [n, row_bytes(qtype, k)]."""

    qtype: str
    raw: torch.Tensor
    k: int

    def __post_init__(self) -> None:
        want = row_bytes(self.qtype, self.k)
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2 or self.raw.shape[1] != want:
            raise ValueError(
                f"{self.qtype} weight of {self.k} columns: raw must be uint8 [rows, {want}], "
                f"got {self.raw.dtype} {list(self.raw.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def rows(self, index: torch.Tensor | slice) -> QuantTensor:
        """These rows (a permutation, a shard, the rows an embedding looks up)."""
        return QuantTensor(self.qtype, self.raw[index], self.k)

    def dequantize(self) -> torch.Tensor:
        """The float32 values [n, k] (the ``gguf`` package's arithmetic)."""
        return dequantize(self.qtype, self.raw, self.k)


def dequantize(qtype: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [n, k] values of ``raw`` uint8 [n, row_bytes] blocks of type ``qtype``, as
    ``gguf.quants.dequantize`` computes them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    t = block_type(qtype)
    row_bytes(qtype, k)
    data = np.ascontiguousarray(raw.numpy())
    values = gguf_dequantize(data, GGMLQuantizationType(t.ggml))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, k)


def stack(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Consecutive parts of one type joined (their rows one after another): the segments a
    stacked weight (q, k, v; gate, up) runs as, one per run of a type."""
    out: list[QuantTensor] = []
    for part in parts:
        if out and out[-1].qtype == part.qtype and out[-1].k == part.k:
            out[-1] = QuantTensor(part.qtype, torch.cat([out[-1].raw, part.raw]), part.k)
        else:
            out.append(part)
    return out


def random_blocks(
    qtype: str, n: int, k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random ``qtype`` blocks for a weight [n, k] (uint8 [n, k // block · type_size]) whose every
    fp16 field is a normal number between 2^-7 and 2^-4 (subnormal scales would time the CPU's
    denormal assists): for timing the kernels."""
    t = BLOCK_TYPES[qtype]
    raw = torch.randint(
        0, 256, (n, k // t.block, t.type_size), dtype=torch.uint8, generator=generator
    )
    raw[..., 1::2] = (raw[..., 1::2] & 0x83) | 0x20  # every fp16 field's high byte: its exponent
    return raw.view(n, -1)
