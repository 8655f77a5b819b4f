"""Rotary-embedding tables: the cos/sin a model's positions rotate q and k by.

``cos_sin_tables`` turns a config's ``rope_theta`` and ``rope_scaling`` into
float32 tables [max_position, head_dim] in the neox layout (the two halves of
a head rotate together): cos·a, and sin·a with its first half negated (sin±),
so that rotate_half(x)·sin·a = roll(x, D/2)·sin±.  ``a`` is the scaling type's
attention factor (1 but for yarn).

Each type in :data:`ROPE_TYPES` gives the cos and sin transformers'
``ROPE_INIT_FUNCTIONS`` and ``LlamaRotaryEmbedding`` give at positions below
``max_position``, the model's ``max_position_embeddings``:

- ``linear``: inv_freq / factor.
- ``dynamic``: the NTK-rescaled base at a sequence length of
  max_position_embeddings, which transformers keeps until a sequence outgrows
  max_position_embeddings; the tables, and with them the runtime's context,
  end there, so its recomputation never comes into play.
- ``yarn``: inv_freq blended between interpolation (inv_freq / factor) and
  extrapolation over the dimensions between beta_fast and beta_slow rotations
  in the original context, with the attention factor from ``attention_factor``
  or ``factor``, ``mscale`` and ``mscale_all_dim``.
- ``llama3``: low frequencies / factor, high ones kept, a smooth blend between.
- ``longrope``: inv_freq / short_factor (per frequency), with the attention factor from
  ``attention_factor``, else sqrt(1 + ln(factor) / ln(original context)). transformers
  switches to long_factor once a forward's sequence outgrows
  ``original_max_position_embeddings``; the tables are short_factor's only, and
  ``ModelConfig.max_context`` ends the context there.

``scaling`` carries every key its type reads (``ModelConfig.rope_scaling``
resolves the defaults transformers would take from the rest of config.json).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

#: rope_scaling types with static tables (see the module docstring).
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")


def cos_sin_tables(
    head_dim: int, max_position: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos·a [max_position, head_dim], sin±·a [max_position, head_dim]), float32.

    ``head_dim`` is the number of dimensions rotated (a partial rotation's share of the head).
    ``scaling`` is None for plain RoPE or a dict whose ``rope_type`` is one of
    :data:`ROPE_TYPES`; ``a`` is its attention factor.
    """
    inv_freq, attention_factor = inv_freq_and_attention_factor(
        head_dim, max_position, base, scaling
    )
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos() * attention_factor
    sin = freqs.sin() * attention_factor
    return cos, torch.cat([-sin, sin], dim=-1)


def inv_freq_and_attention_factor(
    head_dim: int, max_position: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, the factor cos and sin are multiplied by)."""
    if scaling is None:
        return _inv_freq(head_dim, base), 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in _INV_FREQ:
        raise ValueError(
            f"rope_scaling type {rope_type!r} has no static tables; known: {ROPE_TYPES}"
        )
    return _INV_FREQ[rope_type](head_dim, max_position, base, scaling)


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(dim: int, max_position: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    return _inv_freq(dim, base) / s["factor"], 1.0


def _dynamic(dim: int, max_position: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    # transformers' formula at seq_len = max_position_embeddings: a base scaled by ~1.
    factor, seq_len = s["factor"], max_position
    base = base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    return _inv_freq(dim, base), 1.0


def _llama3(dim: int, max_position: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    inv_freq = _inv_freq(dim, base)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled), 1.0


def _yarn(dim: int, max_position: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1  # transformers' defaults
    low, high = _yarn_correction_range(
        fast, slow, dim, base, s["original_max_position_embeddings"], s.get("truncate", True)
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    # 1 on the dimensions that keep their frequency, 0 on those divided by factor
    if low == high:
        high += 0.001
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, yarn_attention_factor(s)


def _yarn_correction_range(
    fast: float, slow: float, dim: int, base: float, old_ctx: int, truncate: bool | None
) -> tuple[float, float]:
    """The dimension indices that make ``fast`` and ``slow`` rotations over ``old_ctx``."""

    def dim_of(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_attention_factor(s: dict) -> float:
    """yarn's cos/sin multiplier: ``attention_factor`` if set, else from factor and mscales."""
    if s.get("attention_factor") is not None:
        return s["attention_factor"]

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _longrope(dim: int, max_position: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    short = torch.tensor(s["short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (short * base**exponents), longrope_attention_factor(s)


def longrope_attention_factor(s: dict) -> float:
    """longrope's cos/sin multiplier: ``attention_factor`` if set, else from factor and the
    original context (1 where factor <= 1)."""
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    factor = s["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))


_INV_FREQ: dict[str, Callable[[int, int, float, dict], tuple[torch.Tensor, float]]] = {
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}
