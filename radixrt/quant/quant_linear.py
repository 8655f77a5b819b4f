"""The linear method of quantized weights.

``QuantLinear(lib, segments)`` runs a weight given as ``formats.QuantTensor`` segments (one per
run of a block type: a stacked q/k/v or gate/up weight may mix types), each segment's call
writing its columns of one output (``cpu_quant.linear_stacked``). Each segment runs the C kernel
of its type (``radixrt_kernels.cpu.quant``; without the library, the same arithmetic in
PyTorch): the two give the same bits, and a row's bits do not depend on the rows beside it, so
the method serves exact mode as it is.
"""

from __future__ import annotations

import ctypes

import torch

from radixrt.quant.formats import QuantTensor
from radixrt_kernels.cpu import quant as cpu_quant


class QuantLinear:
    """x [.., K] · Wᵀ (+ bias) for W the stacked ``segments`` (module text)."""

    layout = "quantized"

    def __init__(self, lib: ctypes.CDLL | None, segments: list[QuantTensor]) -> None:
        if not segments or len({s.k for s in segments}) != 1:
            raise ValueError("a quantized weight needs segments of one input width")
        for s in segments:
            if not cpu_quant.supported(lib, s.qtype):
                raise ValueError(f"the quantized linear kernels take no {s.qtype} weight")
        self.lib, self.k = lib, segments[0].k
        self.types = [s.qtype for s in segments]
        self.rows = [s.shape[0] for s in segments]
        self.shapes: list[torch.Size] = []
        where = " (C)" if lib is not None else " (torch)"
        self.name = "+".join(dict.fromkeys(self.types)) + where

    def prepare(self, segments: list[QuantTensor]) -> torch.Tensor:
        """Every segment in its kernel's layout, as one flat uint8 tensor."""
        packed = [cpu_quant.pack(self.lib, s.qtype, s.raw, s.k) for s in segments]
        self.shapes = [p.shape for p in packed]
        return torch.cat([p.reshape(-1).view(torch.uint8) for p in packed])

    def _segments(self, w: torch.Tensor) -> list[cpu_quant.Segment]:
        sizes = [s.numel() for s in self.shapes]
        return [
            cpu_quant.Segment(qtype, p.view(shape), rows)
            for qtype, rows, p, shape in zip(self.types, self.rows, w.split(sizes), self.shapes)
        ]

    def apply(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return cpu_quant.linear_stacked(self.lib, x, self._segments(w), self.k, bias, out_dtype)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.apply(x, w, None, n, torch.float32)
