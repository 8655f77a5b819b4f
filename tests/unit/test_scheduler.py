"""Scheduler tests with no model: a fake runner whose next token depends on the
whole sequence as read back *through the KV slots*.

The fake writes each token id into K at the token's slot; to predict, it reads
every slot of the request's req_to_token row. A wrong prefix match, a slot
freed while in use, or a bad retraction changes the outputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.cache import KVPool
from radixrt.config import EngineConfig
from radixrt.sampling import SamplingParams
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import Scheduler

VOCAB = 97


class FakeRunner:
    def __init__(self, num_slots: int, max_running: int = 16, max_context: int = 512) -> None:
        self.pool = KVPool(num_slots, 1, 1, 1, torch.float32, max_running, max_context)
        self.forwards = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.forwards += 1
        k = batch.input_ids.to(torch.float32).view(-1, 1, 1)
        self.pool.store_kv(0, batch.out_cache_loc, k, k)
        table, kbuf = self.pool.req_to_token, self.pool.k_buffers[0]
        logits = torch.zeros(batch.batch_size, VOCAB)
        for b, (row, seq_len) in enumerate(zip(batch.req_rows.tolist(), batch.seq_lens)):
            ids = kbuf[table[row, :seq_len], 0, 0].long().tolist()
            logits[b, next_token(ids)] = 1.0
        return logits


def next_token(ids: list[int]) -> int:
    h = 0
    for t in ids:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt):]


def make(num_slots: int = 4096, **cfg) -> Scheduler:
    config = EngineConfig(**cfg)
    return Scheduler(config, FakeRunner(num_slots), decode_fn=lambda ids: " ".join(map(str, ids)),
                     max_context=512)


def run(sched: Scheduler, prompts: list[list[int]], n: int, check_every_step: bool = False) -> list[Req]:
    sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    reqs = [Req(str(i), list(p), sp) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in reqs):
        sched.step()
        if check_every_step:
            sched.check_memory()
    sched.check_memory()
    return reqs


def shared_prompts(groups: int = 3, per: int = 4, system: int = 40, q: int = 6, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        sys_ids = [rng.randrange(VOCAB) for _ in range(system)]
        out += [sys_ids + [rng.randrange(VOCAB) for _ in range(q)] for _ in range(per)]
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("cfg", [{}, {"schedule_policy": "fcfs"}, {"schedule_policy": "dfs-weight"},
                                 {"page_size": 4}, {"chunked_prefill_size": 16},
                                 {"disable_radix_cache": True}])
def test_outputs_follow_the_kv(cfg):
    prompts = shared_prompts()
    sched = make(**cfg)
    reqs = run(sched, prompts, 12, check_every_step=True)
    assert [r.output_ids for r in reqs] == [reference(p, 12) for p in prompts]
    stats = sched.get_stats()
    if cfg.get("disable_radix_cache"):
        assert stats.get("cached_tokens", 0) == 0
    else:
        assert stats["cached_tokens"] > 0


def test_in_batch_dedup_computes_each_shared_prefix_once():
    prompts = shared_prompts(groups=3, per=4, system=64, q=6)
    sched = make()
    run(sched, prompts, 2)
    assert sched.get_stats()["prefill_tokens"] == 3 * 64 + len(prompts) * 6


def test_retraction_under_a_tiny_pool_gives_the_same_tokens():
    prompts = shared_prompts(groups=4, per=4, system=24, q=8, seed=1)
    demand = sum(len(p) + 40 for p in prompts)
    sched = make(num_slots=demand // 4)
    reqs = run(sched, prompts, 40, check_every_step=True)
    assert [r.output_ids for r in reqs] == [reference(p, 40) for p in prompts]
    assert sched.get_stats()["retractions"] > 0


def test_abort_waiting_and_running_release_kv():
    sched = make()
    sp = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    a, b = Req("a", list(range(10)), sp), Req("b", list(range(5, 30)), sp)
    sched.add_request(a)
    sched.step()  # a is running
    sched.add_request(b)  # b is waiting
    assert sched.abort("b").finish_reason == "abort"
    assert sched.abort("a").finish_reason == "abort"
    with pytest.raises(KeyError, match="nope"):
        sched.abort("nope")
    assert sched.idle
    sched.check_memory()


def test_second_round_hits_whole_prompts():
    prompts = shared_prompts(groups=2, per=3)
    sched = make()
    run(sched, prompts, 5)
    again = run(sched, prompts, 5)
    assert all(r.cached_tokens == len(r.prompt_ids) - 1 for r in again)


def test_check_memory_catches_a_leak():
    sched = make()
    run(sched, shared_prompts(groups=1, per=2), 3)
    sched.kv.allocator.alloc(3)  # taken by nobody
    with pytest.raises(AssertionError, match="leaked"):
        sched.check_memory()
