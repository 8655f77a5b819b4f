"""bench/agents.py without a server: the figures a run's turns give and the issue's checks."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ab(bench_module):
    return bench_module("agents")


def agent(ab, cached_of, bytes_of, valid=1):
    """Three turns: prompts of 100, 150, 200 tokens, 20 out each, two of them required."""
    turns = []
    for i, prompt in enumerate((100, 150, 200)):
        required = i < 2
        turns.append(
            ab.Turn(
                bytes_sent=bytes_of(i),
                prompt_tokens=prompt,
                cached_tokens=cached_of(i, prompt),
                output_tokens=20,
                ttft=0.1 * (i + 1),
                calls=1 if required else 0,
                valid=valid if required else 0,
                required=required,
            )
        )
    return ab.Agent(turns)


def test_a_kept_conversation_passes(ab):
    # each later turn: the previous 100+20 (then 150+20) cached, 30 new tokens computed
    cached = {0: 0, 1: 120, 2: 170}
    a = agent(ab, lambda i, p: cached[i], lambda i: 300)
    s = ab.summarize([a, a], 2.0)
    assert s["new_tokens_after_first"] == 2 * (30 + 30)
    assert s["prefill_over_new"] == pytest.approx(1.0)
    assert s["hit_rate"] == pytest.approx(1 - (100 + 30 + 30) / 450)
    assert s["valid_share"] == 1.0 and s["tool_calls"] == 4
    assert all(ab.checks({"chat": s, "responses": s}).values())


def test_a_resent_conversation_or_a_bad_call_fails(ab):
    a = agent(ab, lambda i, p: 0, lambda i: 300 * (i + 1), valid=0)
    s = ab.summarize([a], 1.0)
    assert s["prefill_over_new"] == pytest.approx((150 + 200) / 60)
    assert s["bytes_last_over_second"] == pytest.approx(1.5)
    assert not any(ab.checks({"responses": s}).values())


def test_tool_arguments_are_validated_against_their_schema(ab):
    assert ab.valid("read_file", '{"path": "a.py", "start": 1, "count": 5}')
    assert not ab.valid("read_file", '{"path": "a.py", "start": 0, "count": 5}')
    assert not ab.valid("read_file", '{"path": "a.py"')
    assert not ab.valid("nope", "{}")
