"""Engine API behaviour: sampling options, finishing rules, validation, stats."""

from __future__ import annotations

import pytest

from radixrt import GenerateOutput, SamplingParams

PROMPT = "def parse(text):\n    "


@pytest.fixture
def eng(tiny_llama, engine_factory):
    return engine_factory(tiny_llama)


def test_single_str_returns_list_and_fields(eng):
    outs = eng.generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    assert isinstance(outs, list) and len(outs) == 1
    out = outs[0]
    assert isinstance(out, GenerateOutput)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.prompt_tokens == len(eng.tokenizer.encode(PROMPT))
    assert out.text == eng.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_input_ids_and_per_prompt_params(eng):
    ids = [eng.tokenizer.encode("import os"), eng.tokenizer.encode("class A:")]
    outs = eng.generate(
        input_ids=ids,
        sampling_params=[
            SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
            SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
        ],
    )
    assert [len(o.token_ids) for o in outs] == [3, 6]


def test_same_seed_same_output_any_batch(eng):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = eng.generate(PROMPT, sp)[0].token_ids
    others = [SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)] * 3
    batch = eng.generate([PROMPT, "x = ", "for i in", "while"], [sp] + others)
    assert batch[0].token_ids == alone
    diff = eng.generate(
        PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
    )[0].token_ids
    assert diff != alone


def test_stop_token_ids_and_stop_strings(eng):
    base = eng.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[
        0
    ]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = eng.generate(
        PROMPT,
        SamplingParams(
            max_new_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]
        ),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        out = eng.generate(
            PROMPT, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
        )[0]
        assert out.finish_reason == "stop"
        assert stop not in out.text and text.startswith(out.text)


def test_eos_finishes_unless_ignored(eng):
    eos = eng.model_config.eos_token_ids[0]
    base = eng.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))[0]
    # Force EOS by making it a stop token id too: finish_reason "stop" at once.
    out = eng.generate(
        PROMPT, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[base.token_ids[0]])
    )[0]
    assert out.token_ids == base.token_ids[:1] and out.finish_reason == "stop"
    assert eos not in base.token_ids or base.finish_reason == "length"


def test_logprobs(eng):
    out = eng.generate(
        PROMPT, SamplingParams(max_new_tokens=4, temperature=0, logprobs=True, ignore_eos=True)
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    assert all(lp <= 0 for lp in out.logprobs)


def test_max_new_tokens_zero(eng):
    out = eng.generate(PROMPT, SamplingParams(max_new_tokens=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"enable_torch_compile": "yes"}, "enable_torch_compile"),
        ({"disable_radix_cache": 1}, "disable_radix_cache"),
        ({"page_size": 0}, "page_size"),
        ({"schedule_policy": "random"}, "schedule_policy"),
    ],
)
def test_invalid_engine_config(kwargs, field):
    from radixrt.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_bad_prompts_raise_before_kv(eng):
    before = eng.stats()
    with pytest.raises(ValueError, match="context"):
        eng.generate(input_ids=[[1] * eng.runner.max_context])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate(input_ids=[[1, eng.model_config.vocab_size + 5]])
    with pytest.raises(ValueError, match="empty"):
        eng.generate(input_ids=[[]])
    assert eng.stats()["free_slots"] == before["free_slots"]
    eng.check_memory()


def test_unknown_model_path(tmp_path):
    from radixrt import Engine

    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        Engine(model=str(tmp_path / "no-such-model"))


def test_stats_and_flush(eng):
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    eng.generate([PROMPT] * 3, sp)
    eng.generate(PROMPT, sp)
    s = eng.stats()
    for key in ("prompt_tokens", "cached_tokens", "prefill_tokens", "evicted_tokens", "hit_rate"):
        assert key in s
    assert s["cached_tokens"] > 0 and s["cache_tokens"] > 0
    # Forward time, split by kind: both ran (4 new tokens: a prefill, then decode steps).
    assert s["prefill_forward_s"] > 0 and s["decode_forward_s"] > 0
    assert s["prefill_forward_s"] + s["decode_forward_s"] == pytest.approx(s["forward_s"])
    eng.flush_cache()
    assert eng.stats()["cache_tokens"] == 0
    eng.check_memory()


def test_cache_salt_isolates_the_prefix_cache(eng):
    sp = {
        salt: SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, cache_salt=salt)
        for salt in ("tenant-a", "tenant-b")
    }
    n = len(eng.tokenizer.encode(PROMPT))
    first = eng.generate(PROMPT, sp["tenant-a"])[0]
    other = eng.generate(PROMPT, sp["tenant-b"])[0]
    unsalted = eng.generate(
        PROMPT, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    again = eng.generate(PROMPT, sp["tenant-a"])[0]
    assert first.cached_tokens == 0 and other.cached_tokens == 0 and unsalted.cached_tokens == 0
    assert again.cached_tokens == n - 1
    assert first.token_ids == other.token_ids == unsalted.token_ids == again.token_ids
    eng.check_memory()


def test_cache_salt_in_one_batch_shares_nothing(eng):
    prompt = PROMPT * 8  # long enough for the in-batch prefix dedup to apply
    outs = eng.generate(
        [prompt, prompt, prompt],
        [
            SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, cache_salt=salt)
            for salt in ("x", "y", "x")
        ],
    )
    assert outs[0].cached_tokens == outs[1].cached_tokens == 0
    assert outs[2].cached_tokens == outs[2].prompt_tokens - 1  # same salt as outs[0]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert eng.stats()["prefill_tokens"] == 2 * outs[0].prompt_tokens + 1


@pytest.mark.parametrize("salt", [5, "", "s" * 257])
def test_invalid_cache_salt(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
    assert SamplingParams(cache_salt="s" * 256).cache_salt == "s" * 256


def test_cache_salt_survives_the_wire():
    from radixrt.protocol import TokenizedRequest, decode, encode

    sp = SamplingParams(max_new_tokens=2, cache_salt="tenant-a")
    msg = decode(encode(TokenizedRequest(rid="r", input_ids=[1, 2], sampling_params=sp)))
    assert msg.sampling_params.cache_salt == "tenant-a"
    assert SamplingParams.from_dict(sp.to_dict()) == sp


# ------------------------------------------------------------ top logprobs

TOP5 = SamplingParams(
    max_new_tokens=4, temperature=0, logprobs=True, top_logprobs=5, ignore_eos=True
)
GREEDY4 = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
SCORED = [
    "You are a careful assistant. Answer the question about the standard library. " + q
    for q in (
        "What does os.path.join do?",
        "How is a dict ordered?",
        "What is a generator?",
        "Why use pathlib?",
        "What does zip return?",
        "Explain functools.partial.",
    )
]


def _assert_sorted_top(top, k: int) -> None:
    for ids, lps in top:
        assert len(ids) == len(lps) == k and len(set(ids)) == k
        assert all(a >= b for a, b in zip(lps, lps[1:])) and all(lp <= 0 for lp in lps)


def _score(eng, prompts: list[str], sp: SamplingParams, start: int = 2):
    reqs = [eng.add_request(eng.tokenizer.encode(p), sp, logprob_start_len=start) for p in prompts]
    while not all(r.finished for r in reqs):
        eng.step()
    return [eng.make_output(r) for r in reqs]


def test_top_logprobs_greedy_top1_is_the_chosen_token(eng):
    out = eng.generate(PROMPT, TOP5)[0]
    assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs) == 4
    _assert_sorted_top(out.top_logprobs, 5)
    for tok, lp, (ids, lps) in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert ids[0] == tok and lps[0] == pytest.approx(lp, abs=1e-5)
    assert out.prompt_top_logprobs is None
    plain = eng.generate(
        PROMPT, SamplingParams(max_new_tokens=4, temperature=0, logprobs=True, ignore_eos=True)
    )[0]
    assert plain.top_logprobs is None and plain.token_ids == out.token_ids


def test_prompt_top_logprobs_follow_prompt_logprobs(eng):
    [out] = _score(eng, [PROMPT], TOP5)
    ids = eng.tokenizer.encode(PROMPT)
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(ids) - 2
    _assert_sorted_top(out.prompt_top_logprobs, 5)
    for target, lp, (top_ids, top_lps) in zip(
        ids[2:], out.prompt_logprobs, out.prompt_top_logprobs
    ):
        assert top_lps[0] >= lp - 1e-5
        if target in top_ids:  # the scored token's own entry is the same number
            assert top_lps[top_ids.index(target)] == pytest.approx(lp, abs=1e-5)
    assert len(out.top_logprobs) == 4
    [plain] = _score(eng, [PROMPT], SamplingParams(max_new_tokens=1, logprobs=True))
    assert plain.prompt_top_logprobs is None and plain.top_logprobs is None
    assert plain.prompt_logprobs == pytest.approx(out.prompt_logprobs, abs=1e-5)


def test_top_logprobs_in_a_mixed_batch(eng):
    alone = eng.generate(PROMPT, TOP5)[0]
    sampled = SamplingParams(
        max_new_tokens=4, temperature=0.9, seed=3, logprobs=True, top_logprobs=2, ignore_eos=True
    )
    only_lp = SamplingParams(max_new_tokens=4, temperature=0, logprobs=True, ignore_eos=True)
    outs = eng.generate([PROMPT, "x = ", "for i in", "while"], [TOP5, only_lp, sampled, GREEDY4])
    assert outs[0].token_ids == alone.token_ids
    for (_, lps), (_, lps0) in zip(outs[0].top_logprobs, alone.top_logprobs):
        assert lps == pytest.approx(lps0, abs=1e-4)
    assert outs[1].top_logprobs is None and len(outs[1].logprobs) == 4
    _assert_sorted_top(outs[2].top_logprobs, 2)
    for lp, (_, lps) in zip(outs[2].logprobs, outs[2].top_logprobs):
        assert lp <= lps[0] + 1e-5
    assert outs[3].top_logprobs is None and outs[3].logprobs is None


@pytest.mark.parametrize(
    "cfg, stat",
    [
        ({"max_total_tokens": 160, "new_token_ratio": 0.0}, "retractions"),
        ({"chunked_prefill_size": 16}, "prefill_chunks"),
    ],
)
def test_prompt_top_logprobs_under_retraction_and_chunking(
    tiny_llama, engine_factory, eng, cfg, stat
):
    sp = SamplingParams(
        max_new_tokens=16, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
    )
    want = _score(eng, SCORED, sp, start=5)
    other = engine_factory(tiny_llama, **cfg)
    got = _score(other, SCORED, sp, start=5)
    assert other.stats()[stat] > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        n = g.prompt_tokens - 5  # every scored position exactly once
        assert len(g.prompt_logprobs) == len(g.prompt_top_logprobs) == n
        assert g.prompt_logprobs == pytest.approx(w.prompt_logprobs, abs=1e-4)
        for (_, lps), (_, want_lps) in zip(g.prompt_top_logprobs, w.prompt_top_logprobs):
            assert lps == pytest.approx(want_lps, abs=1e-4)
        assert len(g.top_logprobs) == len(g.logprobs) == 16


def test_top_logprobs_through_the_server_messages(eng):
    """The scheduler process's deltas, over the wire and through the Detokenizer, add up to
    the Engine's output."""
    from radixrt.output import Detokenizer, OutputTracker
    from radixrt.protocol import BatchTokenOut, decode, encode

    req = eng.add_request(eng.tokenizer.encode(PROMPT), TOP5, logprob_start_len=3)
    detok, outputs, deltas = Detokenizer(eng.tokenizer), OutputTracker(), []
    outputs.add(req)
    while not req.finished:
        eng.step()
        items = [d for _, d in outputs.collect()]
        if items:
            batch = decode(encode(BatchTokenOut(items=items)))
            deltas += decode(encode(detok.process(batch))).items
    assert len(outputs) == 0
    out = eng.make_output(req)
    assert [t for d in deltas for t in d.top_logprobs] == out.top_logprobs
    assert all(len(d.top_logprobs) == len(d.token_ids) for d in deltas)
    # the prompt's scores and the first token's time come with the first delta
    assert deltas[0].prompt_top_logprobs == out.prompt_top_logprobs
    assert deltas[0].prompt_logprobs == out.prompt_logprobs
    assert all(d.prompt_top_logprobs is None and d.prompt_logprobs is None for d in deltas[1:])
    assert deltas[0].first_token_at == req.first_token_at > 0
    assert all(d.first_token_at == 0.0 for d in deltas[1:])
