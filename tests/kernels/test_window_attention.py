"""Sliding windows: no attention kernel (decode and extend, split-count and deterministic)
reads a slot before its tokens' windows, where a sliding-window cache may leave anything. With
NaN in the K/V of every slot a step's tokens do not see, every output is finite and has the
bits it has with values there."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import indptr, make_generator, paged_kv, poisoned, randn

from radixrt_kernels.triton.decode_attention import decode_attention
from radixrt_kernels.triton.deterministic_attention import (
    FixedSplitConfig,
    deterministic_decode_attention,
    deterministic_extend_attention,
)
from radixrt_kernels.triton.extend_attention import ExtendConfig, extend_attention

WINDOW = 16
SMALL_SPLITS = FixedSplitConfig(split_len=32, block_n=16, num_warps=4, num_stages=1)
SMALL_BLOCKS = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _poison(kv, slots: list[int]) -> None:
    kv.k_buffer[slots] = float("nan")
    kv.v_buffer[slots] = float("nan")


def _same_without_the_dropped_slots(run, kv, dropped: list[int]) -> None:
    want = run()
    assert len(dropped) > 20
    _poison(kv, dropped)
    got = run()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("deterministic", [False, True])
def test_decode_reads_no_slot_before_the_window(deterministic, request):
    gen, _ = make_generator(request)
    lens = [1, 17, 64, 100, 33]
    kv = paged_kv(gen, lens, 2, 32, torch.float32)
    q = randn(gen, len(lens), 4, 32, dtype=torch.float32)
    starts = indptr(lens).tolist()
    seqs = [kv.indices[starts[b] : starts[b] + n] for b, n in enumerate(lens)]
    dropped = [int(x) for s, n in zip(seqs, lens) for x in s[: max(0, n - WINDOW)]]

    def run() -> torch.Tensor:
        o = poisoned(q.shape, q.dtype)
        args = (q, kv.k_buffer, kv.v_buffer, o, kv.indptr, kv.indices, 0.2)
        if deterministic:
            return deterministic_decode_attention(
                *args, 100, None, SMALL_SPLITS, window=WINDOW, softcap=30.0
            )
        return decode_attention(*args, 3, window=WINDOW, softcap=30.0)

    _same_without_the_dropped_slots(run, kv, dropped)


@pytest.mark.parametrize("deterministic", [False, True])
def test_extend_reads_no_slot_before_the_window(deterministic, request):
    """New tokens after cached prefixes longer than the window: no cached slot before the first
    new token's window is read (the deterministic extend reads the new tokens' K/V from their
    slots too)."""
    gen, _ = make_generator(request)
    requests = [(40, 20), (0, 37), (75, 1), (50, 33)]  # (cached, new)
    lens = [c + n for c, n in requests]
    kv = paged_kv(gen, lens, 2, 32, torch.float32)
    total = sum(n for _, n in requests)
    q = randn(gen, total, 4, 32, dtype=torch.float32)
    starts = indptr(lens).tolist()
    seqs = [kv.indices[starts[b] : starts[b] + lens[b]] for b in range(len(lens))]
    new = torch.cat([s[c:] for s, (c, _) in zip(seqs, requests)])
    k_new, v_new = kv.k_buffer[new].clone(), kv.v_buffer[new].clone()
    qo_indptr = indptr([n for _, n in requests])
    dropped = [int(x) for s, (c, _) in zip(seqs, requests) for x in s[: max(0, c - WINDOW + 1)]]

    def run() -> torch.Tensor:
        o = poisoned(q.shape, q.dtype)
        kw = dict(window=WINDOW, softcap=30.0)
        if deterministic:
            return deterministic_extend_attention(
                q,
                o,
                kv.k_buffer,
                kv.v_buffer,
                qo_indptr,
                kv.indptr,
                kv.indices,
                0.2,
                None,
                SMALL_SPLITS,
                **kw,
            )
        prefix_indptr = indptr([c for c, _ in requests])
        prefix = torch.cat([s[:c] for s, (c, _) in zip(seqs, requests)])
        return extend_attention(
            q,
            k_new,
            v_new,
            o,
            kv.k_buffer,
            kv.v_buffer,
            qo_indptr,
            prefix_indptr,
            prefix,
            0.2,
            None,
            SMALL_BLOCKS,
            **kw,
        )

    _same_without_the_dropped_slots(run, kv, dropped)
