"""Plain-torch references of the kernels, same arguments, one request at a time, in float32.

They favour being obviously right over speed: gather the request's K/V,
repeat KV heads for GQA, softmax, matmul. Attention outputs come back in
q's dtype; ``store_kv_ref`` writes in place like the kernel. ``window`` and
``softcap`` are the kernels': a token at position p sees keys p - window + 1 .. p,
and scores (after scaling) become softcap·tanh(s / softcap) before the softmax.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    k_buffer[slots.long()] = k.to(k_buffer.dtype)
    v_buffer[slots.long()] = v.to(v_buffer.dtype)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [n, H, D] = the last n of L tokens, k/v [L, KH, D] → float32 [n, H, D], causal (and
    within ``window`` keys of each token; scores soft-capped at ``softcap``)."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * sm_scale  # [H, n, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keys, pos = torch.arange(length)[None, :], torch.arange(n)[:, None] + (length - n)
    visible = (keys <= pos) & (keys > pos - (window or length))
    scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1)


def extend_attention_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Like ``extend_attention``; returns a new tensor shaped and typed like q."""
    out = torch.empty_like(q)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        new = slice(qo[b], qo[b + 1])
        k = torch.cat([k_buffer[slots].float(), k_new[new].float()])
        v = torch.cat([v_buffer[slots].float(), v_new[new].float()])
        out[new] = attention_ref(q[new], k, v, sm_scale, window, softcap).to(q.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Like ``decode_attention``; returns a new tensor shaped and typed like q."""
    out = torch.empty_like(q)
    kv = kv_indptr.tolist()
    for b in range(len(kv) - 1):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        k, v = k_buffer[slots], v_buffer[slots]
        out[b] = attention_ref(q[b : b + 1], k, v, sm_scale, window, softcap)[0].to(q.dtype)
    return out
