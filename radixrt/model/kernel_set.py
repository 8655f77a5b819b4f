"""The kernels a model's layers run, chosen once when the model is built.

``choose_kernels(device, dtype, lib, compiled)`` looks at what this process
has (the CPU kernels' library ``lib`` from ``radixrt_kernels.cpu.library``,
the AMX linear kernel in it, oneDNN in PyTorch) and returns a ``Kernels``:
the linear method per layer shape, the RMS norm, the rotary embedding and the
SiLU-and-mul. The layers take their kernel objects from it when constructed
and never look again, so each ``forward`` has one path.

- Linears: bf16 on the CPU, the AMX kernel where the library has it and the
  weight's shape suits it, else oneDNN's packed layout, else PyTorch; every
  other dtype or device, PyTorch. The AMX kernel also takes an MLP's
  SiLU-and-mul and a qkv projection's rotary embedding into its pass.
- Elementwise steps: on the CPU in float32 or bf16 with the library, one C
  call each (``radixrt_kernels.cpu.ops``); otherwise PyTorch's ops. A model
  built for ``torch.compile`` keeps PyTorch's elementwise ops, which Inductor
  fuses into the surrounding graph.
Every path gives PyTorch's results up to the last bit of bf16 rounding (the
kernels' modules say where they round).
"""

from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixrt.model.calibrate import PACKED, THRESHOLD, Calibrator, Choice, make_method
from radixrt.model.linear_methods import (
    ActAfter,
    ByRows,
    LinearMethod,
    PackedGatedLinear,
    PackedKernels,
    PackedLinear,
    PackedRotaryQKV,
    QKVShape,
    RotateAfter,
    onednn_works,
)
from radixrt_kernels.cpu import elementwise as cpu_ops
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear

# ---- elementwise kernels: PyTorch's ops --------------------------------------------------------


class TorchRMSNorm:
    """weight · x·rsqrt(mean(x²) + eps), computed in float32 as Hugging Face's Llama does; with a
    residual, the norm of x + residual, returned with that sum."""

    name = "torch"

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual = x + residual
        normed = weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)
        return normed if residual is None else (normed, residual)


class TorchRotary:
    """Neox rotation of x [T, N, D] at positions [T] by float32 tables cos and sin± [*, D]:
    x·cos + roll(x, D/2)·sin± (rotate_half(x)·sin, bit for bit). Returns a new tensor."""

    name = "torch"

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        c = cos[positions].unsqueeze(1).to(x.dtype)
        s = sin_signed[positions].unsqueeze(1).to(x.dtype)
        return x * c + x.roll(x.shape[-1] // 2, -1) * s


class TorchSiluMul:
    """silu(x[.., :N]) · x[.., N:] → [.., N]."""

    name = "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# ---- elementwise kernels: the C library ---------------------------------------------------------
# Each takes what the C function takes (2-D rows for the norm and SiLU-and-mul, heads contiguous
# for the rotation) and hands any other layout to PyTorch's op, with the same roundings.


class CRMSNorm(TorchRMSNorm):
    name = "c"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (
            x.dim() not in (2, 3)
            or weight.dtype != x.dtype
            or (x.dim() == 3 and residual is not None)
        ):
            return super().__call__(x, weight, eps, residual)
        if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return cpu_ops.rms_norm(self.lib, x, weight, eps, out=x)  # each head, in place
        if residual is None:
            return cpu_ops.rms_norm(self.lib, x, weight, eps)
        residual = residual.contiguous()  # receives x + residual
        return cpu_ops.rms_norm(self.lib, x, weight, eps, residual), residual


class CRotary(TorchRotary):
    """Rotates x in place (callers pass a tensor of their own) and returns it."""

    name = "c"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return super().__call__(x, positions, cos, sin_signed)
        return cpu_ops.rope_(self.lib, x, positions, cos, sin_signed)


class CSiluMul(TorchSiluMul):
    name = "c"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return super().__call__(x)
        return cpu_ops.silu_mul(self.lib, x)


# ---- the set ------------------------------------------------------------------------------------


class Kernels:
    """One model's kernels. ``linear`` says which linear path each weight shape runs: a path
    name for every shape (one of ``calibrate.PATHS``), or a function (n, k, large) -> Choice,
    such as a ``Calibrator``'s ``choice``; ``lib`` is the CPU kernels' library, which the packed
    paths need. ``compiled``: the model runs under torch.compile, where a layer takes one
    weight layout (the packed kernels still pick theirs per call)."""

    def __init__(
        self,
        linear: str | Callable[..., Choice] = "torch",
        lib: ctypes.CDLL | None = None,
        norm: TorchRMSNorm | None = None,
        rotary: TorchRotary | None = None,
        act: TorchSiluMul | None = None,
        compiled: bool = False,
    ) -> None:
        if isinstance(linear, str):
            path = linear
            linear = lambda n, k, large=True: Choice(path, path)  # noqa: E731
        self.choose = linear
        self.lib, self.compiled = lib, compiled
        self.norm = norm or TorchRMSNorm()
        self.rotary = rotary or TorchRotary()
        self.act = act or TorchSiluMul()
        self.chosen: dict[str, str] = {}  # "n x k" → the path(s) it runs, for describe()

    def _choice(self, n: int, k: int, large: bool = True) -> Choice:
        choice = self.choose(n, k, large)
        if k % cpu_linear.K_MULTIPLE:  # the packed kernels take whole chunks of input features
            choice = Choice(
                *(p if p not in PACKED else "onednn" if onednn_works() else "torch" for p in choice)
            )
        mixed = not (choice.small in PACKED and choice.large in PACKED)
        if self.compiled and mixed and choice.small != choice.large:
            choice = Choice(choice.small, choice.small)  # one layout: the decode-sized path's
        self.chosen[f"{n}x{k}"] = (
            choice.small
            if choice.small == choice.large
            else (f"{choice.small} (rows <= {THRESHOLD}), {choice.large}")
        )
        return choice

    def _plain(self, small: str, big: str) -> LinearMethod:
        """The plain method for ``small`` (and, when packed, ``big`` above THRESHOLD rows)."""
        if small in PACKED:
            return PackedLinear(self.lib, PackedKernels(small, big, THRESHOLD))
        return make_method(small, self.lib)

    def _split(self, choice: Choice, form):
        """``form(path, path)`` for both classes of calls, or by rows when they differ."""
        if choice.small == choice.large:
            return form(choice.small, choice.small)
        if choice.small in PACKED and choice.large in PACKED:
            return form(choice.small, choice.large)
        return ByRows(form(choice.small, choice.small), form(choice.large, choice.large), THRESHOLD)

    def linear_for(self, out_features: int, in_features: int, large: bool = True) -> LinearMethod:
        """The method for a weight [out_features, in_features] (``large`` False: it never sees
        more than decode-sized calls)."""
        return self._split(self._choice(out_features, in_features, large), self._plain)

    def gated_for(self, half: int, in_features: int):
        """[gate; up] [2·half, in_features] → silu(gate)·up."""
        choice = self._choice(2 * half, in_features)

        def form(small: str, big: str):
            if small in PACKED and (2 * half) % 64 == 0:
                return PackedGatedLinear(self.lib, PackedKernels(small, big, THRESHOLD))
            return ActAfter(self._plain(small, big), self.act)

        return self._split(choice, form)

    def rotary_qkv_for(self, shape: QKVShape, out_features: int, in_features: int):
        """qkv [out_features, in_features] → q and k rotated, v."""
        choice = self._choice(out_features, in_features)

        def form(small: str, big: str):
            if small in PACKED and cpu_linear.rope_fusable(shape.head_dim):
                return PackedRotaryQKV(self.lib, shape, PackedKernels(small, big, THRESHOLD))
            return RotateAfter(self._plain(small, big), shape)

        return self._split(choice, form)

    def describe(self) -> dict[str, object]:
        """The elementwise kernels' names and each linear shape's path(s)."""
        return {
            "linear": dict(self.chosen),
            "rms_norm": self.norm.name,
            "rotary": self.rotary.name,
            "silu_mul": self.act.name,
        }


def choose_kernels(
    device: torch.device,
    dtype: torch.dtype,
    lib: ctypes.CDLL | None,
    compiled: bool = False,
    linear: str = "auto",
    cache_dir: str | None = None,
) -> Kernels:
    """The kernels for a model of ``dtype`` on ``device`` (``lib``: the CPU kernels' library, or
    None; ``compiled``: the model runs under torch.compile). ``linear``: "auto" measures each
    bf16 CPU weight shape's fastest path (``calibrate.Calibrator``, its results kept under
    ``cache_dir``); a path name runs that path everywhere it can."""
    if device.type != "cpu":
        return Kernels()
    elementwise = {}
    if lib is not None and dtype in cpu_ops.DTYPES and not compiled:
        elementwise = {"norm": CRMSNorm(lib), "rotary": CRotary(lib), "act": CSiluMul(lib)}
    if dtype != torch.bfloat16:
        return Kernels(**elementwise)
    if linear != "auto":
        if linear in PACKED and not cpu_linear.kernel_available(lib, linear):
            raise ValueError(
                f"linear_kernel {linear!r} does not run on this CPU (or without the "
                f"kernels' library: {cpu_library.why_unavailable()})"
            )
        return Kernels(linear, lib, compiled=compiled, **elementwise)
    if lib is None:  # no packed kernels: oneDNN where it works, else PyTorch's bf16 linear
        return Kernels("onednn" if onednn_works() else "torch", compiled=compiled, **elementwise)
    calibrator = Calibrator(lib, cache_dir or tempfile.gettempdir(), chained=not compiled)
    return Kernels(calibrator.choice, lib, compiled=compiled, **elementwise)
