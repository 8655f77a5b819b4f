"""The scheduler on a sliding-window pool (``SWAKVManager``), with no model: a fake runner of
one full and one sliding layer whose next token depends on the whole sequence read back
through the full layer's slots AND on the last W tokens read back through the sliding
layer's SWA slots. A wrong prefix hit, a window released too early or an SWA slot reused
while still in use changes the outputs; ``check_memory`` after every step checks both pools'
partition and that each request holds O(W) SWA slots."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.attention.base import ForwardBatch
from radixrt.cache.hicache import HierarchicalCache
from radixrt.cache.swa_pool import SWAKVPool
from radixrt.config import EngineConfig
from radixrt.sampling import SamplingParams
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.swa_kv import SWAKVManager, kv_manager

VOCAB, W = 97, 8


class FakeSWARunner:
    def __init__(self, num_slots: int, num_swa_slots: int, max_context: int = 256) -> None:
        self.pool = SWAKVPool(
            num_slots,
            num_swa_slots,
            [False, True],
            1,
            1,
            torch.float32,
            16,
            max_context,
            window=W,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        k = batch.input_ids.to(torch.float32).view(-1, 1, 1)
        for layer in (0, 1):
            self.pool.store_kv(layer, self.pool.slots_for(layer, batch.out_cache_loc), k, k)
        table, pool = self.pool.req_to_token, self.pool
        logits = torch.zeros(batch.batch_size, VOCAB)
        for b, (row, seq_len) in enumerate(zip(batch.req_rows.tolist(), batch.seq_lens)):
            full = table[row, :seq_len]
            ids = pool.k_buffers[0][full, 0, 0].long().tolist()
            last = full[max(0, seq_len - W) :]
            swa = pool.slots_for(1, last)
            assert bool((swa != 0).all()), "a window position without its SWA slot"
            window = pool.k_buffers[1][swa, 0, 0].long().tolist()
            logits[b, next_token(ids, window)] = 1.0
        return logits


def next_token(ids: list[int], window: list[int]) -> int:
    h = 0
    for t in ids + window:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids, ids[-W:]))
    return ids[len(prompt) :]


def make(num_slots: int = 2048, num_swa_slots: int = 2048, **cfg) -> Scheduler:
    return Scheduler(
        EngineConfig(**cfg),
        FakeSWARunner(num_slots, num_swa_slots),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=256,
    )


def run(sched: Scheduler, prompts: list[list[int]], n: int) -> list[Req]:
    sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    reqs = [Req(f"{random.random()}", list(p), sp) for p in prompts]
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in reqs):
        sched.step()
        sched.check_memory()  # both pools partitioned; O(W) SWA slots per request
    sched.check_memory()
    return reqs


def test_outputs_follow_the_window_with_and_without_cache_hits() -> None:
    sched = make()
    assert isinstance(sched.kv, SWAKVManager)
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(40)]  # a prefix longer than the window
    prompts = [
        system + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(6)
    ]
    first = run(sched, prompts[:1], 20)
    assert first[0].output_ids == reference(prompts[0], 20)
    again = run(sched, prompts, 20)
    for req, p in zip(again, prompts):
        assert req.output_ids == reference(p, 20)
    assert sum(r.cached_tokens for r in again) >= 5 * len(system)  # the shared prefix hit
    stats = sched.get_stats()
    assert stats["swa_requests"] == 0  # at idle: every SWA slot free or in the tree
    assert stats["swa_free"] + stats["swa_tree"] == stats["swa_slots"] == 2047  # slot 0: padding


def test_a_small_swa_pool_evicts_windows_and_still_gives_the_same_outputs() -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 60))] for _ in range(12)]
    want = [reference(p, 16) for p in prompts]
    sched = make(num_swa_slots=12 * (W + 4) + 64, chunked_prefill_size=16)
    for _ in range(2):  # the second round revisits prefixes whose windows were evicted
        got = run(sched, prompts, 16)
        assert [r.output_ids for r in got] == want
    assert sched.get_stats()["swa_tree"] < sum(map(len, prompts))  # windows were tombstoned


def test_without_the_radix_cache_the_window_is_still_released() -> None:
    sched = make(num_swa_slots=4 * (W + 64), disable_radix_cache=True)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(50)] for _ in range(4)]
    got = run(sched, prompts, 30)
    assert [r.output_ids for r in got] == [reference(p, 30) for p in prompts]


def test_the_hierarchical_cache_and_pages_are_refused_by_name() -> None:
    pool = FakeSWARunner(64, 64).pool
    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        kv_manager(pool, EngineConfig(), hicache=object.__new__(HierarchicalCache))
    with pytest.raises(ValueError, match="page_size 16"):
        kv_manager(pool, EngineConfig(page_size=16))
