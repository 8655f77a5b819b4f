"""A forward's CPU kernel calls captured once and replayed as one chain.

While ``capture()`` is active, the CPU kernels' wrappers (``elementwise.rms_norm``,
``elementwise.rope_``, ``elementwise.silu_mul``, ``linear.linear``, ``quant.linear``,
``attention.attention``) compute
nothing: each hands its call to the ``Recorder``, which allocates the output the
wrapper would return and notes the call as a step of ``chain.Chain``. The
code calling them (a model's forward) runs as it always does, so the steps are
its steps, in its order; the recorder knows no model.

A forward either captures whole or not at all. Every other tensor operation it
makes must be a view or a read of metadata: anything that computes (an add, a
copy, an op on PyTorch's kernels) raises ``ChainRefused`` naming the operation
and where it was called, as does a kernel call a chain has no step for
(the AMX linear, a packed linear's float32 output, a copy the wrapper would make
of a badly strided input).

A capture at m rows also serves other row counts: the code chooses by row
count only through ``small_side`` (a call of at most a threshold's rows takes
one kernel or path, a larger one another), which notes each choice on the
recorder, so ``Recorder.rows`` is the range of row counts that choose as m
did. A replay runs any row count in that range up to m with the same steps.

``chain.replay(lib, recorder, outputs, rows)`` turns a finished capture into a
chain that replays it. This module imports nothing of the library, so every
wrapper can ask ``capturing()`` first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

CHAIN_LINEAR_KERNELS = ("fma", "avx512_bf16")  # the linear kernels chain.c runs
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_COMPUTING_SCALARS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class ChainRefused(Exception):
    """The captured code did something a chain cannot replay (the message says what)."""


class Step(NamedTuple):
    kind: str  # a Chain builder: "norm", "linear", "quant_linear", "rope", "silu_mul", "attention"
    args: tuple  # its arguments (attention: q, k_buf, v_buf, new_k, new_v, out, scaling, dots,
    # window, softcap)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)


def storage(t: torch.Tensor) -> int:
    """The address of t's storage (an opaque tensor, such as oneDNN's packed weight: a key of
    its own)."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return -id(t)


def heads_in_place(x: torch.Tensor) -> bool:
    """Whether the attention kernel reads x [T, H, D] as it is: heads contiguous within a token,
    token rows any multiple of D apart (else its wrapper copies x)."""
    d = x.shape[2]
    return x.stride(2) == 1 and x.stride(1) == d and x.stride(0) % d == 0


def _caller() -> str:
    """file:line of the innermost frame outside torch and the kernels' package."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path and not path.startswith(_PACKAGE):
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class Recorder(TorchFunctionMode):
    """Notes the kernel calls of a forward as chain steps (see the module's text)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Step] = []
        self.allocated: dict[int, torch.Tensor] = {}  # storage address → tensor allocated here
        self.in_kernel = False
        self.rows = (1, None)  # the row counts that choose as this capture's did (None: no limit)

    def chose(self, threshold: int, small: bool) -> None:
        """Note a choice between at most ``threshold`` rows (``small``) and more."""
        low, high = self.rows
        if small:
            self.rows = (low, threshold if high is None else min(high, threshold))
        else:
            self.rows = (max(low, threshold + 1), high)

    # ---- the guard: views and metadata pass, anything that computes is refused ----------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.in_kernel or self._passive(func, args, kwargs, result):
            return result
        name = getattr(func, "__name__", repr(func))
        name = name[2:-2] if name.startswith("__") and name.endswith("__") else name
        raise ChainRefused(f"{name} at {_caller()} computes outside the kernels a chain runs")

    @staticmethod
    def _passive(func, args, kwargs, result) -> bool:
        """Whether ``func`` only viewed or described its inputs."""
        name = getattr(func, "__name__", "")
        if "out" in kwargs or name in _COMPUTING_SCALARS or name == "__setitem__":
            return False
        if name.endswith("_") and not name.endswith("__"):  # in place
            return False
        outs = list(tensors(result))
        if not outs:
            return True
        ins = {storage(t) for t in tensors((args, tuple(kwargs.values())))}
        return all(storage(t) in ins for t in outs)

    @contextmanager
    def _kernel(self) -> Iterator[None]:
        self.in_kernel = True
        try:
            yield
        finally:
            self.in_kernel = False

    def _new(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dtype)
        self.allocated[storage(t)] = t
        return t

    # ---- the kernels' calls -------------------------------------------------------------------

    def refuse(self, what: str) -> None:
        raise ChainRefused(f"{what} at {_caller()} has no chain step")

    def norm(self, x, weight, eps, residual=None, out=None) -> torch.Tensor:
        with self._kernel():
            if out is None:
                out = self._new(*x.shape, dtype=x.dtype)
            self.steps.append(Step("norm", (x, weight, eps, out, residual)))
            return out

    def rope(self, x, positions, cos, sin_signed) -> torch.Tensor:
        self.steps.append(Step("rope", (x, positions, cos, sin_signed)))
        return x

    def linear(self, kernel, x, packed, n, bias, float_out, gated, rope) -> torch.Tensor:
        if kernel not in CHAIN_LINEAR_KERNELS:
            self.refuse(f"the {kernel} linear kernel")
        if float_out or x.dim() != 2:
            self.refuse("a linear with a float32 output or more than 2-D input")
        with self._kernel():
            out = self._new(x.shape[0], n // 2 if gated else n)
        self.steps.append(Step("linear", (kernel, x, packed, n, out, bias, gated, rope)))
        return out

    def quant_linear(self, x, segments, k, bias, out_dtype, force_path) -> torch.Tensor:
        """One step per segment (``quant.Segment``), each writing its columns of one output."""
        if force_path is not None:
            self.refuse(f"a quantized linear forced onto the {force_path} path")
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) < k:
            self.refuse("a quantized linear of a float32 x or of rows to copy")
        with self._kernel():
            out = self._new(x.shape[0], sum(s.n for s in segments), dtype=out_dtype)
            row = 0
            for s in segments:
                b = None if bias is None else bias[row : row + s.n]
                cols = out[:, row : row + s.n]
                step = (s.qtype, x, s.packed, s.n, k, cols, b, s.path)
                self.steps.append(Step("quant_linear", step))
                row += s.n
        return out

    def silu_mul(self, x) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
            self.refuse("SiLU-and-mul of an x other than contiguous bf16 [T, 2N]")
        with self._kernel():
            out = self._new(x.shape[0], x.shape[1] // 2)
        self.steps.append(Step("silu_mul", (x, out)))
        return out

    def attention(
        self, q, k_buf, v_buf, scaling, new_kv, bf16_dots, out, window=None, softcap=None
    ) -> torch.Tensor:
        with self._kernel():
            if new_kv is None or not all(heads_in_place(t) for t in (q, *new_kv[:2])):
                self.refuse("attention without new K/V, or with q, k or v to copy")
            if q.shape[0] > 1 and new_kv[0].stride(0) != new_kv[1].stride(0):
                self.refuse("attention with k and v rows of different strides")
            if out is None:
                out = self._new(*q.shape, dtype=q.dtype)
            args = (q, k_buf, v_buf, new_kv[0], new_kv[1], out, scaling, bf16_dots, window, softcap)
        self.steps.append(Step("attention", args))
        return out


_active: Recorder | None = None


def small_side(rows: int, threshold: int) -> bool:
    """Whether a call of ``rows`` rows takes the side of a choice for at most ``threshold`` rows
    (a decode-sized kernel or path) rather than the side for more. Every choice by row count in
    the code a chain captures goes through here, so that a capture knows which row counts its
    steps serve (``Recorder.rows``)."""
    small = rows <= threshold
    if _active is not None:
        _active.chose(threshold, small)
    return small


def capturing() -> Recorder | None:
    """The active recorder (the kernels' wrappers hand it their calls), or None."""
    return _active


@contextmanager
def capture() -> Iterator[Recorder]:
    """Record the CPU kernel calls of the code inside (see the module's text); does not nest."""
    global _active
    if _active is not None:
        raise RuntimeError("a capture is already active")
    recorder = Recorder()
    _active = recorder
    try:
        with recorder:
            yield recorder
    finally:
        _active = None
