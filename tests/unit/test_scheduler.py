"""Scheduler tests with no model: a fake runner whose next token depends on the
whole sequence as read back *through the KV slots*.

The fake writes each token id into K at the token's slot; to predict, it reads
every slot of the request's req_to_token row. A wrong prefix match, a slot
freed while in use, or a bad retraction changes the outputs.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from radixrt.attention.base import ForwardBatch
from radixrt.cache import KVPool
from radixrt.config import EngineConfig
from radixrt.sampling import SamplingParams
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import (
    DEDUP_MIN_TOKENS,
    ITL_FACTOR,
    MIN_CAPPED_TOKENS,
    MIN_PREFILL_TOKENS,
    TAIL_FRACTION,
    Scheduler,
)
from radixrt.scheduler.step_cost import StepCost

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
    return ids[len(prompt) :]


def make(num_slots: int = 4096, **cfg) -> Scheduler:
    config = EngineConfig(**cfg)
    return Scheduler(
        config,
        FakeRunner(num_slots),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=512,
    )


def run(
    sched: Scheduler, prompts: list[list[int]], n: int, check_every_step: bool = False
) -> list[Req]:
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


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"schedule_policy": "fcfs"},
        {"schedule_policy": "dfs-weight"},
        {"page_size": 4},
        {"chunked_prefill_size": 16},
        {"disable_radix_cache": True},
    ],
)
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


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
@pytest.mark.parametrize("step_ms", [0, 30, 100])
def test_in_batch_dedup_computes_each_shared_prefix_once(policy, step_ms):
    """Whatever the time budget (none; steps that chunk the prefixes; steps of a few
    prompts), requests wait for a shared prefix another one is computing, unless less than
    DEDUP_MIN_TOKENS of it is left to compute: one request per group computes its prefix,
    the others hit all of it but such a rest in the tree."""
    prompts = shared_prompts(groups=3, per=4, system=64, q=6)
    sched = make_timed(max_prefill_step_ms=step_ms, schedule_policy=policy)
    reqs = run(sched, prompts, 2)
    cached = sorted(r.cached_tokens for r in reqs)
    assert cached[:3] == [0, 0, 0]
    assert all(64 - DEDUP_MIN_TOKENS < c <= 64 for c in cached[3:])
    assert sched.get_stats()["prefill_tokens"] == sum(70 - c for c in cached)
    if step_ms == 0:  # no chunks: every prefix is whole in the tree before its group runs
        assert cached[3:] == [64] * 9
    assert [r.output_ids for r in reqs] == [reference(p, 2) for p in prompts]


def run_salted(
    sched: Scheduler, prompts: list[list[int]], salts: list[str | None], n: int
) -> list[Req]:
    reqs = [
        Req(
            str(i),
            list(p),
            SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, cache_salt=salt),
        )
        for i, (p, salt) in enumerate(zip(prompts, salts))
    ]
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in reqs):
        sched.step()
        sched.check_memory()
    sched.check_memory()
    return reqs


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_salts_split_the_cache_and_the_in_batch_dedup(policy):
    prompts = shared_prompts(groups=3, per=4, system=64, q=6)
    salts = [None, "a", "b", "a"] * 3
    sched = make(schedule_policy=policy)
    reqs = run_salted(sched, prompts, salts, 2)
    assert [r.output_ids for r in reqs] == [reference(p, 2) for p in prompts]
    # Each (system prompt, salt) pair present is computed once; nothing crosses salts.
    pairs = {(tuple(p[:64]), salt) for p, salt in zip(prompts, salts)}
    assert sched.get_stats()["prefill_tokens"] == 64 * len(pairs) + len(prompts) * 6


def test_same_prompt_under_two_salts_shares_nothing():
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(80)]
    sched = make()
    sp = [
        SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, cache_salt=s) for s in "ab"
    ]
    a, b = Req("a", list(prompt), sp[0]), Req("b", list(prompt), sp[1])
    sched.add_request(a), sched.add_request(b)
    sched.step()
    assert a.output_ids and b.output_ids  # one prefill batch: no dedup wait across salts
    while not (a.finished and b.finished):
        sched.step()
    sched.check_memory()
    assert a.cached_tokens == b.cached_tokens == 0
    assert sched.get_stats()["prefill_tokens"] == 2 * len(prompt)
    c, d = run_salted(sched, [prompt, prompt], ["b", None], 3)  # later, one after the other
    assert c.cached_tokens == len(prompt) - 1 and d.cached_tokens == 0
    assert a.output_ids == b.output_ids == c.output_ids == d.output_ids == reference(prompt, 3)
    e, f = run_salted(
        sched, [prompt + [1] * 40, prompt + [2] * 40], ["c", "c"], 1
    )  # same salt: dedup
    assert e.cached_tokens == 0 and f.cached_tokens == len(prompt)


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


# ------------------------------------------------------------ fault isolation


class FlakyRunner(FakeRunner):
    """A FakeRunner whose forwards number ``fail_on`` (1-based) raise before writing any KV."""

    def __init__(self, num_slots: int, fail_on: set[int]) -> None:
        super().__init__(num_slots)
        self.fail_on = fail_on

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.forwards + 1 in self.fail_on:
            self.forwards += 1
            raise RuntimeError("boom")
        return super().forward(batch)


def make_flaky(fail_on: set[int], num_slots: int = 4096, **cfg) -> Scheduler:
    return Scheduler(
        EngineConfig(**cfg),
        FlakyRunner(num_slots, fail_on),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=512,
    )


def drive(sched: Scheduler, reqs: list[Req]) -> None:
    while not all(r.finished for r in reqs):
        sched.step()
        sched.check_memory()
    sched.check_memory()


FAULT_CFGS = [{}, {"page_size": 4}, {"chunked_prefill_size": 16}, {"disable_radix_cache": True}]


@pytest.mark.parametrize("cfg", FAULT_CFGS)
@pytest.mark.parametrize("fail_on", [{1}, {4}], ids=["prefill", "decode"])
def test_forward_failure_fails_the_batch_and_frees_its_slots(cfg, fail_on):
    prompts = shared_prompts(groups=2, per=3, system=30, q=5)
    sched = make_flaky(fail_on, max_running_requests=3, **cfg)  # 3 of 6 per batch: some survive
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    reqs = [Req(str(i), list(p), sp) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, reqs)
    failed = [r for r in reqs if r.finish_reason == "error"]
    assert 0 < len(failed) < len(reqs)
    assert all("forward pass failed" in r.error and "boom" in r.error for r in failed)
    assert sched.stats["finished_error"] == len(failed) and sched.stats["forward_failures"] == 1
    assert sched.forward_failures == 0  # reset by the good forwards after the failure
    for r in reqs:
        if r.finish_reason != "error":
            assert r.output_ids == reference(r.prompt_ids, 8)
    # nothing the failed forward was meant to write is in the tree: a rerun gives the true tokens
    again = run(sched, prompts, 8, check_every_step=True)
    assert [r.output_ids for r in again] == [reference(p, 8) for p in prompts]


@pytest.mark.parametrize("mixed", [True, False])
def test_forward_failure_spares_requests_outside_the_batch(mixed):
    """A failed prefill fails its prompts only: a running request decodes on, whether it
    rode along in the failed (mixed) step or not."""
    sched = make_flaky({3}, disable_mixed_chunk=not mixed)
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    a, b = Req("a", list(range(10)), sp), Req("b", list(range(40, 60)), sp)
    sched.add_request(a)
    sched.step()  # forward 1: a's prefill
    sched.step()  # forward 2: a decodes
    sched.add_request(b)
    assert sched.step() == [b]  # forward 3: b's prefill (with a's next token if mixed) fails
    assert len(a.output_ids) == 2
    assert b.finish_reason == "error" and sched.forward_failures == 1
    drive(sched, [a])
    assert a.finish_reason == "length" and a.output_ids == reference(a.prompt_ids, 6)
    assert sched.forward_failures == 0


def test_consecutive_forward_failures_are_counted():
    sched = make_flaky({1, 2, 3})
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    for i in range(3):
        req = Req(str(i), list(range(i, i + 10)), sp)
        sched.add_request(req)
        sched.step()
        assert req.finish_reason == "error" and sched.forward_failures == i + 1
    assert sched.idle
    sched.check_memory()


def test_a_failing_stop_check_fails_only_that_request():
    from radixrt.server import faults

    sched = make()
    faults.install_in_scheduler(sched, faults.parse("stop_check"))
    prompts = shared_prompts(groups=1, per=4, system=20, q=4)
    reqs = [
        Req(
            str(i),
            list(p),
            SamplingParams(
                max_new_tokens=6,
                temperature=0,
                ignore_eos=True,
                stop=["<fault:stop_check>"] if i == 1 else ["zzz"],
            ),
        )
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        sched.add_request(r)
    drive(sched, reqs)
    assert [r.finish_reason for r in reqs] == ["length", "error", "length", "length"]
    assert "injected stop_check fault" in reqs[1].error
    for i in (0, 2, 3):
        assert reqs[i].output_ids == reference(prompts[i], 6)


def test_forward_fault_hits_batches_with_a_marked_request():
    from radixrt.server import faults

    sched = make()
    faults.install_in_scheduler(sched, faults.parse("forward"))
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    good = Req("good", list(range(12)), sp)
    sched.add_request(good)
    sched.step()
    bad = Req(
        "bad",
        list(range(30, 50)),
        SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, stop=["<fault:forward>"]),
    )
    sched.add_request(bad)
    assert sched.step() == [bad] and bad.finish_reason == "error"  # bad's prefill batch
    drive(sched, [good])
    assert good.output_ids == reference(good.prompt_ids, 4)


def test_fault_spec_parsing():
    from radixrt.server import faults

    assert faults.parse(None) is None and faults.parse("") is None
    armed = faults.parse("stop_check, forward:always")
    assert armed.armed == {"stop_check": "marker", "forward": "always"}
    assert armed.fires("forward", None) and armed.fires("stop_check", ["<fault:stop_check>"])
    assert not armed.fires("stop_check", ["x"]) and not armed.fires(
        "detokenize", ["<fault:detokenize>"]
    )
    for bad in ("nope", "forward:sometimes", "forward,"):
        with pytest.raises(ValueError, match="debug-faults"):
            faults.parse(bad)


def test_a_failing_sampler_fails_the_requests_it_samples_for():
    sched = make(disable_mixed_chunk=True)  # b's prefill step samples for b alone
    sp = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    a = Req("a", list(range(10)), sp)
    sched.add_request(a)
    sched.step()
    sample, calls = sched.sampler.sample, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("bad params")
        return sample(*args)

    sched.sampler.sample = flaky
    b = Req("b", list(range(50, 70)), sp)
    sched.add_request(b)
    assert sched.step() == [b] and "sampling failed" in b.error  # b's prefill step
    drive(sched, [a])
    assert a.output_ids == reference(a.prompt_ids, 5)
    again = run(sched, [b.prompt_ids], 5)[0]  # b's computed prompt KV was cached, and is right
    assert again.cached_tokens == len(b.prompt_ids) - 1 and again.output_ids == reference(
        b.prompt_ids, 5
    )


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_polling_the_queue_changes_neither_eviction_order_nor_hit_counts(policy):
    from radixrt.scheduler.policy import order_waiting

    sched = make(schedule_policy=policy, eviction_policy="lfu")
    run(sched, shared_prompts(groups=3, per=2), 4)
    tree = sched.kv.tree

    def state():
        nodes = sorted((n.id, n._key, n.last_access, n.hit_count) for n in tree._nodes())
        return nodes, [e[:-1] for e in tree._evictable], tree._clock

    before = state()
    sp = SamplingParams(max_new_tokens=2, temperature=0)
    waiting = [
        Req(f"w{i}", p[: len(p) - 3] + [1, 2], sp)
        for i, p in enumerate(shared_prompts(groups=3, per=2))
    ]
    orders = {tuple(r.rid for r in order_waiting(policy, waiting, sched.kv)) for _ in range(100)}
    assert len(orders) == 1  # and the order does not drift either
    assert state() == before
    assert [sched.kv.prefix_len_hint(r) for r in waiting] == [
        sched.kv.prefix_len_hint(r) for r in waiting
    ]
    assert any(sched.kv.prefix_len_hint(r) > 0 for r in waiting)
    assert state() == before


# ---------------------------------------------------------------- time budget and mixed steps


class FixedCost(StepCost):
    """Steps cost 1 ms per token and nothing else, whatever they take here (never learns)."""

    def __init__(self) -> None:
        super().__init__(0.0, fixed=0.0, per_unit=1e-3)

    def observe(self, seconds: float, tokens: int, pairs: int, prompt: bool = False) -> None:
        pass


class RecordingRunner(FakeRunner):
    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.batches: list[tuple[str, list[int]]] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append((batch.mode.value, list(batch.extend_lens)))
        return super().forward(batch)


def make_timed(**cfg) -> Scheduler:
    return Scheduler(
        EngineConfig(**cfg),
        RecordingRunner(4096),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=512,
        step_cost=FixedCost(),
    )


def test_a_step_prefills_what_its_time_buys_and_running_requests_ride_along():
    """Prompts that arrived together run in full time-budget steps, the first one's decoding
    riding along; a prompt that arrives while a request streams gets only ITL_FACTOR times
    that request's decode step."""
    sched = make_timed(max_prefill_step_ms=100)  # 100 tokens a step
    prompts = [[(7 * i + j) % VOCAB for j in range(150)] for i in range(4)]
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    reqs = [Req(str(i), p, sp) for i, p in enumerate(prompts)]
    for r in reqs[:3]:
        sched.add_request(r)
    sched.step()
    sched.step()
    assert [len(r.output_ids) for r in reqs] == [1, 0, 0, 0]  # the first token as its prompt ends
    sched.step()
    batches = sched.runner.batches
    # the step completing request 0's prompt holds nothing else: nothing decodes to wait
    assert batches[:2] == [("extend", [100]), ("extend", [50])]
    # request 0 decodes in a step of the whole budget: the prompts waiting came with it
    assert batches[2] == ("extend", [1, 99])
    sched.add_request(reqs[3])  # arrives while request 0 streams
    sched.step()
    # each step now holds request 0's token and as much prompt as ITL_FACTOR times its decode
    # step buys, at least MIN_CAPPED_TOKENS
    assert batches[3] == ("extend", [1, max(int(ITL_FACTOR * 1) - 1, MIN_CAPPED_TOKENS)])
    drive(sched, reqs)
    assert sched.stats["mixed_steps"] > 0 and sched.stats["prefill_tokens"] == 600
    for r, p in zip(reqs, prompts):
        assert r.output_ids == reference(p, 4)


def test_a_steps_first_prompt_gets_its_floor_whatever_the_time_says():
    sched = make_timed(max_prefill_step_ms=10)  # 10 tokens a step
    run(sched, [[(3 * j) % VOCAB for j in range(150)]], 2)
    assert sched.runner.batches[:2] == [("extend", [MIN_PREFILL_TOKENS])] * 2


def test_the_cap_follows_the_streams_a_prompt_interrupts():
    """A mixed step after a late prompt is held to ITL_FACTOR times the decode step of the
    requests that were streaming when it arrived; the rows of requests that started streaming
    later (members of the same burst) ride along inside that cap, not widening it."""
    cost = FixedCost()
    cost.fixed = 0.05  # every step: 50 ms, then 1 ms a token
    sched = Scheduler(
        EngineConfig(max_prefill_step_ms=1000),
        RecordingRunner(4096),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=1024,
        step_cost=cost,
    )
    sp = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    prompts = [[(13 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((100, 300, 300))]
    stream, *burst = [Req(str(i), p, sp) for i, p in enumerate(prompts)]
    sched.add_request(stream)
    sched.step()  # the stream's prompt; it streams from here
    for r in burst:
        sched.add_request(r)
    while not burst[0].output_ids:
        sched.step()
    sched.step()
    mode, lens = sched.runner.batches[-1]  # the stream, burst[0], and burst[1]'s chunk
    capped = (ITL_FACTOR * cost.predict(1, 0) - cost.fixed) / cost.per_unit
    assert mode == "extend" and lens == [1, 1, int(capped) - 2]
    drive(sched, [stream, *burst])
    for r, p in zip([stream, *burst], prompts):
        assert r.output_ids == reference(p, 30)


def test_a_prompt_that_arrived_before_a_streams_first_token_is_of_its_burst():
    """A request the server took after a step but that arrived while it ran (``arrived_at``
    before the step's first token) is a member of that token's burst: no cap; one that
    arrived after the token is capped."""
    sched = make_timed(max_prefill_step_ms=100)
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[(17 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((50, 150, 150))]
    first, same, late = [Req(str(i), p, sp) for i, p in enumerate(prompts)]
    sent = time.monotonic()
    sched.add_request(first)
    sched.step()  # first's prompt and first token
    sched.add_request(same, arrived_at=sent)
    sched.step()
    assert sched.runner.batches[-1] == ("extend", [1, 99])  # the whole budget
    sched.add_request(late, arrived_at=time.monotonic())
    sched.step()
    # first's token and the rest of same's prompt, capped now
    assert sched.runner.batches[-1] == ("extend", [1, max(int(ITL_FACTOR) - 1, MIN_CAPPED_TOKENS)])
    assert late.queued_at <= time.monotonic() and same.queued_at == sent
    drive(sched, [first, same, late])
    for r, p in zip([first, same, late], prompts):
        assert r.output_ids == reference(p, 4)


def test_a_short_tail_goes_with_its_prompts_chunk():
    """A prompt whose rest after the time budget's chunk is at most TAIL_FRACTION of it runs
    whole in that step, so its first token does not wait a step for the tail; a longer rest,
    and the chunk size (a hard cap), still split it."""
    sched = make_timed(max_prefill_step_ms=100)  # 100 tokens a step
    within = int(100 * (1 + TAIL_FRACTION))
    prompts = [[(11 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((within, within + 1))]
    sp = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    reqs = [Req(str(i), p, sp) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    sched.step()
    assert [len(r.output_ids) for r in reqs] == [1, 0]
    assert sched.runner.batches[0] == ("extend", [within])
    drive(sched, reqs)
    mode, lens = sched.runner.batches[1]  # request 0 decodes; the longer prompt is chunked
    assert mode == "extend" and lens[0] == 1 and lens[1] < within + 1
    for r, p in zip(reqs, prompts):
        assert r.output_ids == reference(p, 2)
    capped = make_timed(max_prefill_step_ms=100, chunked_prefill_size=100)
    run(capped, prompts[:1], 2)
    assert capped.runner.batches[:2] == [("extend", [100]), ("extend", [within - 100])]


def test_without_a_time_budget_prompts_are_not_chunked():
    sched = make_timed(max_prefill_step_ms=0)
    run(sched, [[(3 * i + j) % VOCAB for j in range(150)] for i in range(3)], 2)
    assert sched.runner.batches[0] == ("extend", [150, 150, 150])
    assert sched.stats["prefill_chunks"] == 0


def test_without_mixed_steps_running_requests_wait_for_a_decode_step():
    sched = make_timed(max_prefill_step_ms=100, disable_mixed_chunk=True)
    prompts = [[(5 * i + j) % VOCAB for j in range(150)] for i in range(3)]
    reqs = run(sched, prompts, 4, check_every_step=True)
    batches = sched.runner.batches
    assert batches[:3] == [("extend", [100]), ("extend", [50]), ("extend", [100])]
    assert sched.stats["mixed_steps"] == 0
    assert all(mode == "decode" or all(n > 1 for n in lens) for mode, lens in batches)
    assert [r.output_ids for r in reqs] == [reference(p, 4) for p in prompts]


@pytest.mark.parametrize("cfg", [{}, {"page_size": 4}, {"chunked_prefill_size": 24}])
def test_mixed_steps_under_memory_pressure_keep_the_outputs(cfg):
    """Small steps, many arrivals, a pool that forces retraction: outputs stay the reference's
    and the pool's accounting holds after every step."""
    sched = Scheduler(
        EngineConfig(max_prefill_step_ms=40, new_token_ratio=0.0, **cfg),
        RecordingRunner(512),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=512,
        step_cost=FixedCost(),
    )
    prompts = shared_prompts(groups=4, per=6, system=90, q=30)
    reqs = run(sched, prompts, 24, check_every_step=True)
    assert [r.output_ids for r in reqs] == [reference(p, 24) for p in prompts]
    assert sched.stats["mixed_steps"] > 0 and sched.stats["prefill_chunks"] > 0
    assert sched.stats["retractions"] > 0
