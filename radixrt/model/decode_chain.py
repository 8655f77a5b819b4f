"""A decode step of a small batch as one C call.

In eager mode a decoder layer makes seven kernel calls (norm, qkv with rotary,
attention, o, norm, gate_up with SiLU-and-mul, down), each through a Python
wrapper, ctypes and an OpenMP team of its own. For a decode batch of a few rows
those fixed costs are of the order of streaming a small layer's weights. A
``DecodeChain`` runs every layer's steps as one chain
(``radixrt_kernels.cpu_chain``): one call and one thread team, a barrier
between steps. A step is then the embedding, the chain, and the final norm
with the LM head. The layers' attentions share one set of arguments (the
step's segments, its new K/V rows), written once per step
(``cpu_attention.AttentionCall.fields``).

An extend of as few tokens (a new turn's tokens after a cached prefix) runs
the same way: only its attention segments differ (causal ones). The chain
works on buffers of its own (up to ``max_rows`` rows; a chain per row count,
built on first use) and runs the kernels the layers chose for
decode-sized calls, so the logits equal the layer-by-layer forward's bit for
bit. ``decode_chain_for`` builds one where the model's layers all run packed
weights on a kernel the chain takes (AVX512-BF16 or FMA; not AMX) with the C
norms (q's and k's too, where the model norms them) and rotary embedding,
attention is the CPU backend's on a bf16 pool, and the model is not
compiled; otherwise it says why not.
"""

from __future__ import annotations

import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.model.linear_methods import (
    ByRows,
    PackedGatedLinear,
    PackedLinear,
    PackedRotaryQKV,
    RotateAfter,
)
from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import linear as cpu_linear


def _decode_side(layer, cls) -> tuple[str, torch.Tensor, int] | None:
    """(kernel, packed weight, most rows) of a linear layer's decode-sized calls when they run
    ``cls`` (a packed method) on a kernel a chain takes; else None. ``RotateAfter``: the packed
    linear, then the rotary embedding as a call of its own."""
    method, weight, rows = layer.method, layer.weight, None
    if isinstance(method, ByRows):
        method, rows = method.small, method.threshold
        weight = weight if layer.method.small_w is None else layer.method.small_w
    if cls is RotateAfter and isinstance(method, RotateAfter):
        method, cls = method.linear, PackedLinear
    if type(method) is not cls or method.kernels.small not in cpu_chain.KERNELS:
        return None
    return (
        method.kernels.small,
        weight,
        min(rows or method.kernels.threshold, method.kernels.threshold),
    )


def _qkv_side(attn) -> tuple[str, torch.Tensor, int, bool] | None:
    """``_decode_side`` of a qkv projection, and whether its kernel rotates q and k itself (a
    model that norms q and k has a plain projection: norms and rotation follow it)."""
    if attn.q_norm is not None:
        plain = _decode_side(attn.qkv_proj, PackedLinear)
        return None if plain is None else (*plain, False)
    fused = _decode_side(attn.qkv_proj, PackedRotaryQKV)
    if fused is not None:
        return (*fused, True)
    apart = _decode_side(attn.qkv_proj, RotateAfter)
    return None if apart is None else (*apart, False)


def _layer_sides(layer) -> tuple:
    """The decode-sized sides of a layer's qkv, o, gate_up and down (None where one has none)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        _qkv_side(attn),
        _decode_side(attn.o_proj, PackedLinear),
        _decode_side(mlp.gate_up_proj, PackedGatedLinear),
        _decode_side(mlp.down_proj, PackedLinear),
    )


def unavailable_reason(model, backend, lib) -> str | None:
    """Why a decode chain cannot run this model (None: it can)."""
    from radixrt.attention.cpu_backend import CpuAttentionBackend
    from radixrt.model.kernels import CRMSNorm, CRotary

    if lib is None:
        return "no CPU kernels' library"
    if model.compiled is not None:
        return "the model runs under torch.compile"
    if not isinstance(backend, CpuAttentionBackend) or backend.pool.dtype != torch.bfloat16:
        return "attention is not the CPU kernel's on a bf16 pool"
    if len({layer.self_attn.scaling for layer in model.model.layers}) != 1:
        return "the layers' attention scalings differ"
    for layer in model.model.layers:
        attn, sides = layer.self_attn, _layer_sides(layer)
        if any(s is None for s in sides) or attn.o_proj.bias is not None:
            return (
                "a layer's decode-sized linears do not all run packed weights on "
                f"{' or '.join(cpu_chain.KERNELS)}"
            )
        norms = (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm)
        norms += (attn.q_norm, attn.k_norm) if attn.q_norm is not None else ()
        if any(
            not isinstance(n.kernel, CRMSNorm) or n.weight.dtype != torch.bfloat16 for n in norms
        ):
            return "the RMS norms are not the C kernel's in bf16"
        if not sides[0][3] and not isinstance(attn.rotary.kernel, CRotary):
            return "the rotary embedding is not the C kernel's"
    return None


def decode_chain_for(model, backend, lib) -> tuple[DecodeChain | None, str]:
    """(a chain for the model, its description), or (None, why not)."""
    why = unavailable_reason(model, backend, lib)
    if why is not None:
        return None, f"off: {why}"
    chain = DecodeChain(model, backend, lib)
    return chain, chain.describe()


class _Plan:
    """One row count's views of the buffers and its chain."""

    def __init__(self, chain: DecodeChain, m: int) -> None:
        cfg, b = chain.model.config, chain.buffers
        d, h, kh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.residual, self.h = b["residual"][:m], b["h"][:m]
        qkv, o = b["qkv"][:m], b["o"][:m]
        self.q = qkv[:, : h * d].view(m, h, d)
        self.k = qkv[:, h * d : (h + kh) * d].view(m, kh, d)
        self.v = qkv[:, (h + kh) * d :].view(m, kh, d)
        self.o = o.view(m, h, d)
        x, act = b["x"][:m], b["act"][:m]
        rotary = chain.model.model.layers[0].self_attn.rotary
        pool = chain.backend.pool
        self.chain = steps = cpu_chain.Chain(chain.lib)
        for i, layer in enumerate(chain.model.model.layers):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            qkv_side, o_side, gate_up_side, down_side = _layer_sides(layer)
            if i == 0:  # the embedding (in residual) is the first layer's input as it is
                steps.norm(self.residual, norm.weight, norm.eps, x)
            else:
                steps.norm(self.h, norm.weight, norm.eps, x, self.residual)
            kernel, w, _, fused = qkv_side
            n, bias, cols = attn.qkv_proj.out_features, attn.qkv_proj.bias, (h + kh) * d
            if fused:
                rope = cpu_linear.Rope(chain.positions, rotary.cos, rotary.sin_signed, d, cols)
                steps.linear(kernel, x, w, n, qkv, bias, rope=rope)
            else:
                steps.linear(kernel, x, w, n, qkv, bias)
                if attn.q_norm is not None:  # each head of q and of k, in place
                    steps.norm(self.q, attn.q_norm.weight, attn.q_norm.eps, self.q)
                    steps.norm(self.k, attn.k_norm.weight, attn.k_norm.eps, self.k)
                qk = qkv[:, :cols].view(m, h + kh, d)
                steps.rope(qk, chain.positions, rotary.cos, rotary.sin_signed)
            steps.attention(
                chain.attention_args,
                pool.k_buffers[attn.layer_id],
                pool.v_buffers[attn.layer_id],
            )
            kernel, w, _ = o_side
            steps.linear(kernel, o, w, attn.o_proj.out_features, self.h)
            norm = layer.post_attention_layernorm
            steps.norm(self.h, norm.weight, norm.eps, x, self.residual)
            kernel, w, _ = gate_up_side
            steps.linear(kernel, x, w, mlp.gate_up_proj.out_features, act, gated=True)
            kernel, w, _ = down_side
            steps.linear(kernel, act, w, mlp.down_proj.out_features, self.h)


class DecodeChain:
    """A model's decode steps of up to ``max_rows`` rows as one chain each (see the module's text).
    Build it with ``decode_chain_for``, which checks that the model suits it."""

    def __init__(self, model, backend, lib) -> None:
        self.model, self.backend, self.lib = model, backend, lib
        cfg = model.config
        layers = model.model.layers
        sides = [side for layer in layers for side in _layer_sides(layer)]
        self.kernels = sorted({s[0] for s in sides})
        self.max_rows = min(s[2] for s in sides)
        rows, dt = self.max_rows, torch.bfloat16
        widths = {
            "residual": cfg.hidden_size,
            "h": cfg.hidden_size,
            "x": cfg.hidden_size,
            "qkv": layers[0].self_attn.qkv_proj.out_features,
            "o": cfg.num_heads * cfg.head_dim,
            "act": cfg.intermediate_size,
        }
        self.buffers = {name: torch.zeros(rows, w, dtype=dt) for name, w in widths.items()}
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.plans: dict[int, _Plan] = {}
        self.attention_args = torch.zeros(
            lib.radixrt_chain_attention_fields(), dtype=torch.int64
        )  # every layer's attention step reads the step's arguments here
        self.scaling = layers[0].self_attn.scaling

    def describe(self) -> str:
        return f"{', '.join(self.kernels)}, forwards of up to {self.max_rows} tokens"

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this forward runs here: up to ``max_rows`` tokens, a decode batch or an
        extend (a few new tokens after a cached prefix: the same steps, causal segments)."""
        return batch.input_ids.shape[0] <= self.max_rows

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's float32 logits for the batch (as ``LlamaForCausalLM.forward``)."""
        m = batch.input_ids.shape[0]
        plan = self.plans.get(m)
        if plan is None:
            plan = self.plans[m] = _Plan(self, m)
        torch.index_select(
            self.model.model.embed_tokens.weight, 0, batch.input_ids, out=plan.residual
        )
        self.positions[:m].copy_(batch.positions)
        attend = cpu_attention.AttentionCall(  # every layer's: the step's segments, its new K/V
            self.lib,
            plan.q,
            self.backend.pool.k_buffers[0],
            batch.attn_metadata,
            self.scaling,
            (plan.k, plan.v, batch.out_cache_loc),
            self.backend.bf16_dots,
            plan.o,
        )
        self.attention_args.copy_(torch.tensor(attend.fields, dtype=torch.int64))
        plan.chain.run()
        idx = batch.logits_indices
        if idx is None and batch.mode is ForwardMode.DECODE:  # every row's: no gather
            normed, _ = self.model.model.norm(plan.h, plan.residual)
            return self.model.lm_head(normed)
        if idx is None:
            idx = batch.last_token_indices()
        normed, _ = self.model.model.norm(plan.h[idx], plan.residual[idx])
        return self.model.lm_head(normed)
