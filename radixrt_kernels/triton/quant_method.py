"""The linear method of quantized weights on a CUDA device: ``TritonQuantLinear(segments,
device)``, with ``radixrt.quant.quant_linear.QuantLinear``'s interface (``prepare``, ``apply``,
``logits``, ``layout``, ``name``) and its bits.

A weight is ``formats.QuantTensor`` segments stacked in row order (one per run of a block
type: a q/k/v or gate/up weight may mix types). ``prepare`` keeps each segment's GGUF blocks
as they are, concatenated flat on the device; ``apply`` quantizes x once and runs each
segment's ``quant_matmul`` into its columns of one output. Every output is
``radixrt.quant.arithmetic.linear``'s, bit for bit, whatever the row count, so the method is
row-invariant and serves exact mode as it is.
"""

from __future__ import annotations

import torch

from radixrt.quant import arithmetic
from radixrt.quant.formats import QuantTensor
from radixrt_kernels.triton.quant_matmul import quant_matmul, quantize_x


class TritonQuantLinear:
    """x [.., K] · Wᵀ (+ bias) for W the stacked ``segments``, on ``device`` (module text)."""

    layout = "quantized"

    def __init__(self, segments: list[QuantTensor], device: torch.device | str) -> None:
        if not segments or len({s.k for s in segments}) != 1:
            raise ValueError("a quantized weight needs segments of one input width")
        for s in segments:
            if s.qtype not in arithmetic.BLOCK:
                raise ValueError(f"the Triton quantized linears take no {s.qtype} weight")
            if s.k % arithmetic.BLOCK[s.qtype]:
                raise ValueError(f"{s.qtype}: K = {s.k} is not whole blocks of it")
        self.device, self.k = torch.device(device), segments[0].k
        self.types = [s.qtype for s in segments]
        self.rows = [s.shape[0] for s in segments]
        self.row_bytes = [
            self.k // arithmetic.BLOCK[t] * arithmetic.TYPE_SIZE[t] for t in self.types
        ]
        self.name = "+".join(dict.fromkeys(self.types)) + " (triton)"

    def type_paths(self) -> dict[str, str]:
        """Each type's kernel (``QuantLinear.type_paths``'s form)."""
        return dict.fromkeys(self.types, "triton")

    def prepare(self, segments: list[QuantTensor]) -> torch.Tensor:
        """The segments' blocks, as stored, one flat uint8 tensor on the device."""
        if [s.shape[0] for s in segments] != self.rows or [s.qtype for s in segments] != self.types:
            raise ValueError("prepare takes the segments the method was made for")
        return torch.cat([s.raw.reshape(-1) for s in segments]).to(self.device)

    def apply(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if n != sum(self.rows):
            raise ValueError(f"{n} outputs asked of a weight of {sum(self.rows)} rows")
        lead, x2 = x.shape[:-1], x.reshape(-1, self.k)
        out = torch.empty(x2.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
        act = quantize_x(x2)
        row = at = 0
        for qtype, rows, size in zip(self.types, self.rows, self.row_bytes):
            raw = w[at : at + rows * size].view(rows, size)
            b = None if bias is None else bias[row : row + rows]
            quant_matmul(qtype, act, raw, self.k, b, out[:, row : row + rows])
            row, at = row + rows, at + rows * size
        return out.reshape(*lead, n)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.apply(x, w, None, n, torch.float32)
