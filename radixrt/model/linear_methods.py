"""Linear methods: how a linear layer's weight is laid out and multiplied.

A method is chosen once, when the model is built (``radixrt.model.kernel_set``),
and the layer calls it on every forward:

- ``prepare(w)`` runs once after the weights are loaded and returns the
  weight in the method's layout (the layer keeps that tensor);
- ``apply(x, w, bias, n)`` is x [.., K] · Wᵀ + bias → [.., n] in x's dtype,
  for W [n, K] as ``prepare`` returned it;
- ``logits(x, w, n)`` is the same without a bias, widened to float32 (an LM
  head).

``LinearMethod`` is PyTorch's ``F.linear``; ``TorchFP32Linear`` PyTorch's
float32 linear on a float32 copy of the weight; ``OneDNNLinear`` keeps the
weight in oneDNN's blocked bf16 layout; ``PackedLinear`` in the layout of
``radixrt_kernels.cpu.linear``, whose kernels (AMX, AVX512-BF16, FMA) all read
it, so it may run one kernel for decode-sized calls and another for
prefill-sized ones (``PackedKernels``). ``ByRows`` does the same across
methods of different layouts, holding the weight in both. ``PackedF32Linear``
runs a float32 model's linears on the float32 kernel of the same module.
``PadK`` gives a method whose kernels take whole chunks of input features a
weight of any width (weight and inputs padded with zeros). Two fused forms
take the step after the linear into the packed kernels' pass:

- a gated method turns [gate; up] (weight [2N, K]) into silu(gate)·up [.., N]:
  ``PackedGatedLinear``, or ``ActAfter`` (any linear method, then the
  activation);
- a rotary qkv method returns q, k, v with q and k rotated at the token
  positions: ``PackedRotaryQKV``, or ``RotateAfter`` (any linear method, then
  the rotary kernel).

Inductor cannot lower the packed layouts, so under ``torch.compile`` the
oneDNN and packed kernels run as the opaque ops ``radixrt::onednn_linear``,
``radixrt::packed_linear`` (which picks its kernel by the row count inside)
and ``radixrt::f32_linear``: the graph calls the very kernels eager mode runs.

Row invariance (a row's results the same bits whatever rows share the call):
each packed kernel and the float32 kernel have it, alone and in every form
here (``PadK`` included); ``PackedKernels`` with two different kernels,
``ByRows``, oneDNN and PyTorch's linears do not.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear
from radixrt_kernels.cpu.capture import small_side


class LinearMethod:
    """PyTorch's linear on the weight as loaded."""

    name = "torch"
    layout = "plain"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def apply(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return F.linear(x, w, bias)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.apply(x, w, None, n).float()


class OneDNNLinear(LinearMethod):
    """oneDNN's bf16 linear on a weight reordered once into its blocked layout (equal to
    ``F.linear``, which reorders the weight on every call)."""

    name = "onednn"
    layout = "onednn"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return _ONEDNN_PACK(w, None)

    def apply(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return onednn_linear(x, w, bias)


class TorchFP32Linear(LinearMethod):
    """PyTorch's float32 linear on a float32 copy of the weight (twice the bf16 bytes), x widened
    and the result rounded to bf16 once: where float32 FMA outruns every bf16 path."""

    name = "torch_fp32"
    layout = "fp32"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return w.float()

    def apply(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.apply(x, w, None, n).float()


class PackedKernels(NamedTuple):
    """Which ``cpu_linear`` kernel runs a call on packed weights: ``small`` for up to
    ``threshold`` rows (decode-sized), ``large`` above (prefill-sized)."""

    small: str
    large: str
    threshold: int = 64

    @property
    def name(self) -> str:
        if self.small == self.large:
            return self.small
        return f"{self.small} (rows <= {self.threshold}), {self.large}"


class PackedLinear(LinearMethod):
    """The C kernels of ``radixrt_kernels.cpu.linear`` (AMX, AVX512-BF16, FMA) on a bf16
    weight packed once; all three read the same layout."""

    layout = "packed"

    def __init__(self, lib: ctypes.CDLL, kernels: PackedKernels) -> None:
        self.lib, self.kernels = lib, kernels
        self.name = kernels.name

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return cpu_linear.pack(self.lib, w)

    def apply(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return packed_linear(x, w, bias, n, self.kernels)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return packed_linear(x, w, None, n, self.kernels, float_out=True)  # widened in the pass


class PackedF32Linear(LinearMethod):
    """The float32 kernel of ``radixrt_kernels.cpu.linear`` (``linear_f32``) on a float32 weight
    packed once: each row's results the same bits whatever the rows beside it."""

    name = "f32"
    layout = "packed-f32"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return cpu_linear.pack_f32(w)

    def apply(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _f32_linear_op(x, w, bias, n)
        return cpu_linear.linear_f32(self.lib, x, w, n, bias)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.apply(x, w, None, n)


class PadK:
    """A method whose kernels take whole chunks of ``multiple`` input features, on a weight of
    ``k`` features: the weight and every x padded with zero features at the end (the padded
    products are the same zeros for every row, so a row's bits still depend on its own features
    alone). Works for the plain, gated and rotary forms: ``apply``'s arguments after the weight
    pass through."""

    def __init__(self, method, k: int, multiple: int = cpu_linear.K_MULTIPLE) -> None:
        self.method, self.pad = method, -k % multiple
        self.name = f"{method.name} (in_features padded to {k + self.pad})"
        self.layout = _layout(method)

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return self.method.prepare(F.pad(w, (0, self.pad)))

    def apply(self, x: torch.Tensor, w: torch.Tensor, *args):
        return self.method.apply(F.pad(x, (0, self.pad)), w, *args)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.method.logits(F.pad(x, (0, self.pad)), w, n)


class ByRows(LinearMethod):
    """One method for up to ``threshold`` rows, another above, each on its own layout of the
    weight where the two differ (the second copy held here). Works for the plain, gated and
    rotary forms alike: ``apply``'s arguments after the weight pass through."""

    def __init__(self, small, large, threshold: int = 64) -> None:
        self.small, self.large, self.threshold = small, large, threshold
        self.name = f"{small.name} (rows <= {threshold}), {large.name}"
        self.small_w: torch.Tensor | None = None  # the small method's layout, when its own

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        if _layout(self.small) != _layout(self.large):
            self.small_w = self.small.prepare(w)
        return self.large.prepare(w)

    def _side(self, x: torch.Tensor, w: torch.Tensor):
        """(the method for x's row count, the weight in its layout)."""
        if small_side(x.shape[0], self.threshold):
            return self.small, w if self.small_w is None else self.small_w
        return self.large, w

    def apply(self, x: torch.Tensor, w: torch.Tensor, *args):
        method, weight = self._side(x, w)
        return method.apply(x, weight, *args)

    def logits(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        method, weight = self._side(x, w)
        return method.logits(x, weight, n)


def _layout(method) -> str:
    """What a method's ``prepare`` produces: methods of one layout share the prepared weight."""
    inner = getattr(method, "linear", method)  # the fused forms: their linear's layout
    return getattr(inner, "layout", inner.name)


# ---- [gate; up] → silu(gate)·up ------------------------------------------------------------


class ActAfter:
    """A linear method, then an activation of its [.., 2N] output: [.., N]."""

    def __init__(self, linear: LinearMethod, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.linear, self.act = linear, act
        self.name = f"{linear.name}, then {getattr(act, 'name', 'act')}"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return self.linear.prepare(w)

    def apply(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return self.act(self.linear.apply(x, w, None, n))


class PackedGatedLinear:
    """The packed kernels with SiLU-and-mul in their pass: gate and up blocks interleaved at
    packing, rounded as ``elementwise.silu_mul`` rounds the two products."""

    layout = "packed-gated"

    def __init__(self, lib: ctypes.CDLL, kernels: PackedKernels) -> None:
        self.lib, self.kernels = lib, kernels
        self.name = f"{kernels.name} + silu_mul"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return cpu_linear.pack(self.lib, w, gated=True)

    def apply(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return packed_linear(x, w, None, n, self.kernels, gated=True)


# ---- qkv with q and k rotated ---------------------------------------------------------------


class QKVShape(NamedTuple):
    """The head layout of a qkv output row: [q heads | k heads | v heads], each head_dim wide."""

    head_dim: int
    num_heads: int
    num_kv_heads: int

    @property
    def qk_cols(self) -> int:
        return (self.num_heads + self.num_kv_heads) * self.head_dim


class RotateAfter:
    """A linear method, then the rotary embedding of q and k side by side (one call for both)."""

    def __init__(self, linear: LinearMethod, shape: QKVShape) -> None:
        self.linear, self.shape = linear, shape
        self.name = f"{linear.name}, then rotary"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return self.linear.prepare(w)

    def apply(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        positions: torch.Tensor,
        rotary,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q and k rotated [T, H + KH, D], v [T, KH, D])."""
        qkv = self.linear.apply(x, w, bias, n)
        t, (d, cols) = qkv.shape[0], (self.shape.head_dim, self.shape.qk_cols)
        qk = rotary(positions, qkv[:, :cols].view(t, -1, d))
        return qk, qkv[:, cols:].view(t, -1, d)


class PackedRotaryQKV:
    """The packed kernels rotating q and k while they write them (heads of 64 or 128)."""

    layout = "packed"

    def __init__(self, lib: ctypes.CDLL, shape: QKVShape, kernels: PackedKernels) -> None:
        self.lib, self.shape, self.kernels = lib, shape, kernels
        self.name = f"{kernels.name} + rotary"

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return cpu_linear.pack(self.lib, w)

    def apply(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        positions: torch.Tensor,
        rotary,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d, cols = self.shape.head_dim, self.shape.qk_cols
        rope = cpu_linear.Rope(positions, rotary.cos, rotary.sin_signed, d, cols)
        qkv = packed_linear(x, w, bias, n, self.kernels, rope=rope)
        t = qkv.shape[0]
        return qkv[:, :cols].view(t, -1, d), qkv[:, cols:].view(t, -1, d)


# ---- the kernels, and their opaque ops for torch.compile ------------------------------------

_ONEDNN_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def onednn_works() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear ops and they give F.linear's
    results on a bf16 weight."""
    if _ONEDNN_LINEAR is None or _ONEDNN_PACK is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 96, generator=gen).bfloat16()
        x = torch.randn(3, 96, generator=gen).bfloat16()
        got = onednn_linear(x, _ONEDNN_PACK(w, None), None)
        return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except RuntimeError:
        return False


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for a oneDNN-packed weight."""
    if torch.compiler.is_compiling():
        return _onednn_linear_op(x, weight, bias, weight.shape[0])
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


@torch.library.custom_op("radixrt::onednn_linear", mutates_args=())
def _onednn_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


@_onednn_linear_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    kernels: PackedKernels,
    float_out: bool = False,
    gated: bool = False,
    rope: cpu_linear.Rope | None = None,
) -> torch.Tensor:
    """x @ W.T + bias for W packed by ``linear.pack`` (bf16; float32 with ``float_out``;
    silu(gate)·up, [.., out_features / 2], for a weight packed ``gated``; q and k rotated with
    ``rope``), by the kernel ``kernels`` names for x's row count."""
    if torch.compiler.is_compiling():
        r = rope or cpu_linear.Rope(None, None, None, 0, 0)
        return _packed_linear_op(x, packed, bias, out_features, float_out, gated, *r, *kernels)
    kernel = kernels.small if small_side(x.shape[0], kernels.threshold) else kernels.large
    return cpu_linear.linear(
        cpu_library.loaded(), x, packed, out_features, bias, float_out, gated, rope, kernel
    )


@torch.library.custom_op("radixrt::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    float_out: bool,
    gated: bool,
    positions: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin_signed: torch.Tensor | None,
    head_dim: int,
    rope_cols: int,
    small: str,
    large: str,
    threshold: int,
) -> torch.Tensor:
    rope = None
    if positions is not None:
        rope = cpu_linear.Rope(positions, cos, sin_signed, head_dim, rope_cols)
    kernel = small if x.shape[0] <= threshold else large
    return cpu_linear.linear(
        cpu_library.loaded(), x, packed, out_features, bias, float_out, gated, rope, kernel
    )


@_packed_linear_op.register_fake
def _(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    float_out: bool,
    gated: bool,
    positions: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin_signed: torch.Tensor | None,
    head_dim: int,
    rope_cols: int,
    small: str,
    large: str,
    threshold: int,
) -> torch.Tensor:
    width = out_features // 2 if gated else out_features
    return x.new_empty(*x.shape[:-1], width, dtype=torch.float32 if float_out else x.dtype)


@torch.library.custom_op("radixrt::f32_linear", mutates_args=())
def _f32_linear_op(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return cpu_linear.linear_f32(cpu_library.loaded(), x, packed, out_features, bias)


@_f32_linear_op.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
