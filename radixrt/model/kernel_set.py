"""The kernels a model's layers run, chosen once when the model is built.

``choose_kernels(device, dtype, lib, compiled, linear, cache_dir, exact)`` looks at what
this process has (the CPU kernels' library ``lib`` from ``radixrt_kernels.cpu.library``, the
packed linear kernels in it, oneDNN in PyTorch) and returns a ``Kernels``: the linear method
per layer shape, the RMS norm, the rotary embedding and the SiLU-and-mul. The layers take
their kernel objects from it when constructed and never look again, so each ``forward`` has
one path.

- Linears: bf16 on the CPU, each weight shape's paths as ``calibrate.Calibrator`` measured
  them (or the one ``linear`` forces); every other dtype or device, PyTorch. The packed
  kernels also take an MLP's SiLU-and-mul and a qkv projection's rotary embedding into
  their pass.
- Exact mode (``exact=True``): a row's results must not depend on the rows beside it, so
  every linear runs one row-invariant path for every row count: a bf16 shape one packed
  kernel (the exact calibration's, the same in every process of this CPU model; weights of
  any width, ``PadK``), a float32 model the float32 kernel, the LM head's logits included.
  What cannot be exact (another device or dtype, no library, a forced path that is not
  row-invariant) raises ``NotExact`` naming why.
- Elementwise steps: on the CPU in float32 or bf16 with the library, one C
  call each (``radixrt_kernels.cpu.elementwise``); otherwise PyTorch's ops. A model
  built for ``torch.compile`` keeps PyTorch's elementwise ops, which Inductor
  fuses into the surrounding graph.
Every path gives PyTorch's results up to the last bit of bf16 rounding (the
kernels' modules say where they round; float32's up to the order of its sums).
"""

from __future__ import annotations

import ctypes
import functools
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixrt.model.calibrate import (
    F32,
    PACKED,
    THRESHOLD,
    Calibrator,
    Choice,
    NotExact,
    QuantChoice,
    make_method,
)
from radixrt.model.linear_methods import (
    ActAfter,
    ByRows,
    LinearMethod,
    PackedGatedLinear,
    PackedKernels,
    PackedLinear,
    PackedRotaryQKV,
    PadK,
    QKVShape,
    RotateAfter,
    onednn_works,
)
from radixrt.quant.formats import QuantTensor
from radixrt.quant.quant_linear import QuantLinear
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


CPU = torch.device("cpu")
ROW_INVARIANT = PACKED | {F32}  # the linear paths whose rows do not depend on their batch


class Deferred:
    """A dense linear method made when its weight is prepared (``Kernels.defer``): the layers of
    a quantized model whose weights load quantized never make one, nor measure its paths."""

    name = "chosen when its weight loads"

    def __init__(self, make: Callable[[], object]) -> None:
        self.make = make

    def resolve(self):
        return self.make()


class Kernels:
    """One model's kernels. ``linear`` says which linear path each weight shape runs: a path
    name for every shape (one of ``calibrate.PATHS``, or ``calibrate.F32`` for float32 weights),
    or a function (n, k, large) -> Choice, such as a ``Calibrator``'s ``choice``; ``lib`` is
    the CPU kernels' library, which the packed paths need. ``compiled``: the model runs under
    torch.compile, where a layer takes one weight layout (the packed kernels still pick theirs
    per call). ``exact``: every shape runs one row-invariant path (``ROW_INVARIANT``) for all
    row counts; any other choice is refused (``NotExact``)."""

    def __init__(
        self,
        linear: str | Callable[..., Choice] = "torch",
        lib: ctypes.CDLL | None = None,
        norm: TorchRMSNorm | None = None,
        rotary: TorchRotary | None = None,
        act: TorchSiluMul | None = None,
        compiled: bool = False,
        exact: bool = False,
        device: torch.device = CPU,
        quant: Callable[..., QuantChoice] | None = None,
    ) -> None:
        self.device = device
        self.quant = quant
        if isinstance(linear, str):
            if exact and linear not in ROW_INVARIANT:
                raise NotExact(
                    f"exact mode: the {linear!r} linear path gives a row results that depend on "
                    f"the rows beside it (row-invariant: {', '.join(sorted(ROW_INVARIANT))})"
                )
            path = linear
            linear = lambda n, k, large=True: Choice(path, path)  # noqa: E731
        self.choose = linear
        self.lib, self.compiled, self.exact = lib, compiled, exact
        self.norm = norm or TorchRMSNorm()
        self.rotary = rotary or TorchRotary()
        self.act = act or TorchSiluMul()
        self.chosen: dict[str, str] = {}  # "n x k" → the path(s) it runs, for describe()
        self.users: dict[str, int] = {}  # "n x k" → the layers built on it and not quantized
        self.defer = False  # dense methods made when their weights load (a quantized model)

    def _choice(self, n: int, k: int, large: bool = True) -> Choice:
        choice = self.choose(n, k, large)
        if self.exact and (choice.small != choice.large or choice.small not in ROW_INVARIANT):
            raise NotExact(
                f"exact mode: the {n}x{k} linear was given {choice}, not one row-invariant path "
                "for every row count"
            )
        if k % cpu_linear.K_MULTIPLE and not self.exact:  # the packed kernels take whole chunks
            choice = Choice(
                *(p if p not in PACKED else "onednn" if onednn_works() else "torch" for p in choice)
            )
        mixed = not (choice.small in PACKED and choice.large in PACKED)
        if self.compiled and mixed and choice.small != choice.large:
            choice = Choice(choice.small, choice.small)  # one layout: the decode-sized path's
        self.users[f"{n}x{k}"] = self.users.get(f"{n}x{k}", 0) + 1
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

    def _split(self, choice: Choice, form, k: int):
        """``form(path, path)`` for both classes of calls, or by rows when they differ; on a
        weight of ``k`` input features the packed kernels do not take (exact mode), padded."""
        if choice.small == choice.large:
            method = form(choice.small, choice.small)
            if choice.small in PACKED and k % cpu_linear.K_MULTIPLE:
                return PadK(method, k)
            return method
        if choice.small in PACKED and choice.large in PACKED:
            return form(choice.small, choice.large)
        return ByRows(form(choice.small, choice.small), form(choice.large, choice.large), THRESHOLD)

    def _deferred(self, make, *args):
        return Deferred(functools.partial(make, *args)) if self.defer else make(*args)

    def linear_for(self, out_features: int, in_features: int, large: bool = True):
        """The method for a weight [out_features, in_features] (``large`` False: it never sees
        more than decode-sized calls)."""
        return self._deferred(self._linear_for, out_features, in_features, large)

    def gated_for(self, half: int, in_features: int):
        """[gate; up] [2·half, in_features] → silu(gate)·up."""
        return self._deferred(self._gated_for, half, in_features)

    def rotary_qkv_for(self, shape: QKVShape, out_features: int, in_features: int):
        """qkv [out_features, in_features] → q and k rotated, v."""
        return self._deferred(self._rotary_qkv_for, shape, out_features, in_features)

    def _linear_for(self, out_features: int, in_features: int, large: bool) -> LinearMethod:
        choice = self._choice(out_features, in_features, large)
        return self._split(choice, self._plain, in_features)

    def _gated_for(self, half: int, in_features: int):
        choice = self._choice(2 * half, in_features)

        def form(small: str, big: str):
            if small in PACKED and (2 * half) % 64 == 0:
                return PackedGatedLinear(self.lib, PackedKernels(small, big, THRESHOLD))
            return ActAfter(self._plain(small, big), self.act)

        return self._split(choice, form, in_features)

    def _rotary_qkv_for(self, shape: QKVShape, out_features: int, in_features: int):
        choice = self._choice(out_features, in_features)

        def form(small: str, big: str):
            if small in PACKED and cpu_linear.rope_fusable(shape.head_dim):
                return PackedRotaryQKV(self.lib, shape, PackedKernels(small, big, THRESHOLD))
            return RotateAfter(self._plain(small, big), shape)

        return self._split(choice, form, in_features)

    def quantized_for(self, segments: list[QuantTensor], large: bool = True):
        """The method of a quantized weight (``formats.QuantTensor`` segments, stacked in row
        order): the C kernels on the CPU, the Triton kernels on CUDA, both the same arithmetic
        and row-invariant whatever the row count, so exact mode takes them as they are. On the
        CPU each segment's paths are ``quant``'s choice (qtype, n, k, large) → QuantChoice
        where there is one (``large`` False: only decode-sized calls happen), else the
        library's rule."""
        if self.compiled:
            raise ValueError(
                "enable_torch_compile does not run quantized weights (their kernels are C calls "
                "the graph cannot take); serve the model without it"
            )
        if self.device.type == "cuda":
            from radixrt_kernels.triton.quant_method import TritonQuantLinear  # imports Triton

            method = TritonQuantLinear(segments, self.device)
        else:
            paths = None
            if self.quant is not None and self.lib is not None:
                paths = [self.quant(s.qtype, s.shape[0], s.k, large) for s in segments]
            method = QuantLinear(self.lib, segments, paths)
        n, k = sum(s.shape[0] for s in segments), segments[0].k
        if not self.defer:  # the layer was given a dense method at construction: unused
            self.users[f"{n}x{k}"] = self.users.get(f"{n}x{k}", 1) - 1
        for qtype, paths in method.type_paths().items():
            self.chosen[f"{n}x{k} {qtype}"] = paths
        return method

    def describe(self) -> dict[str, object]:
        """Whether the model runs exact, the elementwise kernels' names and each linear shape's
        path(s)."""
        return {
            "exact": self.exact,
            "linear": {s: p for s, p in self.chosen.items() if self.users.get(s, 1) > 0},
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
    exact: bool = False,
) -> Kernels:
    """The kernels for a model of ``dtype`` on ``device`` (``lib``: the CPU kernels' library, or
    None; ``compiled``: the model runs under torch.compile). ``linear``: "auto" measures each
    bf16 CPU weight shape's fastest path (``calibrate.Calibrator``, its results kept under
    ``cache_dir``); a path name runs that path everywhere it can. ``exact``: every linear runs
    one row-invariant path for every row count (``exact_kernels``)."""
    if exact:
        return exact_kernels(device, dtype, lib, compiled, linear, cache_dir)
    if device.type != "cpu":
        return Kernels(device=device)
    elementwise = _elementwise(dtype, lib, compiled)
    if lib is not None:
        calibrator = Calibrator(lib, cache_dir or tempfile.gettempdir(), chained=not compiled)
        elementwise["quant"] = calibrator.quant_choice  # quantized weights' paths, any dtype
    if dtype != torch.bfloat16:
        return Kernels(**elementwise)
    if linear != "auto":
        _check_runs(linear, lib)
        return Kernels(linear, lib, compiled=compiled, **elementwise)
    if lib is None:  # no packed kernels: oneDNN where it works, else PyTorch's bf16 linear
        return Kernels("onednn" if onednn_works() else "torch", compiled=compiled, **elementwise)
    return Kernels(calibrator.choice, lib, compiled=compiled, **elementwise)


def exact_kernels(
    device: torch.device,
    dtype: torch.dtype,
    lib: ctypes.CDLL | None,
    compiled: bool = False,
    linear: str = "auto",
    cache_dir: str | None = None,
) -> Kernels:
    """``choose_kernels`` in exact mode: a float32 model's linears on the float32 kernel
    (``calibrate.F32``), a bf16 model's each on one packed kernel, ``linear`` or the one the
    exact calibration picks (the same in every process of this CPU model). Raises ``NotExact``
    where that cannot be: another device or dtype, no kernels' library, a forced path whose
    rows depend on their batch."""
    if device.type != "cpu":
        raise NotExact(
            f"exact mode: the linears on {device.type} run PyTorch's, whose results for a row "
            "depend on the rows beside it"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise NotExact(f"exact mode: the CPU has no row-invariant linear for {dtype}")
    if lib is None:
        raise NotExact(
            "exact mode needs the CPU kernels' library (its row-invariant linear kernels), "
            f"which is unavailable: {cpu_library.why_unavailable()}"
        )
    elementwise = _elementwise(dtype, lib, compiled)
    calibrator = Calibrator(
        lib, cache_dir or tempfile.gettempdir(), chained=not compiled, exact=True
    )
    elementwise["quant"] = calibrator.quant_choice  # quantized weights' paths, any dtype
    if dtype == torch.float32:
        return Kernels(F32, lib, compiled=compiled, exact=True, **elementwise)
    if linear != "auto":
        kernels = Kernels(linear, lib, compiled=compiled, exact=True, **elementwise)
        _check_runs(linear, lib)
        return kernels
    return Kernels(calibrator.choice, lib, compiled=compiled, exact=True, **elementwise)


def _elementwise(dtype: torch.dtype, lib: ctypes.CDLL | None, compiled: bool) -> dict:
    """The C elementwise kernels where they run (eager, float32 or bf16), else none (PyTorch's)."""
    if lib is not None and dtype in cpu_ops.DTYPES and not compiled:
        return {"norm": CRMSNorm(lib), "rotary": CRotary(lib), "act": CSiluMul(lib)}
    return {}


def _check_runs(linear: str, lib: ctypes.CDLL | None) -> None:
    """Refuses a forced packed kernel this CPU (or a process without the library) cannot run."""
    if linear in PACKED and not cpu_linear.kernel_available(lib, linear):
        raise ValueError(
            f"linear_kernel {linear!r} does not run on this CPU (or without the "
            f"kernels' library: {cpu_library.why_unavailable()})"
        )
