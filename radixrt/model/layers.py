"""Model building blocks, written tensor-parallel-ready.

Linear layers shard their weight over the tensor-parallel group: column
layers split output features, row layers split input features and all-reduce
their output. With tp_size == 1 (the only size wired up so far) they are plain
linears; a later TP issue only has to pass rank/size and initialise
torch.distributed. Each parameter carries a ``weight_loader`` that copies its
shard out of a full checkpoint tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from radixrt.model import rope
from radixrt_kernels import cpu_library, cpu_linear, cpu_ops


def tp_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_dim = tp_dim
        self.in_features, self.out_features = in_features, out_features  # of this rank's shard
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packing: str | None = None  # "amx" or "onednn": the weight's CPU layout (pack_cpu_weights)

    def _shard(self, loaded: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and loaded.dim() > self.tp_dim and self.tp_size > 1:
            loaded = self._shard(loaded, self.tp_dim, param.shape[self.tp_dim])
        _default_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packing == "amx":
            return amx_linear(x, self.weight, bias, self.out_features)
        if self.packing == "onednn":
            return onednn_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Splits output features across ranks; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        _, tp = tp_rank_and_size()
        if out_features % tp:
            raise ValueError(f"out_features {out_features} not divisible by tp size {tp}")
        super().__init__(in_features, out_features // tp, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column linears stacked in one matmul (e.g. gate and up).

    ``silu_gated``: the two halves are [gate; up] of an MLP that takes silu(gate)·up next. Where
    the AMX kernel runs them (see pack_cpu_weights) it computes that product in the same pass
    (``fused_act``), and forward returns it, [.., out / 2], instead of [gate, up]."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 silu_gated: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)
        self.silu_gated = silu_gated and len(out_sizes) == 2 and out_sizes[0] == out_sizes[1]
        self.fused_act = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act:
            return amx_linear(x, self.weight, None, self.out_features, gated=True)
        return super().forward(x)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        _default_loader(param.data.narrow(0, offset, size), self._shard(loaded, 0, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads are split across ranks.

    ``rope_follows``: the caller rotates q and k right after (no norm between). Where the AMX
    kernel runs this linear and the head dim suits it (see pack_cpu_weights) it rotates them
    in the same pass (``fused_rope``): call ``rotated``."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, rope_follows: bool = False) -> None:
        _, tp = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        out = (num_heads + 2 * max(num_kv_heads, tp)) * head_dim
        super().__init__(hidden, out, bias)
        self.rope_follows = rope_follows
        self.fused_rope = False

    def rotated(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """[q, k, v] with q and k rotated at ``positions`` by ``rotary``'s tables (fused_rope)."""
        rope = cpu_linear.Rope(positions, rotary.cos, rotary.sin_signed, self.head_dim,
                               (self.num_heads + self.num_kv_heads) * self.head_dim)
        return amx_linear(x, self.weight, self.bias, self.out_features, rope=rope)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        _default_loader(param.data.narrow(0, offset, size), self._shard(loaded, 0, size))


class RowParallelLinear(LinearBase):
    """Splits input features across ranks and all-reduces the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        _, tp = tp_rank_and_size()
        if in_features % tp:
            raise ValueError(f"in_features {in_features} not divisible by tp size {tp}")
        super().__init__(in_features // tp, out_features, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.vocab_size = vocab_size
        self.shard = math.ceil(vocab_size / self.tp_size)
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        part = loaded[self.start:self.start + self.shard]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        y = F.embedding(torch.where(inside, local, 0), self.weight) * inside[:, None]
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the (sharded) vocabulary; logits in float32."""

    packed_weight: torch.Tensor | None = None  # a packed copy (see pack_cpu_weights) ...
    packing: str | None = None                  # ... "amx" or "onednn"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.packing == "amx":  # bf16 logits, widened to float32 in the same call
            logits = amx_linear(h, self.packed_weight, None, self.shard, float_out=True)
        elif self.packing == "onednn":
            logits = onednn_linear(h, self.packed_weight, None).float()
        else:
            logits = F.linear(h, self.weight).float()
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., :self.vocab_size]


def pack_cpu_weights(model: nn.Module, lib=None) -> str | None:
    """Lay the bf16 linear weights of a CPU model out for a faster kernel, once; returns the
    layout chosen ("amx" or "onednn"), or None, changing nothing.

    A decode step streams every weight through a few dozen rows, so its speed is the speed
    the weights stream at. With ``lib`` (``radixrt_kernels.cpu_library``) on a CPU with AMX,
    the weights go into that library's linear kernel's layout ("amx", see
    ``radixrt_kernels.cpu_linear``): 21-24 GB/s in a decode step here, against 15 for
    oneDNN's packed kernels and less for the plain ones, which re-lay the weight out on
    every call; an MLP's [gate; up] also takes its SiLU-and-mul into that pass. Elsewhere
    oneDNN's blocked layout ("onednn", checked here on one layer). Both give PyTorch's own
    bf16 results: oneDNN's exactly; the AMX kernel's exactly for up to 32 rows and within
    the last bf16 bit beyond (oneDNN adds those in another order). A linear layer swaps its
    weight for the packed one (no second copy); the LM head keeps its plain weight (the tied
    embedding reads it) and gains a packed copy.
    """
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and m.packing is None]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.packing is None]
    params = [m.weight for m in linears + heads]
    if not params or any(p.device.type != "cpu" or p.dtype != torch.bfloat16 for p in params):
        return None
    if cpu_linear.available(lib) and all(cpu_linear.packable(p) for p in params):
        for m in linears:  # an MLP's [gate; up] with SiLU-and-mul fused where it can be
            gated = getattr(m, "silu_gated", False) and m.bias is None and cpu_linear.packable(m.weight, True)
            m.weight = nn.Parameter(cpu_linear.pack(lib, m.weight.detach(), gated), requires_grad=False)
            m.packing = "amx"
            if gated:
                m.fused_act = True
            if getattr(m, "rope_follows", False) and cpu_linear.rope_fusable(m.head_dim):
                m.fused_rope = True
        for m in heads:
            m.packed_weight, m.packing = cpu_linear.pack(lib, m.weight.detach()), "amx"
        return "amx"
    if _ONEDNN_LINEAR is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        weight = params[0].detach()
        x = torch.randn(3, weight.shape[1], dtype=torch.bfloat16)
        got = onednn_linear(x, _ONEDNN_PACK(weight, None), None)
        want = F.linear(x, weight)
        if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
            return None
    except RuntimeError:
        return None
    for m in linears:
        m.weight = nn.Parameter(_ONEDNN_PACK(m.weight.detach(), None), requires_grad=False)
        m.packing = "onednn"
    for m in heads:
        m.packed_weight, m.packing = _ONEDNN_PACK(m.weight.detach(), None), "onednn"
    return "onednn"


_ONEDNN_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for a oneDNN-packed weight. Inside torch.compile it goes through the
    opaque ``radixrt::onednn_linear`` op: Inductor cannot lower the packed layout itself."""
    if torch.compiler.is_compiling():
        return _onednn_linear_op(x, weight, bias, weight.shape[0])
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


@torch.library.custom_op("radixrt::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


@_onednn_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               float_out: bool = False, gated: bool = False, rope: cpu_linear.Rope | None = None) -> torch.Tensor:
    """x @ W.T + bias for W packed by ``cpu_linear.pack`` (bf16; float32 with ``float_out``;
    silu(gate)·up, [.., out_features / 2], for a weight packed ``gated``; q and k rotated with
    ``rope``). Inside torch.compile it goes through the opaque ``radixrt::amx_linear`` op."""
    if torch.compiler.is_compiling():
        r = rope or cpu_linear.Rope(None, None, None, 0, 0)
        return _amx_linear_op(x, packed, bias, out_features, float_out, gated, *r)
    return cpu_linear.linear(cpu_library.loaded(), x, packed, out_features, bias, float_out, gated, rope)


@torch.library.custom_op("radixrt::amx_linear", mutates_args=())
def _amx_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                   float_out: bool, gated: bool, positions: torch.Tensor | None, cos: torch.Tensor | None,
                   sin_signed: torch.Tensor | None, head_dim: int, rope_cols: int) -> torch.Tensor:
    rope = cpu_linear.Rope(positions, cos, sin_signed, head_dim, rope_cols) if positions is not None else None
    return cpu_linear.linear(cpu_library.loaded(), x, packed, out_features, bias, float_out, gated, rope)


@_amx_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
      float_out: bool, gated: bool, positions: torch.Tensor | None, cos: torch.Tensor | None,
      sin_signed: torch.Tensor | None, head_dim: int, rope_cols: int) -> torch.Tensor:
    width = out_features // 2 if gated else out_features
    return x.new_empty(*x.shape[:-1], width, dtype=torch.float32 if float_out else x.dtype)


def use_cpu_kernels(model: nn.Module, lib) -> None:
    """Run the elementwise layers (RMS norm, rotary embedding, SiLU-and-mul) through the CPU
    kernels' library ``lib`` (``radixrt_kernels.cpu_library``) in eager mode, on float32 and
    bfloat16 tensors; None: PyTorch's ops."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul)):
            m.cpu_lib = lib


def _eager_cpu(lib, x: torch.Tensor) -> bool:
    return lib is not None and cpu_ops.usable(x) and not torch.compiler.is_compiling()


class RMSNorm(nn.Module):
    """RMS norm computed in float32, as Hugging Face's Llama does. Given a residual, the norm of
    x + residual, returned with that sum (the next residual)."""
    cpu_lib = None  # see use_cpu_kernels

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if _eager_cpu(self.cpu_lib, x) and x.dim() == 2 and self.weight.dtype == x.dtype:
            if residual is None:
                return cpu_ops.rms_norm(self.cpu_lib, x, self.weight, self.eps)
            residual = residual.contiguous()  # receives x + residual
            return cpu_ops.rms_norm(self.cpu_lib, x, self.weight, self.eps, residual), residual
        if residual is not None:
            x = residual = x + residual
        # x·rsqrt(mean(x²) + eps) in float32, fused; back in x's dtype, then the weight.
        normed = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return normed if residual is None else (normed, residual)


class SiluAndMul(nn.Module):
    cpu_lib = None  # see use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _eager_cpu(self.cpu_lib, x) and x.dim() == 2:
            return cpu_ops.silu_mul(self.cpu_lib, x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a float32 cos/sin cache [max_pos, head_dim].

    rotate_half(x)·sin, with rotate_half(x) = [-x2, x1], is computed as roll(x, D/2)·sin±
    where sin± is sin with its first half negated: the same products, bit for bit, in one
    copy instead of a negation and a concatenation. Through the CPU kernels (see
    use_cpu_kernels) x is rotated in place: callers pass a tensor of their own."""
    cpu_lib = None  # see use_cpu_kernels

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        cos, sin_signed = rope.cos_sin_tables(head_dim, max_position, base, scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin_signed", sin_signed, persistent=False)
        self._memo: tuple | None = None  # (positions, its version, dtype, cos, sin±) of the last call

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T]; x [T, N, D] (any number of heads: q and k side by side rotate at once)."""
        if _eager_cpu(self.cpu_lib, x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return cpu_ops.rope_(self.cpu_lib, x, positions, self.cos, self.sin_signed)
        cos, sin_signed = self._cos_sin(positions, x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin± [T, 1, D] for positions; the model shares one instance across its layers,
        so a forward looks them up once (same positions tensor, unmodified, same dtype)."""
        if torch.compiler.is_compiling():  # the memo is Python state a graph cannot keep
            return (self.cos[positions].unsqueeze(1).to(dtype),
                    self.sin_signed[positions].unsqueeze(1).to(dtype))
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == positions._version and memo[2] == dtype:
            return memo[3], memo[4]
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin_signed = self.sin_signed[positions].unsqueeze(1).to(dtype)
        self._memo = (positions, positions._version, dtype, cos, sin_signed)
        return cos, sin_signed

