"""The decoder of every supported family (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2,
Gemma 3 text) over the paged KV pool: the one model definition.

What differs between the families is read from ``ModelConfig`` when the model is built and
becomes the layers it is made of: Llama-style layers (RMSNorm before attention and MLP, the
residual add fused into the next norm) or Gemma-style ones (Gemma's RMSNorm before and after
attention and MLP, embeddings scaled by sqrt(hidden), logits soft-capped); a SiLU-gated or
GeGLU MLP; q/k norms; each layer's attention window (sliding layers attend the last
``sliding_window`` positions), logit soft-cap and scale; each kind of layer's RoPE (gemma3's
sliding layers have their own base), over the whole head or its first ``rotary_dim``
dimensions (phi3). Checkpoints with fused q/k/v or gate/up weights (phi3) load into the same
stacked layers.

The model reads and writes K/V only through the attention backend carried by
the ForwardBatch; it never sees request state. ``forward`` returns float32
logits for the token positions the batch asks for (by default each request's
last token).

``enable_torch_compile`` compiles the tensor part of the forward (embedding to
logits) into one graph with dynamic token counts; there the layers get no
batch, and attention runs as the opaque ``radixrt::attention`` op, which finds
the step's batch through ``forward_context``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixrt.attention.base import ForwardBatch, attention, forward_context
from radixrt.model.hf_config import ModelConfig
from radixrt.model.kernel_set import Kernels
from radixrt.model.layers import (
    DEFAULT_KERNELS,
    GateUpLinear,
    GeluGateUpLinear,
    GemmaRMSNorm,
    Linear,
    LMHead,
    LogitSoftCap,
    PartialRotaryEmbedding,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RotaryQKVLinear,
    ScaledVocabEmbedding,
    VocabEmbedding,
    prepare_weights,
)
from radixrt.model.moe import SparseMoeBlock


def _norm(cfg: ModelConfig, dim: int, kernels: Kernels) -> nn.Module:
    """The family's RMS norm over ``dim``: Gemma's (x·(1 + w) in float32) or Llama's."""
    if cfg.family == "gemma":
        return GemmaRMSNorm(dim, cfg.rms_norm_eps)
    return RMSNorm(dim, cfg.rms_norm_eps, kernels)


def _rotaries(cfg: ModelConfig, kernels: Kernels) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one per kind of layer (gemma3's sliding layers rotate by
    plain RoPE of ``local_rope_theta``), shared by the layers of that kind."""
    make = RotaryEmbedding if cfg.rotary_dim == cfg.head_dim else PartialRotaryEmbedding
    size = (cfg.rotary_dim, cfg.max_position_embeddings)

    def rotary(theta: float, scaling: dict | None) -> RotaryEmbedding:
        return make(*size, theta, scaling, kernels, rows=cfg.max_context)

    full = rotary(cfg.rope_theta, cfg.rope_scaling)
    local = full if cfg.local_rope_theta is None else rotary(cfg.local_rope_theta, None)
    return [full if w is None else local for w in cfg.layer_windows]


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, kernels: Kernels
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        heads = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
        # q and k are normed per head and then rotated, or rotated over part of the head: the
        # projection hands them over as they are; otherwise it hands them over rotated.
        self.rotate_after = cfg.qk_norm or cfg.rotary_dim != cfg.head_dim
        if self.rotate_after:
            self.qkv_proj = QKVLinear(*heads, bias=cfg.attention_bias, kernels=kernels)
        else:
            self.qkv_proj = RotaryQKVLinear(
                *heads, rotary, bias=cfg.attention_bias, kernels=kernels
            )
        # per head (qwen3, gemma3) or over the whole projection (olmoe: q [T, H·D], k [T, KH·D])
        q_dim, k_dim = cfg.head_dim, cfg.head_dim
        if cfg.qk_norm_whole:
            q_dim, k_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.whole = cfg.qk_norm_whole
        self.q_norm = _norm(cfg, q_dim, kernels) if cfg.qk_norm else nn.Identity()
        self.k_norm = _norm(cfg, k_dim, kernels) if cfg.qk_norm else nn.Identity()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, kernels=kernels)
        self.rotary = rotary  # one per kind of layer
        self.scaling = cfg.attn_scaling
        self.window = cfg.layer_windows[layer_id]
        self.softcap = cfg.attn_logit_softcapping

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(h, positions)
        if self.rotate_after:
            q = self.rotary(positions, self._qk_norm(self.q_norm, q))
            k = self.rotary(positions, self._qk_norm(self.k_norm, k))
        o = attention(q, k, v, self.layer_id, batch, self.scaling, self.window, self.softcap)
        return self.o_proj(o.reshape(h.shape[0], self.num_heads * self.head_dim))

    def _qk_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] normed per head, or over its heads together (olmoe)."""
        if not self.whole:
            return norm(x)
        return norm(x.reshape(x.shape[0], -1)).view(x.shape)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        # the activation-and-mul is part of the gate/up projection's method
        gated = GateUpLinear if cfg.hidden_act == "silu" else GeluGateUpLinear
        self.gate_up_proj = gated(cfg.hidden_size, cfg.intermediate_size, kernels)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """RMSNorm → attention → (+ residual) RMSNorm → MLP (Llama, Qwen, Mistral, Phi-3)."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, kernels: Kernels
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary, kernels)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_id)
        self.mlp = SparseMoeBlock(cfg.moe, kernels) if sparse else LlamaMLP(cfg, kernels)
        self.input_layernorm = _norm(cfg, cfg.hidden_size, kernels)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, kernels)

    def _input_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm of the hidden state, the residual stream): the first layer's h is
        the stream; later ones add the previous layer's output into it in the norm."""
        if residual is None:
            return self.input_layernorm(h), h
        return self.input_layernorm(h, residual)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): their sum is the hidden state
        after this layer, formed by the next norm (the add fused into it)."""
        h, residual = self._input_norm(h, residual)
        h = self.self_attn(positions, h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Norms on both sides of attention and of the MLP (Gemma 2 and 3): input_layernorm →
    attention → post_attention_layernorm → (+ residual) pre_feedforward_layernorm → MLP →
    post_feedforward_layernorm."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, kernels: Kernels
    ) -> None:
        super().__init__(cfg, layer_id, rotary, kernels)
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size, kernels)
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward``: (output, residual before it), summed by the next
        norm."""
        h, residual = self._input_norm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, batch))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        gemma = cfg.family == "gemma"
        embedding = ScaledVocabEmbedding if gemma else VocabEmbedding
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, kernels)
        layer = GemmaDecoderLayer if gemma else LlamaDecoderLayer
        self.layers = nn.ModuleList(
            layer(cfg, i, rotary, kernels) for i, rotary in enumerate(_rotaries(cfg, kernels))
        )
        self.norm = _norm(cfg, cfg.hidden_size, kernels)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the embedded tokens h [T, hidden]: (the last layer's output,
        the residual before it); the final hidden state is their sum."""
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, batch)
        return h, residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name → (our parameter name, shard id)
    STACKED = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig, kernels: Kernels = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, kernels)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, kernels)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cap = cfg.final_logit_softcapping
        self.logit_softcap = nn.Identity() if cap is None else LogitSoftCap(cap)
        self.compiled = None  # see enable_torch_compile

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [N, vocab] at ``batch.logits_indices`` (default: each request's last
        token)."""
        idx = (
            batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
        )
        if self.compiled is None:
            return self.logits(batch.input_ids, batch.positions, idx, batch)
        with forward_context(batch):
            return self.compiled(batch.input_ids, batch.positions, idx)

    # A forward is three parts: ``embed`` and ``head`` around ``body``, the decoder layers.
    # The runner may capture ``body`` and replay it as one chain of CPU kernels
    # (``radixrt.model.decode_chain``), so everything a layer computes belongs in it.

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def body(
        self, h: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over h [T, hidden]: (the last layer's output, the residual before
        it)."""
        return self.model(h, positions, batch)

    def final_hidden(self, h: torch.Tensor, residual: torch.Tensor, idx) -> torch.Tensor:
        """The final hidden state (h + residual after the final norm: what the LM head reads)
        of the rows ``idx``, in the model's dtype. An index tensor gathers (h and residual are
        left as they were); a slice is a view, and the fused add-norm writes the sum into it."""
        normed, _ = self.model.norm(h[idx], residual[idx])
        return normed

    def head(self, h: torch.Tensor, residual: torch.Tensor, idx) -> torch.Tensor:
        """float32 logits of the rows ``idx`` (an index tensor or a slice) of the final hidden
        state h + residual."""
        return self.logit_softcap(self.lm_head(self.final_hidden(h, residual, idx)))

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        idx: torch.Tensor,
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        h, residual = self.body(self.embed(input_ids), positions, batch)
        return self.head(h, residual, idx)

    def enable_torch_compile(self) -> None:
        """Compile ``logits`` with dynamic shapes: a graph serves every batch size (sizes of 1
        get their own; the runner compiles all of them before serving)."""
        self.compiled = torch.compile(self.logits, dynamic=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            experts = self._moe_block(name)
            if experts is not None:  # a sparse layer's router and experts load themselves
                layer, below, block = experts
                loaded.update(f"model.layers.{layer}.mlp.{p}" for p in block.load(below, tensor))
                continue
            target, shard = self._map_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
            param = params[target]
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(param.dtype)
            if shard is None:
                getattr(param, "weight_loader", _copy_whole)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        missing = {n for n in params if n not in loaded}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)[:8]}")
        prepare_weights(self)

    def _moe_block(self, name: str) -> tuple[int, str, SparseMoeBlock] | None:
        """(layer, the name below the block, the block) where checkpoint tensor ``name``
        belongs to a sparse layer's block (``model.layers.{i}.mlp.``; mixtral's
        ``block_sparse_moe``), else None."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        if parts[3] not in ("mlp", "block_sparse_moe"):
            return None
        layer = int(parts[2])
        block = self.model.layers[layer].mlp if layer < len(self.model.layers) else None
        if not isinstance(block, SparseMoeBlock):
            return None
        return layer, ".".join(parts[4:]), block

    def _map_name(self, name: str) -> tuple[str, str | int | None]:
        for ckpt, ours, shard in self.STACKED:
            if f".{ckpt}." in name:
                return name.replace(ckpt, ours), shard
        return name, None


def _copy_whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)
