"""Speculative decoding on the tiny model: a request's tokens, logprobs, top logprobs, finish
reason and text are those of decoding without speculation, bit for bit (``==`` on floats),
greedy and seeded-sampled, single and batched, with drafts right, partly right, wrong and
as trees (a proposer that knows the outputs, set on the scheduler), and with the own-tokens
proposer; stops inside an accepted run; the settings speculation refuses."""

from __future__ import annotations

import random

import pytest

from radixrt import Engine, SamplingParams
from radixrt.output import OutputTracker
from radixrt.scheduler.step_cost import StepCost
from radixrt.spec.draft import DraftTree
from radixrt.testing import output_bits

VOCAB = 2048


class Oracle:
    """Drafts from known outputs (prompt -> output ids): ``right``, ``partly`` right (the
    third token off), ``wrong``, or a ``tree`` whose first branch goes wrong after one token
    and whose second is right."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], mode: str, k: int = 6):
        self.outputs, self.mode, self.k = outputs, mode, k

    def propose(self, tokens, salt) -> DraftTree:
        for prompt, out in self.outputs.items():
            if tuple(tokens[: len(prompt)]) == prompt and len(tokens) > len(prompt):
                done = len(tokens) - len(prompt)
                right = list(out[done : done + self.k])
                return self._shape(right) if right else DraftTree()
        return DraftTree()

    def _shape(self, right: list[int]) -> DraftTree:
        bad = [(t + 1) % VOCAB for t in right]
        if self.mode == "partly" and len(right) > 2:
            right[2] = bad[2]
        if self.mode == "wrong":
            return DraftTree.chain(bad)
        if self.mode == "tree" and len(right) >= 3:
            return DraftTree([right[0], bad[1], right[1], right[2]], [-1, 0, 0, 2])
        return DraftTree.chain(right)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """A plain engine and a speculating one (float32), and a bf16 pair, checked at idle after
    the module."""
    made = {
        "plain": Engine(model=tiny_llama, dtype="float32", max_total_tokens=8192),
        "spec": Engine(
            model=tiny_llama, dtype="float32", max_total_tokens=8192, speculative_algorithm="NGRAM"
        ),
        "plain16": Engine(model=tiny_llama, dtype="bfloat16", max_total_tokens=8192),
        "spec16": Engine(
            model=tiny_llama,
            dtype="bfloat16",
            max_total_tokens=8192,
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=12,
        ),
    }
    assert all(e.runner.exactness.exact for e in made.values())
    for name in ("spec", "spec16"):  # every draft joins its step (tests/unit: the cost rule)
        made[name].scheduler.spec.cost = StepCost(0.0)
    made["ngram"] = made["spec"].scheduler.spec.proposer  # tests swap in an Oracle
    yield made
    for eng in made.values():
        if isinstance(eng, Engine):
            eng.check_memory()
            eng.shutdown()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(4, 60))] for _ in range(n)]


def both(engines, ids, sp, mode, pair=("plain", "spec"), k=6):
    """(plain outputs, speculative outputs) of ``ids``; drafts from the plain outputs."""
    plain, spec = engines[pair[0]], engines[pair[1]]
    want = plain.generate(input_ids=ids, sampling_params=sp)
    spec.scheduler.spec.proposer = Oracle(
        {tuple(p): o.token_ids for p, o in zip(ids, want)}, mode, k
    )
    got = spec.generate(input_ids=ids, sampling_params=sp)
    spec.check_memory()
    return want, got


def same(want, got) -> None:
    for w, g in zip(want, got, strict=True):
        assert output_bits(g) == output_bits(w)
        assert (g.finish_reason, g.text) == (w.finish_reason, w.text)


@pytest.mark.parametrize("mode", ["right", "partly", "wrong", "tree"])
def test_greedy_outputs_and_logprobs_are_decodings(engines, mode):
    sp = SamplingParams(max_new_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
    for ids in (prompts(1, 1), prompts(4)):
        want, got = both(engines, ids, sp, mode)
        same(want, got)
        assert all(o.spec_verify_ct > 0 for o in got)
        accepted = [o.spec_accepted_tokens for o in got]
        assert all(a == 0 for a in accepted) if mode == "wrong" else all(a > 0 for a in accepted)
        if mode == "right":
            assert all(o.spec_accepted_tokens == o.spec_draft_tokens for o in got)


@pytest.mark.parametrize("mode", ["right", "partly", "tree"])
def test_seeded_sampling_is_unchanged(engines, mode):
    sps = [
        SamplingParams(max_new_tokens=30, temperature=t, top_p=p, seed=s, logprobs=True)
        for s, (t, p) in enumerate([(0.7, 1.0), (1.0, 0.9), (1.3, 0.8), (0.9, 1.0)])
    ]
    ids = prompts(4, 2)
    plain, spec = engines["plain"], engines["spec"]
    want = plain.generate(input_ids=ids, sampling_params=sps)
    spec.scheduler.spec.proposer = Oracle({tuple(p): o.token_ids for p, o in zip(ids, want)}, mode)
    got = spec.generate(input_ids=ids, sampling_params=sps)
    same(want, got)
    assert all(o.spec_accepted_tokens > 0 for o in got)


def test_bf16(engines):
    sp = SamplingParams(max_new_tokens=40, temperature=0, logprobs=True, top_logprobs=2)
    for mode in ("right", "tree"):
        want, got = both(engines, prompts(4, 3), sp, mode, ("plain16", "spec16"), k=12)
        same(want, got)
        assert all(o.spec_accepted_tokens > 0 for o in got)


def test_the_own_tokens_proposer_with_arrivals_and_chunks(engines, tiny_llama):
    """Repetitive prompts, drafted from their own tokens, arriving while others decode (their
    drafts ride in prefill steps), with chunked prompts: each as it decodes alone."""
    rng = random.Random(4)
    ids = [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(2, 9))] * 6 for _ in range(4)]
    sp = SamplingParams(max_new_tokens=24, temperature=0, logprobs=True)
    want = engines["plain"].generate(input_ids=ids, sampling_params=sp)
    eng = Engine(
        model=tiny_llama,
        dtype="float32",
        max_total_tokens=8192,
        speculative_algorithm="NGRAM",
        chunked_prefill_size=16,
    )
    eng.scheduler.spec.cost = StepCost(0.0)
    reqs = []
    for p in ids:
        reqs.append(eng.add_request(p, sp))
        for _ in range(2):
            eng.step()
    while not all(r.finished for r in reqs):
        eng.step()
    same(want, [eng.make_output(r) for r in reqs])
    assert eng.stats()["spec_verify_ct"] > 0
    eng.check_memory()
    eng.shutdown()


def test_stops_inside_an_accepted_run(engines):
    plain = engines["plain"]
    ids = prompts(1, 5)
    out = plain.generate(
        input_ids=ids, sampling_params=SamplingParams(max_new_tokens=30, temperature=0)
    )[0]
    at = next(i for i in range(6, 20) if out.token_ids[i] not in out.token_ids[:i])
    stop_text = plain.tokenizer.decode(out.token_ids[at : at + 2])
    cases = [
        SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[out.token_ids[at]]),
        SamplingParams(max_new_tokens=at + 1, temperature=0, logprobs=True),
        SamplingParams(max_new_tokens=30, temperature=0, stop=stop_text),
        SamplingParams(max_new_tokens=30, temperature=0, stop=[stop_text, "zzzz"], logprobs=True),
    ]
    for sp in cases:
        want, got = both(engines, ids, sp, "right", k=12)
        same(want, got)
        assert len(got[0].token_ids) <= at + 2 and got[0].spec_accepted_tokens > 0


def test_constrained_requests_decode_beside_drafted_ones(engines):
    """A request with a grammar does not draft; it decodes in the verification steps of the
    others, as it would alone."""
    ids = prompts(3, 7)
    sps = [
        SamplingParams(max_new_tokens=16, temperature=0, regex="[a-z]+( [a-z]+)*"),
        SamplingParams(max_new_tokens=16, temperature=0),
        SamplingParams(max_new_tokens=16, temperature=0),
    ]
    want = engines["plain"].generate(input_ids=ids, sampling_params=sps)
    spec = engines["spec"]
    spec.scheduler.spec.proposer = Oracle(
        {tuple(p): o.token_ids for p, o in zip(ids, want)}, "right"
    )
    got = spec.generate(input_ids=ids, sampling_params=sps)
    same(want, got)
    assert [o.spec_verify_ct > 0 for o in got] == [False, True, True]


def test_outputs_and_deltas_carry_the_counters(engines):
    spec = engines["spec"]
    sp = SamplingParams(max_new_tokens=20, temperature=0)
    ids = prompts(1, 6)[0]
    want = engines["plain"].generate(input_ids=[ids], sampling_params=sp)[0]
    spec.scheduler.spec.proposer = Oracle({tuple(ids): want.token_ids}, "right", 4)
    req = spec.add_request(ids, sp)
    tracker = OutputTracker()
    tracker.add(req)
    deltas = []
    while not req.finished:
        spec.step()
        deltas += [d for _, d in tracker.collect()]
    out = spec.make_output(req)
    assert out.token_ids == want.token_ids
    assert max(len(d.token_ids) for d in deltas) == 5  # several tokens in one delta
    last = deltas[-1]
    assert (last.spec_verify_ct, last.spec_draft_tokens, last.spec_accepted_tokens) == (
        out.spec_verify_ct,
        out.spec_draft_tokens,
        out.spec_accepted_tokens,
    )
    assert out.spec_accepted_tokens == out.spec_draft_tokens > 0
    assert engines["plain"].generate(input_ids=[ids], sampling_params=sp)[0].spec_verify_ct == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm 'EAGLE' is not implemented"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0}, "in \\[1, 64\\]"),
        ({"speculative_algorithm": "NGRAM", "page_size": 16}, "needs page_size 1"),
        ({"speculative_num_draft_tokens": 3}, "needs speculative_algorithm"),
    ],
)
def test_bad_settings_are_refused_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(model="/nonexistent", **kwargs)


def test_a_sliding_window_pool_is_refused_by_name():
    from radixrt.testing import tiny_model_path

    path = tiny_model_path("mistral")
    with pytest.raises(ValueError, match="sliding-window layers' KV pool"):
        Engine(model=path, dtype="float32", max_total_tokens=512, speculative_algorithm="NGRAM")
    eng = Engine(
        model=path,
        dtype="float32",
        max_total_tokens=512,
        speculative_algorithm="NGRAM",
        disable_hybrid_swa_memory=True,
    )
    sp = SamplingParams(max_new_tokens=8, temperature=0)
    assert len(eng.generate(input_ids=[[5, 6, 7] * 4], sampling_params=sp)[0].token_ids) == 8
    eng.check_memory()
    eng.shutdown()


def test_a_second_user_is_drafted_from_the_first_users_cached_output(engines):
    """The radix tree feeds drafts across requests: once a first request's prompt and output
    are cached, the same prompt's continuation is drafted from them and accepted, with the
    bits of decoding."""
    plain, spec = engines["plain"], engines["spec"]
    spec.scheduler.spec.proposer = engines["ngram"]
    ids = prompts(3, seed=7)
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    want = plain.generate(input_ids=ids, sampling_params=sp)
    same(want, spec.generate(input_ids=ids, sampling_params=sp))
    second = spec.generate(input_ids=ids, sampling_params=sp)
    same(want, second)
    assert all(o.spec_accepted_tokens >= 16 for o in second), [
        (o.spec_verify_ct, o.spec_accepted_tokens) for o in second
    ]
    spec.check_memory()
