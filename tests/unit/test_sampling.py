"""Tests for radixrt.sampling: parameter validation and the batched sampler."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from radixrt.sampling import MAX_TOP_LOGPROBS, Sampler, SamplingParams, make_generator

V = 32


def _logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=make_generator(seed)) * 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", True),
        ("temperature", -1.0),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", 2.0),
        ("min_p", -0.1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 7),
        ("ignore_eos", 1),
        ("logprobs", "yes"),
        ("seed", 1.5),
        ("seed", 2**64),
        ("top_logprobs", -1),
        ("top_logprobs", MAX_TOP_LOGPROBS + 1),
        ("top_logprobs", 2.0),
        ("top_logprobs", True),
        ("top_logprobs", "3"),
        ("top_logprobs", None),
    ],
)
def test_validation_names_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} ") as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(
        ValueError, match=r"SamplingParams\.top_logprobs .*SamplingParams\.logprobs"
    ):
        SamplingParams(top_logprobs=3)
    assert (
        SamplingParams(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS).top_logprobs
        == MAX_TOP_LOGPROBS
    )
    assert SamplingParams(top_logprobs=0).top_logprobs == 0
    p = SamplingParams(logprobs=True, top_logprobs=4)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


def test_normalization_and_greedy():
    p = SamplingParams(stop="END", stop_token_ids=(2, 3), top_k=0, temperature=1, max_new_tokens=0)
    assert p.stop == ["END"] and p.stop_token_ids == [2, 3] and p.top_k == -1
    assert isinstance(p.temperature, float) and p.max_new_tokens == 0
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


def test_dict_and_msgspec_round_trip():
    p = SamplingParams(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        stop=["a", "bc"],
        stop_token_ids=[1],
        ignore_eos=True,
        seed=3,
        logprobs=True,
    )
    assert SamplingParams.from_dict(p.to_dict()) == p
    wire = msgspec.msgpack.encode(p)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == p
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"top_p": 2.0}), type=SamplingParams)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = _logits(6).to(dtype)
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 6, [None] * 6)
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None
    assert torch.equal(out.token_ids, logits.float().argmax(-1))


def test_top_k_1_and_mixed_batch_greedy_rows():
    logits = _logits(4)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(temperature=5.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=5.0),
    ]
    out = Sampler().sample(logits, params, [None] * 4).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws for one row, in one batch of n copies."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Sampler().sample(logits.expand(n, -1), [params] * n, [None] * n).token_ids


def test_tiny_top_p_keeps_only_top_token():
    logits = _logits(1)
    draws = _draw(logits, SamplingParams(temperature=2.0, top_p=1e-6), 500)
    assert (draws == logits.argmax()).all()


def test_min_p_near_one_keeps_only_max():
    logits = _logits(1)
    draws = _draw(logits, SamplingParams(temperature=2.0, min_p=0.999), 500)
    assert (draws == logits.argmax()).all()


def test_top_k_limits_support():
    logits = _logits(1)
    draws = _draw(logits, SamplingParams(top_k=3), 2000)
    assert set(draws.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_support_is_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = _draw(logits, SamplingParams(top_p=0.75), 2000)
    assert set(draws.tolist()) == {0, 1}  # 0.5 < 0.75 needs the 2nd, not the 3rd


def test_min_p_support():
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.3, 0.05]]))
    draws = _draw(logits, SamplingParams(min_p=0.35), 2000)
    assert set(draws.tolist()) == {1, 2}  # keeps p >= 0.175


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * draws.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_1_matches_softmax():
    logits = torch.randn(1, 8, generator=make_generator(1))
    draws = _draw(logits, SamplingParams(), 40_000)
    # chi-square with 7 dof: P(X > 24.3) ~ 0.001
    assert _chi_square(draws, logits[0].softmax(-1)) < 24.3


def test_filtered_distribution_is_renormalized():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    draws = _draw(logits, SamplingParams(temperature=0.5, top_k=4, top_p=0.9), 40_000)
    # T=0.5 then top-4: [.545, .307, .136, .012]; mass above token 2 is .852 < .9,
    # above token 3 is .988 >= .9, so the nucleus is tokens 0..2.
    kept = (logits[0, :3] / 0.5).softmax(-1)
    assert set(draws.tolist()) <= {0, 1, 2}
    assert _chi_square(draws, kept) < 13.8  # 2 dof, p ~ 0.001


@pytest.mark.parametrize(
    "seeded",
    [
        SamplingParams(temperature=1.3, top_p=0.9, seed=42),  # always on the sort path
        SamplingParams(temperature=1.3, seed=42),  # alone: no sort; in the batch: sorted
    ],
)
def test_seeded_rows_are_batch_invariant(seeded):
    logits = _logits(5, vocab=64, seed=2)
    sampler = Sampler()

    def run(batch: torch.Tensor, params: list[SamplingParams], row: int) -> list[int]:
        gens = [make_generator(42) if i == row else None for i in range(len(params))]
        toks = []
        for _ in range(20):
            toks.append(int(sampler.sample(batch, params, gens).token_ids[row]))
        return toks

    alone = run(logits[:1], [seeded], 0)
    assert alone == run(logits[:1], [seeded], 0)
    assert len(set(alone)) > 1  # really sampling
    others = [
        SamplingParams(top_k=3),
        SamplingParams(temperature=0),
        SamplingParams(min_p=0.2, temperature=2.0),
        SamplingParams(),
    ]
    batch = torch.cat([logits[1:3], logits[:1], logits[3:]])
    assert run(batch, others[:2] + [seeded] + others[2:], 2) == alone
    assert run(batch, [SamplingParams()] * 2 + [seeded] + [SamplingParams()] * 2, 2) == alone


def test_two_seeded_requests_do_not_interact():
    logits = _logits(2, seed=3)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    pair = Sampler().sample(logits, params, [make_generator(1), make_generator(2)]).token_ids
    first = Sampler().sample(logits[:1], params[:1], [make_generator(1)]).token_ids
    second = Sampler().sample(logits[1:], params[1:], [make_generator(2)]).token_ids
    assert pair.tolist() == first.tolist() + second.tolist()


def test_logprobs_are_model_log_softmax():
    logits = _logits(4).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, logprobs=True),
        SamplingParams(top_k=2),
        SamplingParams(temperature=3.0),
    ]
    out = Sampler().sample(logits, params, [None] * 4)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    expect = logits.float().log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expect)


def test_no_top_logprobs_unless_asked():
    out = Sampler().sample(_logits(3), [SamplingParams(logprobs=True)] * 3, [None] * 3)
    assert out.logprobs is not None and out.top_logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_logprobs_are_topk_of_model_log_softmax(dtype):
    logits = _logits(6, vocab=64, seed=3).to(dtype)
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.8, logprobs=True, top_logprobs=5, seed=1),
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(temperature=1.5, top_p=0.9, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.5),
        SamplingParams(top_k=1, logprobs=True, top_logprobs=5),
    ]
    gens = [make_generator(1) if p.seed is not None else None for p in params]
    out = Sampler().sample(logits, params, gens)
    logp = logits.float().log_softmax(-1)
    ids, lps = out.top_logprobs
    assert (
        ids.dtype == torch.int64 and lps.dtype == torch.float32 and ids.shape == lps.shape == (6, 5)
    )
    want_lps, want_ids = logp.topk(5, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lps, want_lps)
    assert torch.equal(lps, logp.gather(1, ids))  # the same log_softmax, bit for bit
    assert bool((lps[:, :-1] >= lps[:, 1:]).all())
    torch.testing.assert_close(out.logprobs, logp.gather(1, out.token_ids[:, None]).squeeze(1))
    greedy = [0, 2, 5]
    assert torch.equal(out.token_ids[greedy], logits.float().argmax(-1)[greedy])
    assert torch.equal(ids[greedy, 0], out.token_ids[greedy])
    assert torch.equal(lps[greedy, 0], out.logprobs[greedy])


def test_top_logprobs_at_most_the_vocabulary():
    logits = _logits(2, vocab=3)
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS)] * 2
    ids, lps = Sampler().sample(logits, params, [None] * 2).top_logprobs
    assert ids.shape == (2, 3)
    assert sorted(ids[0].tolist()) == [0, 1, 2]


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), [SamplingParams()], [None])
    with pytest.raises(ValueError):
        Sampler().sample(_logits(1), [SamplingParams()], [None, None])


def test_unseeded_rows_follow_the_samplers_seed():
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=1.0)] * 6

    def draws(sampler: Sampler, steps: int = 4) -> list[list[int]]:
        return [sampler.sample(logits, params).token_ids.tolist() for _ in range(steps)]

    first = draws(Sampler(seed=3))
    assert draws(Sampler(seed=3)) == first  # the same seed, the same sequence of draws
    assert draws(Sampler(seed=4)) != first
    assert len({tuple(d) for d in first}) > 1  # the generator advances between steps
    torch.manual_seed(7)
    unseeded = draws(Sampler())
    torch.manual_seed(7)
    assert draws(Sampler()) == unseeded  # seed None: the global RNG
