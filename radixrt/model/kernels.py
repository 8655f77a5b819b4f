"""The kernels a model's layers run, chosen once when the model is built.

``choose_kernels(device, dtype, lib, compiled)`` looks at what this process
has (the CPU kernels' library ``lib`` from ``radixrt_kernels.cpu_library``,
the AMX linear kernel in it, oneDNN in PyTorch) and returns a ``Kernels``:
the linear method per layer shape, the RMS norm, the rotary embedding and the
SiLU-and-mul. The layers take their kernel objects from it when constructed
and never look again, so each ``forward`` has one path.

- Linears: bf16 on the CPU, the AMX kernel where the library has it and the
  weight's shape suits it, else oneDNN's packed layout, else PyTorch; every
  other dtype or device, PyTorch. The AMX kernel also takes an MLP's
  SiLU-and-mul and a qkv projection's rotary embedding into its pass.
- Elementwise steps: on the CPU in float32 or bf16 with the library, one C
  call each (``radixrt_kernels.cpu_ops``); otherwise PyTorch's ops. A model
  built for ``torch.compile`` keeps PyTorch's elementwise ops, which Inductor
  fuses into the surrounding graph.
Every path gives PyTorch's results up to the last bit of bf16 rounding (the
kernels' modules say where they round).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from radixrt.model.linear_methods import (
    ActAfter,
    AmxGatedLinear,
    AmxLinear,
    AmxRotaryQKV,
    LinearMethod,
    OneDNNLinear,
    QKVShape,
    RotateAfter,
    onednn_works,
)
from radixrt_kernels import cpu_linear, cpu_ops

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
        if x.dim() != 2 or weight.dtype != x.dtype:  # a per-head norm of q or k [T, H, D]
            return super().__call__(x, weight, eps, residual)
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
    """One model's kernels. ``linear`` is the method for weights it takes, ``fallback`` for the
    rest; ``amx_lib`` (the library, when the AMX kernel runs) enables the fused forms."""

    def __init__(
        self,
        linear: LinearMethod | None = None,
        fallback: LinearMethod | None = None,
        norm: TorchRMSNorm | None = None,
        rotary: TorchRotary | None = None,
        act: TorchSiluMul | None = None,
        amx_lib: ctypes.CDLL | None = None,
    ) -> None:
        self.linear = linear or LinearMethod()
        self.fallback = fallback or self.linear
        self.norm = norm or TorchRMSNorm()
        self.rotary = rotary or TorchRotary()
        self.act = act or TorchSiluMul()
        self.amx_lib = amx_lib

    def linear_for(self, out_features: int, in_features: int) -> LinearMethod:
        """The method for a weight [out_features, in_features]."""
        if self.amx_lib is not None and not _amx_takes(out_features, in_features):
            return self.fallback
        return self.linear

    def gated_for(self, half: int, in_features: int) -> AmxGatedLinear | ActAfter:
        """[gate; up] [2·half, in_features] → silu(gate)·up."""
        if self.amx_lib is not None and _amx_takes(2 * half, in_features, gated=True):
            return AmxGatedLinear(self.amx_lib)
        return ActAfter(self.linear_for(2 * half, in_features), self.act)

    def rotary_qkv_for(
        self, shape: QKVShape, out_features: int, in_features: int
    ) -> AmxRotaryQKV | RotateAfter:
        """qkv [out_features, in_features] → q and k rotated, v."""
        if (
            self.amx_lib is not None
            and _amx_takes(out_features, in_features)
            and cpu_linear.rope_fusable(shape.head_dim)
        ):
            return AmxRotaryQKV(self.amx_lib, shape)
        return RotateAfter(self.linear_for(out_features, in_features), shape)

    def describe(self) -> dict[str, str]:
        return {
            "linear": self.linear.name,
            "linear_fallback": self.fallback.name,
            "rms_norm": self.norm.name,
            "rotary": self.rotary.name,
            "silu_mul": self.act.name,
        }


def _amx_takes(out_features: int, in_features: int, gated: bool = False) -> bool:
    return in_features % cpu_linear.K_MULTIPLE == 0 and (not gated or out_features % 64 == 0)


def choose_kernels(
    device: torch.device, dtype: torch.dtype, lib: ctypes.CDLL | None, compiled: bool = False
) -> Kernels:
    """The kernels for a model of ``dtype`` on ``device`` (``lib``: the CPU kernels' library, or
    None; ``compiled``: the model runs under torch.compile)."""
    if device.type != "cpu":
        return Kernels()
    elementwise = {}
    if lib is not None and dtype in cpu_ops.DTYPES and not compiled:
        elementwise = {"norm": CRMSNorm(lib), "rotary": CRotary(lib), "act": CSiluMul(lib)}
    if dtype != torch.bfloat16:
        return Kernels(**elementwise)
    fallback = OneDNNLinear() if onednn_works() else LinearMethod()
    if cpu_linear.available(lib):
        return Kernels(AmxLinear(lib), fallback, amx_lib=lib, **elementwise)
    return Kernels(fallback, **elementwise)
