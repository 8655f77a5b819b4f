"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral) over the paged KV pool.

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

from typing import Iterable

import torch
from torch import nn

from radixrt.attention.base import ForwardBatch, attention, forward_context
from radixrt.model.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                  RMSNorm, RotaryEmbedding, RowParallelLinear, SiluAndMul,
                                  VocabParallelEmbedding)
from radixrt.model.loader import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.attention_bias, rope_follows=not cfg.qk_norm)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rotary = rotary  # one for the model: its cos/sin are looked up once per forward
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scaling = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
        t, d = h.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if self.qkv_proj.fused_rope:  # q and k rotated in the linear's own pass
            qkv = self.qkv_proj.rotated(h, positions, self.rotary)
            q = qkv[:, :q_size].view(t, self.num_heads, d)
            k = qkv[:, q_size:q_size + kv_size].view(t, self.num_kv_heads, d)
        elif self.q_norm is None:  # q and k lie side by side in qkv: one rotation for both
            qkv = self.qkv_proj(h)
            qk = self.rotary(positions, qkv[:, :q_size + kv_size].view(t, -1, d))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            qkv = self.qkv_proj(h)
            q = self.q_norm(qkv[:, :q_size].view(t, self.num_heads, d))
            k = self.k_norm(qkv[:, q_size:q_size + kv_size].view(t, self.num_kv_heads, d))
            q, k = self.rotary(positions, q), self.rotary(positions, k)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, d)
        o = attention(q, k, v, self.layer_id, batch, self.scaling)
        return self.o_proj(o.reshape(t, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       silu_gated=True)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.gate_up_proj.fused_act else self.act(h))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): their sum is the hidden state
        after this layer, formed by the next norm (the add fused into it)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual before it): the final hidden state is their sum."""
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, batch)
        return h, residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name → (our parameter name, shard id)
    STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
               ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled = None  # see enable_torch_compile

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [N, vocab] at ``batch.logits_indices`` (default: each request's last token)."""
        idx = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
        if self.compiled is None:
            return self.logits(batch.input_ids, batch.positions, idx, batch)
        with forward_context(batch):
            return self.compiled(batch.input_ids, batch.positions, idx)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor,
               batch: ForwardBatch | None = None) -> torch.Tensor:
        h, residual = self.model(input_ids, positions, batch)
        normed, _ = self.model.norm(h[idx], residual[idx])
        return self.lm_head(normed)

    def enable_torch_compile(self) -> None:
        """Compile ``logits`` with dynamic shapes: a graph serves every batch size (sizes of 1
        get their own; the runner compiles all of them before serving)."""
        self.compiled = torch.compile(self.logits, dynamic=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, shard = self._map_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
            param = params[target]
            tensor = tensor.to(param.dtype)
            if shard is None:
                param.weight_loader(param, tensor) if hasattr(param, "weight_loader") else param.data.copy_(tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        missing = {n for n in params if n not in loaded}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)[:8]}")

    def _map_name(self, name: str) -> tuple[str, str | int | None]:
        for ckpt, ours, shard in self.STACKED:
            if f".{ckpt}." in name:
                return name.replace(ckpt, ours), shard
        return name, None
