"""The torch references against independent formulations (float64 SDPA), so the kernel tests
compare against something right. Pure torch: cheap, no Triton launches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_cases import indptr, make_generator, paged_kv, randn

from radixrt_kernels.triton.reference import decode_attention_ref, extend_attention_ref


def _sdpa64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D], k/v [L, KH, D] → [n, H, D] in float64; query i sits at position L - n + i."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        attn_mask=mask.to(q.device),
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def test_extend_reference_matches_sdpa(request):
    gen, _ = make_generator(request)
    prefixes, extends = [0, 7, 12], [5, 1, 9]
    kv = paged_kv(gen, prefixes, 2, 16, torch.float32)
    q = randn(gen, sum(extends), 6, 16, dtype=torch.float32)
    k_new = randn(gen, sum(extends), 2, 16, dtype=torch.float32)
    v_new = randn(gen, sum(extends), 2, 16, dtype=torch.float32)
    qo = indptr(extends)
    out = extend_attention_ref(
        q, k_new, v_new, kv.k_buffer, kv.v_buffer, qo, kv.indptr, kv.indices, 0.3
    )
    for b in range(3):
        new = slice(int(qo[b]), int(qo[b + 1]))
        slots = kv.indices[int(kv.indptr[b]) : int(kv.indptr[b + 1])]
        k = torch.cat([kv.k_buffer[slots], k_new[new]])
        v = torch.cat([kv.v_buffer[slots], v_new[new]])
        torch.testing.assert_close(
            out[new].double(), _sdpa64(q[new], k, v, 0.3), atol=1e-5, rtol=1e-5
        )


def test_decode_reference_matches_sdpa(request):
    gen, _ = make_generator(request)
    lens = [1, 6, 11]
    kv = paged_kv(gen, lens, 1, 16, torch.float32)
    q = randn(gen, 3, 4, 16, dtype=torch.float32)
    out = decode_attention_ref(q, kv.k_buffer, kv.v_buffer, kv.indptr, kv.indices, 0.25)
    for b in range(3):
        slots = kv.indices[int(kv.indptr[b]) : int(kv.indptr[b + 1])]
        want = _sdpa64(q[b : b + 1], kv.k_buffer[slots], kv.v_buffer[slots], 0.25)[0]
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)
