"""Rotary-embedding tables: the cos/sin a model's positions rotate q and k by.

``cos_sin_tables`` turns a config's ``rope_theta`` and ``rope_scaling`` into
float32 tables [max_position, head_dim] in the neox layout (the two halves of
a head rotate together): cos, and sin with its first half negated (sin±), so
that rotate_half(x)·sin = roll(x, D/2)·sin±.
"""

from __future__ import annotations

import math

import torch


def cos_sin_tables(head_dim: int, max_position: int, base: float,
                   scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos [max_position, head_dim], sin± [max_position, head_dim]), float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    cos = torch.cat([freqs, freqs], dim=-1).cos()
    sin_signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return cos, sin_signed


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)
