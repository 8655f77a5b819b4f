"""TritonAttentionBackend(deterministic=True) through ForwardBatch steps: a token's attention
output has the same bits whether its request is prefilled in one extend, in chunks after a
cached prefix, or decoded token by token, alone or beside other requests; under a sliding
window and a soft cap too.

One layer; each token's q/k/v are fixed inputs, as a model's would be for the same tokens.
The backend builds its own metadata from ``req_to_token`` and stores the K/V.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, make_generator, randn

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.attention.triton_backend import TritonAttentionBackend
from radixrt.cache.kv_pool import KVPool

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LENS = {"a": 75, "b": 40, "c": 9}  # tokens per request


class Requests:
    """Fixed q/k/v for every token of each request, and its slots (scattered, disjoint)."""

    def __init__(self, gen: torch.Generator, dtype: torch.dtype) -> None:
        total = sum(LENS.values())
        perm = torch.randperm(total, generator=gen) + 1  # slot 0 is the reserved page
        self.row = {name: i for i, name in enumerate(LENS)}
        self.qkv, self.slots, start = {}, {}, 0
        for name, n in LENS.items():
            self.qkv[name] = (
                randn(gen, n, HEADS, HEAD_DIM, dtype=dtype),
                randn(gen, n, KV_HEADS, HEAD_DIM, dtype=dtype),
                randn(gen, n, KV_HEADS, HEAD_DIM, dtype=dtype),
            )
            self.slots[name] = perm[start : start + n].to(DEVICE)
            start += n
        self.dtype = dtype

    def backend(self) -> TritonAttentionBackend:
        pool = KVPool(sum(LENS.values()) + 1, 1, KV_HEADS, HEAD_DIM, self.dtype, 4, 128, DEVICE)
        for name, slots in self.slots.items():
            pool.req_to_token[self.row[name], : len(slots)] = slots
        return TritonAttentionBackend(pool, deterministic=True)

    def step(self, backend, mode, parts, **window) -> dict[tuple[str, int], torch.Tensor]:
        """One forward over (request, first token, end) parts → output [H, D] per token;
        ``window``: the layer's window and softcap."""
        q, k, v = (torch.cat([self.qkv[n][i][s:e] for n, s, e in parts]) for i in range(3))
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.zeros(q.shape[0], dtype=torch.int64, device=DEVICE),
            positions=torch.cat([torch.arange(s, e) for _, s, e in parts]).to(DEVICE),
            out_cache_loc=torch.cat([self.slots[n][s:e] for n, s, e in parts]),
            req_rows=torch.tensor([self.row[n] for n, _, _ in parts], device=DEVICE),
            seq_lens=[e for _, _, e in parts],
            extend_lens=[e - s for _, s, e in parts],
        )
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, 0, batch, HEAD_DIM**-0.5, **window)
        tokens = [(n, t) for n, s, e in parts for t in range(s, e)]
        return dict(zip(tokens, out))


@pytest.mark.parametrize("window,softcap", [(None, None), (20, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_chunks_and_decode_give_the_same_bits(dtype, window, softcap, request):
    gen, seed = make_generator(request)
    reqs = Requests(gen, dtype)
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    kw = dict(window=window, softcap=softcap)

    whole = reqs.backend()  # each request prefilled alone, in one extend
    want = {}
    for name, n in LENS.items():
        want |= reqs.step(whole, extend, [(name, 0, n)], **kw)

    chunked = reqs.backend()  # "a" in chunks beside others; "c" prefilled, then decoded
    got = reqs.step(chunked, extend, [("b", 0, 17), ("a", 0, 33), ("c", 0, 5)], **kw)
    got |= reqs.step(chunked, extend, [("a", 33, 40), ("b", 17, 40)], **kw)
    got |= reqs.step(chunked, extend, [("a", 40, 70)], **kw)
    for pos in range(70, 75):
        parts = [("a", pos, pos + 1)] + ([("c", pos - 65, pos - 64)] if pos < 74 else [])
        got |= reqs.step(chunked, decode, parts, **kw)

    assert set(got) == set(want)
    differ = [t for t in want if not torch.equal(got[t], want[t])]
    assert not differ, f"seed {seed}: {len(differ)} tokens differ, first {differ[:5]}"
    assert chunked.describe() == "triton (deterministic: fixed KV splits)"
