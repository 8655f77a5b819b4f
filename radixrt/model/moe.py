"""The mixture-of-experts MLP block of qwen3_moe, qwen2_moe, mixtral and olmoe.

``SparseMoeBlock(spec, kernels)(x)``: x [T, hidden] → [T, hidden] in x's dtype, what
transformers' ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``
and ``OlmoeSparseMoeBlock`` compute:

1. router logits x·gateᵀ [T, E] in x's dtype; probabilities their softmax in float32;
2. the top k by probability (``torch.topk``: descending, its order among ties), ranks 0..k-1;
3. ``norm_topk_prob`` (mixtral: always): the k probabilities over their sum (added in rank
   order); then rounded to x's dtype, except mixtral's, which stay float32;
4. each chosen expert's SiLU-gated MLP down(silu(x·gateᵀ)·(x·upᵀ)) in x's dtype;
5. the sum over ranks of expert output · weight: each product in the promoted dtype, added in
   float32 in rank order, rounded once to x's dtype. That is the order of transformers' default
   experts implementation (``grouped_mm``: weighted rows summed over the rank dimension); its
   ``eager`` loop adds by expert id into an x-dtype buffer, the same bits in float32 for k = 2;
6. with a shared expert (qwen2_moe): + sigmoid(x·shared_gateᵀ) · shared_expert(x).

A token's output bits depend on its own row only: the router, the experts and the shared
expert are linears the kernels give (row-invariant in exact mode), and the softmax, top-k and
weighted sum are per row in a fixed order, whichever tokens share the call.

The experts are one of two implementations, chosen when the block is built:
``ExpertList`` (each expert a ``GateUpLinear`` and a ``Linear`` from the kernels: calibrated
bf16, float32 and quantized weights), on the CPU and wherever weights may load quantized;
``FusedExperts`` (stacked weights, ``radixrt_kernels.triton.fused_moe``), on CUDA with dense
weights. ``ExpertList`` runs its experts one of two ways, settled at its first forward after
the weights are laid out (``prepare_weights``):

- where every expert's gate_up runs the packed gated linear (``PackedGatedLinear``) and its
  down the packed linear (``PackedLinear``), on kernels shared by all experts (bf16 weights,
  hidden and expert widths multiples of 32, eager mode): all of them in one C call
  (``radixrt_kernels.cpu.experts``: the grouping, every expert's two linears and the weighted
  sum in one parallel region, the same kernels on the same rows, so the other way's bits);
- else (float32 or quantized weights, widths the packed kernels pad, other linear paths,
  torch.compile): tokens grouped by expert, one call of each chosen expert over its tokens,
  the weighted sum in PyTorch (``ExpertList.grouped``).

``MoeSpec.from_hf(model_type, config)`` reads the block's settings from a ``config.json``
dict (transformers' defaults where a key is absent); ``MoeSpec.is_sparse(layer_id)`` says
which decoder layers have the block (qwen's ``mlp_only_layers`` and ``decoder_sparse_step``).
``SparseMoeBlock.load(name, tensor)`` takes a checkpoint tensor by its name below the block
(``gate.weight``; ``experts.{e}.gate_proj|up_proj|down_proj.weight`` or mixtral's
``w1|w3|w2``; transformers v5's stacked ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I]; ``shared_expert.*`` and ``shared_expert_gate.weight``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from radixrt.model.kernel_set import Kernels
from radixrt.model.layers import DEFAULT_KERNELS, GateUpLinear, Linear
from radixrt.model.linear_methods import PackedGatedLinear, PackedLinear
from radixrt.quant.formats import QuantTensor
from radixrt_kernels.cpu import experts as cpu_experts

__all__ = ["MOE_MODEL_TYPES", "ExpertList", "FusedExperts", "MoeSpec", "Routing", "SparseMoeBlock"]

_SILU_ACTS = ("silu", "swish")  # the names transformers' ACT2FN maps to SiLU


class _Family(NamedTuple):
    """How a model type's config names and defaults the block's settings."""

    intermediate_key: str  # the experts' width
    defaults: dict[str, Any]  # transformers' config class defaults
    always_normalised: bool = False  # mixtral renormalises whatever norm_topk_prob says
    float32_weights: bool = False  # mixtral's routing weights are not rounded to x's dtype
    shared_expert: bool = False
    layered: bool = False  # mlp_only_layers and decoder_sparse_step pick the sparse layers


_FAMILIES = {
    "qwen3_moe": _Family(
        "moe_intermediate_size",
        dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        layered=True,
    ),
    "qwen2_moe": _Family(
        "moe_intermediate_size",
        dict(
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
        ),
        shared_expert=True,
        layered=True,
    ),
    "mixtral": _Family(
        "intermediate_size",
        dict(num_experts=8, num_experts_per_tok=2, intermediate_size=14336),
        always_normalised=True,
        float32_weights=True,
    ),
    "olmoe": _Family(
        "intermediate_size", dict(num_experts=64, num_experts_per_tok=8, intermediate_size=2048)
    ),
}
MOE_MODEL_TYPES = tuple(_FAMILIES)


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


@dataclasses.dataclass(frozen=True, slots=True)
class MoeSpec:
    """The block's settings. ``intermediate_size``: one expert's width; ``float32_weights``:
    the routing weights stay float32 (mixtral) rather than rounded to the model's dtype;
    ``shared_intermediate_size``: the shared expert's width, 0 for none; a layer has the block
    unless it is in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th layer."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    float32_weights: bool = False
    shared_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "intermediate_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(
                    f"MoeSpec: {name} must be a positive int, got {getattr(self, name)!r}"
                )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoeSpec: num_experts_per_tok {self.top_k} > num_experts {self.num_experts}"
            )
        shared = self.shared_intermediate_size
        if shared != 0 and not _positive_int(shared):
            raise ValueError(f"MoeSpec: shared_intermediate_size must be >= 0, got {shared!r}")
        if not _positive_int(self.decoder_sparse_step):
            raise ValueError(
                f"MoeSpec: decoder_sparse_step must be a positive int, got "
                f"{self.decoder_sparse_step!r}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_sparse(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` has this block (else a dense MLP of the config's
        ``intermediate_size``), as transformers' qwen2_moe and qwen3_moe decoder layers decide."""
        return (
            layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, model_type: str, config: Mapping[str, Any]) -> MoeSpec | None:
        """The block of a ``config.json`` dict of ``model_type`` (one of ``MOE_MODEL_TYPES``),
        or None where the model has no experts (qwen's ``num_experts`` 0). Raises ValueError
        naming a setting transformers would compute differently (an activation other than
        SiLU)."""
        family = _FAMILIES.get(model_type)
        if family is None:
            raise ValueError(f"no mixture-of-experts block for model_type {model_type!r}")
        act = config.get("hidden_act", "silu")
        if act not in _SILU_ACTS:
            raise ValueError(f"{model_type}: hidden_act {act!r} is not supported (only SiLU)")
        num_experts = _read(config, family, "num_experts", "num_local_experts")
        if family.layered and num_experts == 0:
            return None
        return cls(
            hidden_size=config["hidden_size"],
            num_experts=num_experts,
            top_k=_read(config, family, "num_experts_per_tok"),
            intermediate_size=_read(config, family, family.intermediate_key),
            norm_topk_prob=family.always_normalised or bool(config.get("norm_topk_prob", False)),
            float32_weights=family.float32_weights,
            shared_intermediate_size=(
                _read(config, family, "shared_expert_intermediate_size")
                if family.shared_expert
                else 0
            ),
            decoder_sparse_step=config.get("decoder_sparse_step", 1) if family.layered else 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()) if family.layered else (),
        )


def _read(config: Mapping[str, Any], family: _Family, key: str, *aliases: str) -> Any:
    """``config[key]`` (or an alias: transformers maps num_experts and num_local_experts onto
    each other), else the family's default."""
    for name in (key, *aliases):
        if name in config:
            return config[name]
    return family.defaults[key]


class Routing(NamedTuple):
    """Each token's chosen experts [T, k] (int64, rank order) and their weights [T, k] (float32
    or the model's dtype, per ``MoeSpec.float32_weights``)."""

    experts: torch.Tensor
    weights: torch.Tensor


def route(logits: torch.Tensor, spec: MoeSpec) -> Routing:
    """The top-k routing of router logits [T, E] (module text, steps 1 to 3)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        top = top / rank_sum(top.unsqueeze(-1))
    if not spec.float32_weights:
        top = top.to(logits.dtype)
    return Routing(experts, top)


def rank_sum(values: torch.Tensor) -> torch.Tensor:
    """values [T, k, N] summed over k in float32, rank 0 first → float32 [T, N]."""
    acc = values[:, 0].float()
    for r in range(1, values.shape[1]):
        acc = acc + values[:, r]
    return acc


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ_r outputs[:, r] · weights[:, r] for outputs [T, k, H] and weights [T, k] (module text,
    step 5) → [T, H] in ``dtype``."""
    return rank_sum(outputs * weights.unsqueeze(-1)).to(dtype)


class ExpertGroups(NamedTuple):
    """The (token, rank) pairs p = t·k + r of a routing grouped by expert: ``order`` [T·k]
    lists expert 0's pairs, then expert 1's, ... (ascending within an expert); ``counts``
    [E] how many each expert has."""

    order: torch.Tensor
    counts: list[int]


def group_by_expert(experts: torch.Tensor, num_experts: int) -> ExpertGroups:
    """The pairs of ``experts`` [T, k] grouped by expert."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return ExpertGroups(order, torch.bincount(flat, minlength=num_experts).tolist())


# The checkpoint's names of an expert's projections → (our linear, shard of its weight)
_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),  # mixtral
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}


class ExpertMLP(nn.Module):
    """One expert (or the shared expert): down(silu(x·gateᵀ)·(x·upᵀ)), x [T, hidden]."""

    def __init__(self, hidden: int, intermediate: int, kernels: Kernels) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden, intermediate, kernels)  # SiLU-and-mul included
        self.down_proj = Linear(intermediate, hidden, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))

    def load(self, projection: str, tensor: torch.Tensor | QuantTensor) -> str:
        """A checkpoint projection (``gate_proj``, ``up_proj``, ``down_proj`` or mixtral's
        ``w1``, ``w3``, ``w2``) into its weight; returns the weight's name."""
        if projection not in _PROJECTIONS:
            raise KeyError(f"an expert has no projection {projection!r}")
        linear, shard = _PROJECTIONS[projection]
        param = getattr(self, linear).weight
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(param.dtype)
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
        return f"{linear}.weight"


def _split_name(name: str) -> tuple[str, str]:
    """An expert weight's name below ``experts.`` as (expert or stacked name, projection):
    ``3.w1.weight`` → (3, w1), ``gate_up_proj`` → (gate_up_proj, empty)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[2] == "weight":
        return parts[0], parts[1]
    if len(parts) == 1:
        return parts[0], ""
    raise KeyError(f"no expert weight named {name!r}")


class ExpertList(nn.ModuleList):
    """The experts as modules of the kernels' linears, run in one C call or one call per chosen
    expert (module text)."""

    def __init__(self, spec: MoeSpec, kernels: Kernels) -> None:
        super().__init__(
            ExpertMLP(spec.hidden_size, spec.intermediate_size, kernels)
            for _ in range(spec.num_experts)
        )
        self.intermediate = spec.intermediate_size
        self.eager_cpu = kernels.device.type == "cpu" and not kernels.compiled
        self.path = None  # settled at the first forward after the weights are laid out

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self.path is None:
            self.path = self._settle()
        return (self.path or self.grouped)(x, routing.experts, routing.weights)

    def _settle(self):
        """The one-call experts where they apply, else ``grouped``; None while a weight is not
        laid out yet (its method may still change: a quantized or deferred weight)."""
        linears = [linear for e in self for linear in (e.gate_up_proj, e.down_proj)]
        if not all(linear.prepared for linear in linears):
            return None
        return (packed_experts(self) if self.eager_cpu else None) or self.grouped

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """The (token, rank) pairs grouped by expert, one call of each chosen expert over its
        tokens (in expert order), the weighted sum per token in rank order; one token (a single
        stream's decode): its experts in rank order, no grouping."""
        (t, k), hidden = experts.shape, x.shape[1]
        if t == 0:
            return x.new_empty(0, hidden)
        if t == 1:
            outputs = torch.stack([self[e](x) for e in experts[0].tolist()], dim=1)
            return weighted_sum(outputs, weights, x.dtype)
        groups = group_by_expert(experts, len(self))
        xs = x.index_select(0, groups.order // k)  # each pair's token, the pairs by expert
        ys, start = [], 0
        for expert, n in zip(self, groups.counts):
            if n:
                ys.append(expert(xs[start : start + n]))
                start += n
        outputs = xs.index_copy(0, groups.order, torch.cat(ys))  # row t·k + r: rank r of t
        return weighted_sum(outputs.view(t, k, hidden), weights, x.dtype)

    def load(self, name: str, tensor: torch.Tensor | QuantTensor) -> list[str]:
        """A checkpoint tensor named below ``experts.``: one expert's projection or a stacked
        [E, ...] tensor of all of them; returns the names of the weights it filled."""
        head, projection = _split_name(name)
        if projection:
            if not head.isdigit() or int(head) >= len(self):
                raise KeyError(f"no expert {head!r} (of {len(self)})")
            return [f"{head}.{self[int(head)].load(projection, tensor)}"]
        if head not in ("gate_up_proj", "down_proj") or not isinstance(tensor, torch.Tensor):
            raise KeyError(f"no stacked expert weight {head!r} (of a dense checkpoint)")
        _check_stacked(head, tensor, len(self))
        filled = []
        for e, expert in enumerate(self):
            if head == "down_proj":
                filled.append(f"{e}.{expert.load('down_proj', tensor[e])}")
            else:
                gate, up = tensor[e].split(self.intermediate)
                expert.load("gate_proj", gate)
                filled.append(f"{e}.{expert.load('up_proj', up)}")
        return filled


def _check_stacked(name: str, tensor: torch.Tensor, num_experts: int) -> None:
    if tensor.dim() != 3 or tensor.shape[0] != num_experts:
        raise ValueError(
            f"stacked expert weight {name!r} has shape {tuple(tensor.shape)}, expected "
            f"[{num_experts}, out, in]"
        )


class FusedExperts(nn.Module):
    """The experts' weights stacked, gate_up_proj [E, 2I, H] (each expert's gate rows, then its
    up rows) and down_proj [E, H, I], run by ``radixrt_kernels.triton.fused_moe`` (CUDA; dense
    weights only)."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        from radixrt_kernels.triton.fused_moe import fused_moe  # imports Triton

        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.intermediate, self.kernel = i, fused_moe

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.kernel(x, self.gate_up_proj, self.down_proj, routing.experts, routing.weights)

    def load(self, name: str, tensor: torch.Tensor | QuantTensor) -> list[str]:
        """As ``ExpertList.load``; a quantized tensor is refused."""
        if isinstance(tensor, QuantTensor):
            raise ValueError(
                f"expert weight {name!r} is quantized; the fused Triton experts take dense weights"
            )
        head, projection = _split_name(name)
        if not projection:
            if head not in ("gate_up_proj", "down_proj"):
                raise KeyError(f"no stacked expert weight {head!r}")
            _check_stacked(head, tensor, self.down_proj.shape[0])
            _copy(getattr(self, head), tensor)
            return [head]
        if not head.isdigit() or int(head) >= self.down_proj.shape[0]:
            raise KeyError(f"no expert {head!r} (of {self.down_proj.shape[0]})")
        linear, shard = _PROJECTIONS.get(projection, (None, None))
        if linear is None:
            raise KeyError(f"an expert has no projection {projection!r}")
        target = getattr(self, linear)[int(head)]
        if shard is not None:
            target = target.narrow(0, shard * self.intermediate, self.intermediate)
        _copy(target, tensor)
        return [linear]


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded.to(param.dtype))


def packed_experts(experts: ExpertList):
    """``experts`` as one C call (``cpu_experts.Experts``, called as x, ids, weights) where every
    expert's gate_up runs ``PackedGatedLinear`` and its down ``PackedLinear``, each on the same
    kernels for all experts; else None."""
    gate_ups = [e.gate_up_proj.method for e in experts]
    downs = [e.down_proj.method for e in experts]
    g, d = gate_ups[0], downs[0]
    if (
        any(type(m) is not PackedGatedLinear or m.kernels != g.kernels for m in gate_ups)
        or any(type(m) is not PackedLinear or m.kernels != d.kernels for m in downs)
        or g.kernels.threshold != d.kernels.threshold
    ):
        return None
    return cpu_experts.Experts(
        g.lib,
        [e.gate_up_proj.weight for e in experts],
        [e.down_proj.weight for e in experts],
        experts.intermediate,
        (g.kernels.small, g.kernels.large),
        (d.kernels.small, d.kernels.large),
        g.kernels.threshold,
    )


def make_experts(spec: MoeSpec, kernels: Kernels) -> ExpertList | FusedExperts:
    """``FusedExperts`` on CUDA for dense weights, else ``ExpertList`` (module text)."""
    if kernels.device.type == "cuda" and not kernels.defer:
        return FusedExperts(spec)
    return ExpertList(spec, kernels)


_LANES = 64  # a multiple of every CPU vector loop's step


def _sigmoid_rows(gate: torch.Tensor) -> torch.Tensor:
    """sigmoid of gate [T, 1], each row's value the same bits whatever T: PyTorch's sigmoid
    rounds an element in its scalar tail loop differently from one in its vector loop, so the
    gate is widened to a whole vector step per row, where every element takes the vector loop."""
    return torch.sigmoid(gate.expand(-1, _LANES).contiguous())[:, :1]


class SparseMoeBlock(nn.Module):
    """The block (module text): router ``gate`` [E, hidden], ``experts``, and where the spec
    has one the ``shared_expert`` and its ``shared_expert_gate`` [1, hidden]."""

    def __init__(self, spec: MoeSpec, kernels: Kernels = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(spec.hidden_size, spec.num_experts, kernels=kernels)
        self.experts = make_experts(spec, kernels)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = ExpertMLP(spec.hidden_size, spec.shared_intermediate_size, kernels)
            self.shared_expert_gate = Linear(spec.hidden_size, 1, kernels=kernels)

    def route(self, x: torch.Tensor) -> Routing:
        """Each token's experts and weights, x [T, hidden]."""
        return route(self.gate(x), self.spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        out = self.experts(x, self.route(x))
        if self.shared_expert is not None:
            out = out + _sigmoid_rows(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def load(self, name: str, tensor: torch.Tensor | QuantTensor) -> list[str]:
        """A checkpoint tensor by its name below the block (module text) into its parameter;
        returns the names (below the block) of the parameters it filled. Raises KeyError for a
        name the block has no parameter for, ValueError for a shape that does not fit."""
        if name == "gate.weight" or name == "shared_expert_gate.weight":
            linear = getattr(self, name.removesuffix(".weight"))
            if linear is None:
                raise KeyError(f"this block has no {name!r} (no shared expert)")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(linear.weight.dtype)
            linear.weight.weight_loader(linear.weight, tensor)
            return [name]
        if name.startswith("experts."):
            return [
                f"experts.{n}" for n in self.experts.load(name.removeprefix("experts."), tensor)
            ]
        parts = name.split(".")
        if (
            len(parts) == 3
            and parts[0] == "shared_expert"
            and parts[2] == "weight"
            and self.shared_expert is not None
        ):
            return [f"shared_expert.{self.shared_expert.load(parts[1], tensor)}"]
        raise KeyError(f"no mixture-of-experts weight named {name!r}")
