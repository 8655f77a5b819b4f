"""Speculative decoding on the tiny model: a request's tokens, logprobs, top logprobs, finish
reason and text are those of decoding without speculation, bit for bit (``==`` on floats),
greedy and seeded-sampled, single and batched, with drafts right, partly right, wrong and
as trees (a proposer that knows the outputs, set on the scheduler), and with the own-tokens
proposer; stops inside an accepted run; requests with a JSON schema, regex or EBNF grammar
drafting within it; drafts from a prefix loaded back from the host tier; the settings
speculation refuses."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jsonschema
import pytest

from radixrt import Engine, SamplingParams
from radixrt.output import OutputTracker
from radixrt.scheduler.step_cost import StepCost
from radixrt.spec.draft import DraftTree
from radixrt.testing import output_bits

VOCAB = 2048
EOS = 2  # the tiny tokenizer's
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


class Oracle:
    """Drafts from known outputs (prompt -> output ids): ``right``, ``partly`` right (the
    third token off), ``forbidden`` (the third token the stop token, which a grammar refuses
    before its end), ``wrong``, or a ``tree`` whose first branch goes wrong after one token
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
        if self.mode in ("partly", "forbidden") and len(right) > 2:
            right[2] = bad[2] if self.mode == "partly" else EOS
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
        speculative_ngram_min_match_window_size=1,  # drafts from single-token matches too
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


ARITHMETIC = 'term ::= num | "(" num op num ")"\nop ::= "+" | "-"\nnum ::= [1-9] | [1-9] [0-9]\n'
GRAMMARS = [
    {"json_schema": {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 4}},
    {
        "json_schema": {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": DIGIT},
            "required": ["colour", "n"],
        }
    },
    {"regex": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"},
    {"regex": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"},
    {"ebnf": "root ::= term (op term){0,2}\n" + ARITHMETIC},
]
EBNF_TEXT = r"(\d+|\(\d+[-+]\d+\))([-+](\d+|\(\d+[-+]\d+\))){0,2}"


def valid(text: str, grammar: dict) -> bool:
    if "json_schema" in grammar:
        jsonschema.validate(json.loads(text), grammar["json_schema"])
        return True
    return re.fullmatch(grammar.get("regex", EBNF_TEXT), text) is not None


def constrained_params(temperature: float) -> list[SamplingParams]:
    """One request per grammar (seeded, when sampled), then an unconstrained one."""
    sps = [
        SamplingParams(
            max_new_tokens=48, temperature=temperature, seed=s, logprobs=True, top_logprobs=2
        )
        for s in range(len(GRAMMARS))
    ]
    sps = [dataclasses.replace(sp, **g) for sp, g in zip(sps, GRAMMARS)]
    return [*sps, SamplingParams(max_new_tokens=24, temperature=temperature, seed=9)]


@pytest.fixture(scope="module")
def constrained_outputs(engines) -> dict[float, list]:
    """Decoding's outputs of ``constrained_params`` (greedy, sampled) without speculation."""
    assert engines["plain"].tokenizer.eos_token_id == EOS
    ids = prompts(len(GRAMMARS) + 1, 7)
    return {
        t: engines["plain"].generate(input_ids=ids, sampling_params=constrained_params(t))
        for t in (0.0, 0.9)
    }


@pytest.mark.parametrize("mode", ["forbidden", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_requests_draft_within_their_grammar(
    engines, constrained_outputs, mode, temperature
):
    """Requests with a JSON schema, a regex or an EBNF grammar draft too, beside an
    unconstrained one: drafts from decoding's constrained outputs (with the stop token or a
    wrong token put in: cut where the grammar refuses it), each verification row masked as
    decoding masks that position. Greedy and seeded outputs equal decoding's bit for bit,
    valid, each ended by its grammar where decoding's was (the tree's right branch drafts
    the stop token that ends it)."""
    ids, want = prompts(len(GRAMMARS) + 1, 7), constrained_outputs[temperature]
    spec = engines["spec"]
    spec.scheduler.spec.proposer = Oracle({tuple(p): o.token_ids for p, o in zip(ids, want)}, mode)
    got = spec.generate(input_ids=ids, sampling_params=constrained_params(temperature))
    spec.check_memory()
    same(want, got)
    for o, grammar in zip(got, GRAMMARS):
        assert o.finish_reason == "stop" and valid(o.text, grammar), o.text
        assert o.spec_verify_ct > 0 and o.spec_accepted_tokens > 0
    assert spec.stats()["grammar_masked_rows"] > 0


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


def test_drafts_from_a_prefix_loaded_back_from_the_host_tier(engines, tiny_llama):
    """With the hierarchical cache: a first request's prompt and output go down to host memory
    and leave the device; a second request brings them back (a host hit), and a third, the
    first's prompt again, is drafted from the loaded tokens: every output the bits of decoding
    without speculation."""
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    one = SamplingParams(max_new_tokens=1, temperature=0, logprobs=True)
    rng = random.Random(8)
    prompt = [rng.randrange(10, VOCAB) for _ in range(41)]  # with the output: 64 computed
    plain = engines["plain"]
    (first,) = plain.generate(input_ids=[prompt], sampling_params=sp)
    back = prompt + first.token_ids + [7]
    (loaded,) = plain.generate(input_ids=[back], sampling_params=one)
    eng = Engine(
        model=tiny_llama,
        dtype="float32",
        max_total_tokens=8192,
        enable_hierarchical_cache=True,
        speculative_algorithm="NGRAM",
    )
    eng.scheduler.spec.cost = StepCost(0.0)
    same([first], eng.generate(input_ids=[prompt], sampling_params=sp))
    tree = eng.scheduler.kv.tree
    tree.evict(tree.evictable_size)  # off the device; written through to the host at finish
    assert tree.total_size() == 0
    same([loaded], eng.generate(input_ids=[back], sampling_params=one))
    assert eng.stats()["hicache_host_hit_tokens"] == 64  # four whole blocks
    (again,) = eng.generate(input_ids=[prompt], sampling_params=sp)
    same([first], [again])
    assert again.spec_accepted_tokens >= 16, (again.spec_verify_ct, again.spec_accepted_tokens)
    eng.check_memory()
    eng.shutdown()
