"""Model building blocks. Each holds the kernel objects it was built with
(``radixrt.model.kernel_set``) and runs them in a single-path ``forward``.

Parameters carry a ``weight_loader`` that copies a checkpoint tensor (or its
shard of a stacked parameter) into them. After loading, ``prepare_weights``
lets each linear lay its weight out for its method, once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.model import rope
from radixrt.model.kernel_set import Deferred, Kernels
from radixrt.model.linear_methods import ActAfter, QKVShape, RotateAfter
from radixrt.quant.formats import QuantTensor, stack
from radixrt.quant.quant_linear import QuantLinear
from radixrt_kernels.cpu import quant as cpu_quant

DEFAULT_KERNELS = Kernels()  # PyTorch's ops: for layers built outside a model runner


def _copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}"
        )
    param.copy_(loaded)


def _keep_quantized(param: nn.Parameter, shard: str | int | None, loaded: QuantTensor) -> None:
    """A quantized checkpoint tensor (or shard) kept on the parameter, in its blocks, for
    ``prepare_weights`` (the parameter's own storage stays untouched)."""
    if not hasattr(param, "quant"):
        param.quant = {}
    param.quant[shard] = loaded


def _quantized(param: nn.Parameter, shards: tuple) -> list[QuantTensor] | None:
    """The parameter's quantized shards in ``shards`` order, as segments (``formats.stack``);
    None where it loaded dense. A stacked weight runs one way: some shards quantized and others
    not (or missing) is refused."""
    quant = getattr(param, "quant", None)
    if quant is None:
        return None
    if set(quant) != set(shards):
        dense = [str(s) for s in shards if s not in quant]
        raise ValueError(
            f"a stacked weight of shards {list(map(str, shards))} loaded shards {dense} dense "
            "(or not at all) and the others quantized; radixrt runs a stacked weight one way"
        )
    return stack([quant[s] for s in shards])


def _load_fused(layer: Linear, param: nn.Parameter, loaded) -> None:
    """A checkpoint's fused weight (phi3's qkv_proj, gate_up_proj) into a stacked layer: its
    rows are the layer's shards in order, each loaded as the shard it is."""
    sizes = layer.shard_rows()
    rows = loaded.shape[0]
    if rows != sum(sizes):
        raise ValueError(
            f"fused checkpoint weight of {rows} rows does not stack shards "
            f"{dict(zip(map(str, layer.SHARDS), sizes))}"
        )
    start = 0
    for shard, size in zip(layer.SHARDS, sizes):
        part = slice(start, start + size)
        layer.weight_loader(
            param, loaded.rows(part) if isinstance(loaded, QuantTensor) else loaded[part], shard
        )
        start += size


class Linear(nn.Module):
    """y = x·Wᵀ + b, W [out_features, in_features], through the method the kernels give a
    weight of this shape."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        kernels: Kernels = DEFAULT_KERNELS,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.kernels = kernels
        self.method = self._method(kernels)
        self.prepared = False

    SHARDS: tuple = (None,)  # the checkpoint's parts of the weight, in row order

    def _method(self, kernels: Kernels):
        return kernels.linear_for(self.out_features, self.in_features)

    def _quantized_method(self, kernels: Kernels, segments: list[QuantTensor]):
        return kernels.quantized_for(segments)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantTensor) -> None:
        if isinstance(loaded, QuantTensor):
            return _keep_quantized(param, None, loaded)
        _copy_into(param.data, loaded)

    def prepare_weights(self) -> None:
        """The weight in the method's layout (it replaces the loaded one: no second copy); a
        quantized weight gets the quantized method of its block types."""
        if self.prepared:
            return
        segments = _quantized(self.weight, self.SHARDS)
        if segments is None:
            if isinstance(self.method, Deferred):
                self.method = self.method.resolve()
            w = self.method.prepare(self.weight.detach())
        else:
            if sum(q.shape[0] for q in segments) != self.out_features or any(
                q.k != self.in_features for q in segments
            ):
                raise ValueError(
                    f"quantized weight {[q.shape for q in segments]} does not fit a "
                    f"[{self.out_features}, {self.in_features}] linear"
                )
            self.method = self._quantized_method(self.kernels, segments)
            w = self.method.prepare(segments)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.prepared = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.bias, self.out_features)


class GateUpLinear(Linear):
    """An MLP's [gate; up] projection followed by SiLU-and-mul: x [.., K] → silu(x·gateᵀ)·(x·upᵀ)
    [.., intermediate]. The checkpoint's gate and up weights load as shards 0 and 1."""

    def __init__(
        self, in_features: int, intermediate: int, kernels: Kernels = DEFAULT_KERNELS
    ) -> None:
        self.intermediate = intermediate
        super().__init__(in_features, 2 * intermediate, False, kernels)

    SHARDS = (0, 1)

    def _method(self, kernels: Kernels):
        return kernels.gated_for(self.intermediate, self.in_features)

    def _quantized_method(self, kernels: Kernels, segments: list[QuantTensor]):
        return ActAfter(kernels.quantized_for(segments), kernels.act)

    def shard_rows(self) -> list[int]:
        return [self.intermediate, self.intermediate]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
        """Shard 0 (gate) or 1 (up); None: a fused [gate; up] checkpoint weight."""
        if shard_id is None:
            return _load_fused(self, param, loaded)
        if isinstance(loaded, QuantTensor):
            return _keep_quantized(param, shard_id, loaded)
        size = self.intermediate
        _copy_into(param.data.narrow(0, shard_id * size, size), loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.out_features)


class GeluGateUpLinear(GateUpLinear):
    """An MLP's [gate; up] projection followed by GeGLU: gelu(x·gateᵀ)·(x·upᵀ) [.., intermediate]
    with PyTorch's tanh-approximated gelu (transformers' ``gelu_pytorch_tanh``). The projection
    runs the plain linear method of its shape; the activation runs in PyTorch."""

    def _method(self, kernels: Kernels):
        return kernels.linear_for(self.out_features, self.in_features)

    def _quantized_method(self, kernels: Kernels, segments: list[QuantTensor]):
        return kernels.quantized_for(segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.method.apply(x, self.weight, None, self.out_features)
        gate, up = gate_up.chunk(2, dim=-1)
        return gelu_tanh(gate.float()).to(gate.dtype) * up


_GELU_BETA = math.sqrt(2 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))), PyTorch's tanh-approximated gelu, out of
    elementwise steps that each give an element the same bits wherever it lies in a tensor (F.gelu
    does not: its vector and scalar loops round differently, so a row's bits would move with the
    batch, the thread split falling elsewhere in it)."""
    inner = _GELU_BETA * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + torch.tanh(inner))


class QKVLinear(Linear):
    """q, k and v projections in one matmul: x [T, K] → q [T, H, D], k and v [T, KH, D] (views
    of one output). The checkpoint's q, k and v weights load as shards "q", "k", "v"."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        kernels: Kernels = DEFAULT_KERNELS,
    ) -> None:
        self.shape = QKVShape(head_dim, num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias, kernels)

    SHARDS = ("q", "k", "v")

    def shard_rows(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str | None = None) -> None:
        """Shard "q", "k" or "v"; None: a fused [q; k; v] checkpoint weight (phi3's qkv_proj)."""
        if shard_id is None:
            return _load_fused(self, param, loaded)
        if isinstance(loaded, QuantTensor):
            return _keep_quantized(param, shard_id, loaded)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        _copy_into(param.data.narrow(0, offset, size), loaded)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.method.apply(x, self.weight, self.bias, self.out_features)
        t, cols = x.shape[0], self.shape.qk_cols
        qk, v = qkv[:, :cols].view(t, -1, self.head_dim), qkv[:, cols:].view(t, -1, self.head_dim)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class RotaryQKVLinear(QKVLinear):
    """``QKVLinear`` whose q and k come out rotated at ``positions`` by ``rotary`` (for models
    with nothing between the projection and the rotation)."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        rotary: RotaryEmbedding,
        bias: bool = False,
        kernels: Kernels = DEFAULT_KERNELS,
    ) -> None:
        super().__init__(hidden, head_dim, num_heads, num_kv_heads, bias, kernels)
        self.rotary = rotary

    def _method(self, kernels: Kernels):
        return kernels.rotary_qkv_for(self.shape, self.out_features, self.in_features)

    def _quantized_method(self, kernels: Kernels, segments: list[QuantTensor]):
        return RotateAfter(kernels.quantized_for(segments), self.shape)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk, v = self.method.apply(
            x, self.weight, self.bias, self.out_features, positions, self.rotary
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class VocabEmbedding(nn.Module):
    """The tokens' rows of the embedding; a quantized embedding keeps its GGUF blocks and
    dequantizes the rows looked up (``cpu_quant.rows``: the C kernels' library of ``kernels``
    where it has one, else ``formats.dequantize``; gguf's values either way), rounded to the
    model's dtype."""

    def __init__(self, vocab_size: int, hidden: int, kernels: Kernels = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.vocab_size, self.lib = vocab_size, kernels.lib
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantTensor) -> None:
        if isinstance(loaded, QuantTensor):
            return _keep_quantized(param, None, loaded)
        _copy_into(param.data, loaded)

    @property
    def quantized(self) -> QuantTensor | None:
        quant = getattr(self.weight, "quant", None)
        return None if quant is None else quant[None]

    def prepare_weights(self) -> None:
        """A quantized embedding frees the dense storage it was built with."""
        if self.quantized is not None and self.weight.numel():
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        quant = self.quantized
        if quant is None:
            return F.embedding(ids, self.weight)
        packed = getattr(self.weight, "packed", None)  # a tied LM head's blocks, in its layout
        if packed is not None:
            rows = cpu_quant.rows_packed(self.lib, *packed, ids.cpu(), self.weight.dtype)
        else:
            rows = cpu_quant.rows(
                self.lib, quant.qtype, quant.raw, ids.cpu(), quant.k, self.weight.dtype
            )
        return rows.to(ids.device).reshape(*ids.shape, quant.k)


class ScaledVocabEmbedding(VocabEmbedding):
    """The tokens' rows times sqrt(hidden) (Gemma), the multiplier rounded to the model's dtype
    first, as transformers rounds it."""

    def __init__(self, vocab_size: int, hidden: int, kernels: Kernels = DEFAULT_KERNELS) -> None:
        super().__init__(vocab_size, hidden, kernels)
        normalizer = torch.tensor(hidden**0.5, dtype=torch.float32).to(self.weight.dtype)
        self.register_buffer("normalizer", normalizer, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.normalizer


class LMHead(VocabEmbedding):
    """Output projection over the vocabulary: float32 logits [.., vocab]. Its weight may be the
    embedding's (tied); ``prepare_weights`` gives the method its own copy where its layout
    differs, and keeps the plain weight for the embedding."""

    def __init__(self, vocab_size: int, hidden: int, kernels: Kernels = DEFAULT_KERNELS) -> None:
        super().__init__(vocab_size, hidden, kernels)
        self.kernels = kernels
        self.method = kernels.linear_for(vocab_size, hidden, large=False)  # sampled rows only
        self.matmul_weight: torch.Tensor | None = None

    def prepare_weights(self) -> None:
        if self.matmul_weight is not None:
            return
        if self.quantized is not None:
            q = self.quantized
            self.method = self.kernels.quantized_for([q], large=False)  # sampled rows only
            self.matmul_weight = self.method.prepare([q])
            if isinstance(self.method, QuantLinear) and self.method.lib is not None:
                # One copy of the blocks: an embedding sharing this parameter (tied) looks its
                # rows up in the packed layout, and the file's raw blocks are let go.
                self.weight.packed = (q.qtype, self.matmul_weight, q.shape[0], q.k)
                self.weight.quant = {None: QuantTensor(q.qtype, q.raw[:0].clone(), q.k)}
        else:
            if isinstance(self.method, Deferred):
                self.method = self.method.resolve()
            self.matmul_weight = self.method.prepare(self.weight.detach())
        super().prepare_weights()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.matmul_weight if self.matmul_weight is not None else self.weight
        return self.method.logits(h, w, self.vocab_size)


def prepare_weights(model: nn.Module) -> None:
    """Lay every linear's loaded weight out for its method (once; later calls change nothing)."""
    for m in model.modules():
        if isinstance(m, (Linear, VocabEmbedding)):
            m.prepare_weights()


class RMSNorm(nn.Module):
    """RMS norm with a learned scale; given a residual, the norm of x + residual, returned with
    that sum (the next residual). Each head's norm of x [T, H, D] may happen in place: callers
    pass a tensor of their own and use the result."""

    def __init__(self, dim: int, eps: float, kernels: Kernels = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.kernel = kernels.norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.kernel(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm: x·rsqrt(mean(x²) + eps)·(1 + w), all in float32 and rounded once to x's
    dtype (transformers' Gemma2RMSNorm / Gemma3RMSNorm); given a residual, the norm of
    x + residual, returned with that sum. Runs in PyTorch, per row; returns new tensors."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class LogitSoftCap(nn.Module):
    """cap·tanh(logits / cap) on the float32 logits (Gemma's final_logit_softcapping)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.cap) * self.cap


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with float32 tables cos and sin± [rows, head_dim]
    (``radixrt.model.rope``; ``rows``: the first positions of the model's max_position, all by
    default). The rotation may happen in place: callers pass a tensor of their own and use the
    result."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None = None,
        kernels: Kernels = DEFAULT_KERNELS,
        rows: int | None = None,
    ) -> None:
        super().__init__()
        cos, sin_signed = rope.cos_sin_tables(head_dim, max_position, base, scaling)
        if rows is not None and rows < max_position:
            cos, sin_signed = cos[:rows].clone(), sin_signed[:rows].clone()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin_signed", sin_signed, persistent=False)
        self.kernel = kernels.rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T]; x [T, N, D] (any number of heads: q and k side by side rotate at once)."""
        return self.kernel(x, positions, self.cos, self.sin_signed)


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rotates the first ``head_dim`` (here: the rotated) dimensions of each head of x
    [T, N, D], neox-style among them, and passes the other D - head_dim through (phi3's
    partial_rotary_factor). Returns a new tensor."""

    def __init__(self, rotary_dim: int, *args, **kwargs) -> None:
        super().__init__(rotary_dim, *args, **kwargs)
        self.rotary_dim = rotary_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        rotated = self.kernel(x[..., :d], positions, self.cos, self.sin_signed)
        return torch.cat([rotated, x[..., d:]], dim=-1)
