"""bench/prefill_profile.py: a part's time is its own (the parts inside it taken out), the
split covers the whole timed step, and the timers leave the model as they found it."""

from __future__ import annotations

import itertools
import sys
from argparse import Namespace

import pytest
import torch

from radixrt import Engine


@pytest.fixture(scope="module")
def profile(bench_module):
    yield bench_module("prefill_profile")
    del sys.modules["prefill_profile"]


def test_a_part_s_own_time_leaves_out_the_parts_inside_it(profile, monkeypatch) -> None:
    ticks = itertools.count()
    monkeypatch.setattr(profile, "clock", lambda: float(next(ticks)))
    timer = profile.PartTimer()
    timer.enter("qkv")  # 0
    timer.enter("rotary")  # 1
    timer.leave()  # 2: rotary 1
    timer.enter("rotary")  # 3
    timer.leave()  # 4: rotary 2
    timer.leave()  # 5: qkv 5 - 0 - 2
    assert dict(timer.own) == {"rotary": 2.0, "qkv": 3.0}


def test_linear_flops_count_every_layer_s_four_linears(profile) -> None:
    cfg = Namespace(
        hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, num_layers=3
    )
    per_token = 8 * 16 + 8 * 8 + 8 * 32 + 16 * 8  # qkv, o, gate_up, down: N·K
    assert profile.linear_flops(cfg, 5) == 2 * 5 * 3 * per_token


def test_the_split_covers_the_step_and_the_timers_go_away(profile, tiny_llama, monkeypatch) -> None:
    monkeypatch.setitem(profile.WORKLOADS, "small", [(0, 20), (8, 5)])
    args = Namespace(warmup=1, repeats=2)
    # Where the CPU has a decode chain, the timed runs go layer by layer (the chain's one C call
    # hides the parts), and the chain is back afterwards.
    with Engine(model=tiny_llama, dtype="bfloat16", max_total_tokens=512) as eng:
        runner = eng.runner
        chain = runner.decode_chain
        backend = runner.attn_backend
        rec = profile.profile_workload(runner, "small", args)
        assert rec["tokens"] == 25
        parts = rec["parts_s"]
        assert parts["qkv"] > 0 and parts["attention"] > 0 and parts["norms"] > 0
        assert set(parts) == {*profile.PARTS, "other"}
        assert "forward" not in vars(backend) and "init_forward_metadata" not in vars(backend)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())
        assert runner.decode_chain is chain
        batch = profile.make_batch(runner, profile.WORKLOADS["small"], seed=1)
        assert batch.seq_lens == [20, 13] and batch.extend_lens == [20, 5]
        assert torch.equal(batch.positions[20:], torch.arange(8, 13))
        rows = runner.pool.req_to_token
        assert torch.equal(batch.out_cache_loc[20:], rows[1, 8:13])
        assert runner.forward(batch).shape == (2, runner.model_cfg.vocab_size)
