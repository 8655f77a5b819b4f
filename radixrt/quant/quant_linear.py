"""The linear method of quantized weights.

``QuantLinear(lib, segments, paths)`` runs a weight given as ``formats.QuantTensor`` segments
(one per run of a block type: a stacked q/k/v or gate/up weight may mix types), each segment's
call writing its columns of one output (``cpu_quant.linear_stacked``). Each segment runs the C
kernel of its type (``radixrt_kernels.cpu.quant``; without the library, the same arithmetic in
PyTorch) on the path ``paths`` gives it for the call's rows (``QuantChoice``: one path up to
its ``rows``, another above; None: the library's rule). Every path gives the same bits, and a
row's bits do not depend on the rows beside it, so the method serves exact mode as it is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from typing import Any

import torch

from radixrt.model.calibrate import QuantChoice
from radixrt.quant.formats import QuantTensor
from radixrt_kernels.cpu import quant as cpu_quant
from radixrt_kernels.cpu.capture import small_side


class QuantLinear:
    """x [.., K] · Wᵀ (+ bias) for W the stacked ``segments`` (module text)."""

    layout = "quantized"

    def __init__(
        self,
        lib: ctypes.CDLL | None,
        segments: list[QuantTensor],
        paths: list[QuantChoice] | None = None,
    ) -> None:
        if not segments or len({s.k for s in segments}) != 1:
            raise ValueError("a quantized weight needs segments of one input width")
        for s in segments:
            if not cpu_quant.supported(lib, s.qtype):
                raise ValueError(f"the quantized linear kernels take no {s.qtype} weight")
        self.lib, self.k = lib, segments[0].k
        self.types = [s.qtype for s in segments]
        self.rows = [s.shape[0] for s in segments]
        if paths is None:
            rule = cpu_quant.path  # the library's choice by rows
            paths = [QuantChoice(rule(lib, t, 1), rule(lib, t, 512), 1) for t in self.types]
            paths = [c._replace(rows=_rule_rows(lib, t, c)) for t, c in zip(self.types, paths)]
        elif lib is None:
            raise ValueError("a quantized weight's paths need the kernels' library")
        for t, choice in zip(self.types, paths):
            for p in (choice.small, choice.large):
                if lib is not None and not cpu_quant.path_available(lib, t, p):
                    raise ValueError(f"the {p} path does not run {t} weights here")
        self.paths = [None if lib is None else c for c in paths]
        self.shapes: list[torch.Size] = []
        self.name = self._name()

    def _name(self) -> str:
        """Each type and its paths: 'Q4_1: small', 'Q4_1: small up to n rows, large above'
        (without the library: 'Q4_1 (torch)')."""
        if self.lib is None:
            return "+".join(dict.fromkeys(self.types)) + " (torch)"
        return "; ".join(f"{t}: {p}" for t, p in self.type_paths().items())

    def type_paths(self) -> dict[str, str]:
        """Each type's paths: 'small', or 'small up to n rows, large above'."""
        names = {}
        for t, c in zip(self.types, self.paths):
            if c is None:
                names[t] = "reference"
            elif c.small == c.large:
                names[t] = c.small
            else:
                names[t] = f"{c.small} up to {c.rows} rows, {c.large} above"
        return names

    def prepare(self, segments: list[QuantTensor]) -> torch.Tensor:
        """Every segment in its kernel's layout, as one flat uint8 tensor."""
        packed = [cpu_quant.pack(self.lib, s.qtype, s.raw, s.k) for s in segments]
        self.shapes = [p.shape for p in packed]
        return torch.cat([p.reshape(-1).view(torch.uint8) for p in packed])

    def _segments(self, w: torch.Tensor, m: int) -> list[cpu_quant.Segment]:
        """The segments of a call of m rows, each on its path for that class of calls."""
        sizes = [s.numel() for s in self.shapes]
        return [
            cpu_quant.Segment(
                qtype,
                p.view(shape),
                rows,
                None if c is None else c.small if small_side(m, c.rows) else c.large,
            )
            for qtype, rows, p, shape, c in zip(
                self.types, self.rows, w.split(sizes), self.shapes, self.paths
            )
        ]

    def apply(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        m = x.numel() // self.k
        return cpu_quant.linear_stacked(self.lib, x, self._segments(w, m), self.k, bias, out_dtype)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.apply(x, w, None, n, torch.float32)


def _rule_rows(lib, qtype: str, choice: QuantChoice) -> int:
    """The most rows the library's rule gives ``choice.small``."""
    rows = 1
    while rows < 512 and cpu_quant.path(lib, qtype, rows + 1) == choice.small:
        rows += 1
    return rows


def _linear_of(method):
    """The QuantLinear inside a method's wrappers (ActAfter, RotateAfter), or None."""
    while not isinstance(method, QuantLinear):
        method = getattr(method, "linear", None)
        if method is None:
            return None
    return method


def describe_weights(model: torch.nn.Module, lib: ctypes.CDLL | None) -> dict[str, object]:
    """What the model's weights are and run on: per role (the module's name without its layer
    index) the block types (or dtype) and the kernel paths by the rows of a call; the bytes the
    model's tensors hold (``held_tensors``: each storage once)."""
    roles: dict[str, str] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "matmul_weight", None)
        if weight is None:
            weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not hasattr(module, "method"):
            continue
        role = ".".join(p for p in name.split(".") if not p.isdigit())
        q = _linear_of(module.method)
        if q is None:
            roles[role] = f"{weight.dtype} ({module.method.name})".replace("torch.", "")
        else:
            roles[role] = q.name
    held = sum(nbytes for _, nbytes in held_tensors(model))
    return {"weights": roles, "weight_bytes": held}


def held_tensors(model) -> dict[tuple[int, int], str]:
    """Every distinct storage (data pointer, bytes) a model's modules hold, in parameters,
    buffers, attributes and what hangs off a parameter (``param.quant``), with the name of its
    first holder (layer indices as ``N``)."""
    found: dict[tuple[int, int], str] = {}
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, value in vars(mod).items():
            if key in ("_parameters", "_buffers"):
                for k, v in value.items():
                    _visit(v, f"{prefix}{k}", found, 0)
            elif key != "_modules":
                _visit(value, f"{prefix}{key}", found, 0)
    return {k: re.sub(r"\.\d+\.", ".N.", v) for k, v in found.items()}


def _visit(value: Any, where: str, found: dict, depth: int) -> None:
    if depth > 3 or value is None:
        return
    if isinstance(value, torch.Tensor):
        s = value.untyped_storage()
        found.setdefault((s.data_ptr(), s.nbytes()), where)
        for k, v in getattr(value, "__dict__", {}).items():
            _visit(v, f"{where}.{k}", found, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _visit(v, f"{where}[{k}]", found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _visit(v, f"{where}[{i}]", found, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a QuantTensor
        for f in dataclasses.fields(value):
            _visit(getattr(value, f.name), f"{where}.{f.name}", found, depth + 1)
