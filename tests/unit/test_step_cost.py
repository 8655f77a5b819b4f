"""The step cost model: its units, what a step budget buys, learning from steps, the probe."""

from __future__ import annotations

import math

import pytest

from radixrt.scheduler.step_cost import (
    ATTENTION_EFFICIENCY,
    SMALL_STEP_TOKENS,
    StepCost,
    attention_pairs,
)


def test_attention_pairs_count_causal_keys():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 3) == 11 + 12 + 13


@pytest.mark.parametrize("w", [0.0, 1e-3, 0.05])
@pytest.mark.parametrize("prefix", [0, 7, 500])
@pytest.mark.parametrize("left", [0.5, 1, 10, 300.5, 4096])
def test_prefill_tokens_is_the_most_that_fits(w, prefix, left):
    cost = StepCost(w, fixed=0.01, per_unit=1e-4)
    n = cost.prefill_tokens(left, prefix)
    assert cost.units(n, attention_pairs(prefix, n)) <= left
    assert cost.units(n + 1, attention_pairs(prefix, n + 1)) > left


def test_an_unknown_cost_gives_no_time_budget():
    cost = StepCost(1e-3)
    assert not cost.known and math.isinf(cost.budget_units(0.1))
    assert cost.prefill_tokens(cost.budget_units(0.1), 0) >= 1 << 40


def test_budget_units_leave_out_the_fixed_cost():
    cost = StepCost(0.0, fixed=0.02, per_unit=1e-3)
    assert cost.budget_units(0.1) == pytest.approx(80)
    assert cost.budget_units(0.01) == 0
    assert cost.predict(80, 0) == pytest.approx(0.1)


def test_steps_teach_the_fixed_cost_and_the_cost_per_token():
    """Steps of a machine with 5 ms fixed and 0.2 ms per unit: the estimates converge."""
    assert 8 <= SMALL_STEP_TOKENS < 100  # decode-sized steps below, prefill-sized above
    cost = StepCost(1e-3, fixed=0.05, per_unit=1e-3)
    for i in range(200):
        tokens = 1 + i % 8 if i % 2 else 100 + 37 * (i % 11)
        pairs = attention_pairs(300, tokens)
        cost.observe(0.005 + 2e-4 * cost.units(tokens, pairs), tokens, pairs)
    assert cost.fixed == pytest.approx(0.005, rel=1e-3)
    assert cost.per_unit == pytest.approx(2e-4, rel=1e-3)


def test_the_probe_seeds_both_costs_from_two_sizes():
    cost = StepCost(1e-3)
    sizes, forwards = [], []

    def timed(forward, n):
        forward(n)
        sizes.append(n)
        return 0.004 + 1e-4 * cost.units(n, attention_pairs(0, n))

    cost.probe(forwards.append, max_tokens=4096, timed=timed)
    assert forwards[0] == sizes[0] == 16 and max(sizes) > 16  # a first, untimed run
    assert cost.fixed == pytest.approx(0.004) and cost.per_unit == pytest.approx(1e-4)


def test_a_short_context_probes_one_size():
    cost = StepCost(0.0)
    cost.probe(lambda n: None, max_tokens=8, timed=lambda f, n: 0.008)
    assert cost.fixed == 0 and cost.per_unit == pytest.approx(1e-3)


def test_the_cost_of_a_model_weighs_attention_by_its_shape():
    class Cfg:  # the fields of a ModelConfig that for_model reads
        num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size = 8, 2, 64, 512, 1536

    w = StepCost.for_model(Cfg).attention_weight
    linear = 2 * (512 * (2 * 512 + 2 * 128) + 3 * 512 * 1536)
    assert w == pytest.approx(ATTENTION_EFFICIENCY * 4 * 512 / linear)


def test_small_steps_fit_a_line_of_their_own():
    """Decode steps of 1..8 rows cost more per unit than a prefill's: the small steps' line
    follows them, and a step slowed by another process counts only as an outlier."""
    cost = StepCost(1e-3, fixed=0.004, per_unit=1e-4)
    assert cost.unit_seconds_small() == 1e-4  # no line yet: per_unit stands in
    for _ in range(20):
        cost.observe(0.004 + 1e-3 * cost.units(1, 300), 1, attention_pairs(300, 1))
    assert cost.small.b is None  # all of one size: no slope yet
    for i in range(200):
        tokens = 1 + i % 8
        pairs = attention_pairs(300, tokens)
        seconds = 0.004 + 1e-3 * cost.units(tokens, pairs)
        cost.observe(seconds * (10 if i == 150 else 1), tokens, pairs)
    assert cost.unit_seconds_small() == pytest.approx(1e-3, rel=0.1)
    pairs = attention_pairs(300, 4)
    assert cost.predict_small(4, pairs) == pytest.approx(
        0.004 + 1e-3 * cost.units(4, pairs), rel=0.1
    )
    for _ in range(200):  # then only decode steps: the slope stays, the line follows them
        cost.observe(0.006 + 1e-3 * cost.units(1, 300), 1, attention_pairs(300, 1))
    assert cost.unit_seconds_small() == pytest.approx(1e-3, rel=0.1)
    assert cost.predict_small(1, 300) == pytest.approx(0.006 + 1e-3 * cost.units(1, 300), rel=0.02)


def test_a_small_step_with_a_prompt_teaches_the_cost_per_unit_not_the_decode_line():
    """A mixed step of a few prompt tokens beside decode rows is as small as a decode step but
    costs a prefill's units: it leaves the small steps' line and ``fixed`` as decode steps
    taught them."""
    cost = StepCost(1e-3, fixed=0.004, per_unit=5e-4)
    for i in range(50):
        tokens = 1 + i % 4
        pairs = attention_pairs(300, tokens)
        cost.observe(0.004 + 5e-4 * cost.units(tokens, pairs), tokens, pairs)
    line, fixed = (cost.small.a, cost.small.b), cost.fixed
    for _ in range(50):
        pairs = attention_pairs(300, 40)
        cost.observe(0.004 + 8e-4 * cost.units(40, pairs), 40, pairs, prompt=True)
    assert (cost.small.a, cost.small.b) == line and cost.fixed == fixed
    assert cost.per_unit == pytest.approx(8e-4, rel=1e-3)
