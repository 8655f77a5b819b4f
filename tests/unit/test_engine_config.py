"""How settings reach an engine: ``Engine(config, **overrides)`` and the frozen arguments the
launcher hands each server process (``radixrt.server.spawn_args``)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from radixrt import Engine, EngineConfig, SamplingParams
from radixrt.config import ServerConfig, engine_config
from radixrt.server.spawn_args import (
    Addresses,
    DetokenizerArgs,
    FrontArgs,
    SchedulerArgs,
)


def test_engine_takes_a_config_and_overrides_only():
    """Defaults live in EngineConfig alone: Engine's signature repeats none of its fields."""
    params = list(inspect.signature(Engine.__init__).parameters)
    assert params == ["self", "config", "overrides"]


def test_unknown_override_is_refused_before_anything_loads(tmp_path):
    missing = str(tmp_path / "no-such-model")  # would raise FileNotFoundError once loading began
    with pytest.raises(TypeError, match="max_total_token'"):
        Engine(model=missing, max_total_token=256)
    with pytest.raises(TypeError, match=r"\['bogus', 'colour'\]"):
        Engine(EngineConfig(model=missing), colour="red", bogus=1)


def test_a_positional_model_path_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="model="):
        Engine("/some/model/folder")


def test_an_invalid_override_names_the_field():
    with pytest.raises(ValueError, match="dtype"):
        engine_config(EngineConfig(), dtype="float64")


def test_overrides_replace_fields_of_the_given_config():
    base = EngineConfig(dtype="float32", page_size=4)
    cfg = engine_config(base, max_total_tokens=512)
    assert cfg == dataclasses.replace(base, max_total_tokens=512)
    assert base.max_total_tokens is None  # the given config is not changed
    assert engine_config() == EngineConfig()
    assert engine_config(base) == base


def test_engine_runs_from_a_config_with_overrides(tiny_llama):
    cfg = EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=256)
    with Engine(cfg, max_total_tokens=512) as eng:
        assert eng.config == dataclasses.replace(cfg, max_total_tokens=512)
        assert eng.stats()["free_slots"] == 512  # the pool the override asked for
        out = eng.generate("hello there", SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
        assert len(out.token_ids) == 2


# ------------------------------------------------------------- spawn args


def addrs(replicas: int = 2, kv_events: bool = True) -> Addresses:
    return Addresses.in_folder("/tmp/x", replicas, kv_events)


def test_addresses_name_one_socket_per_replica():
    a = addrs(3)
    assert len(a.schedulers) == len(a.kv_events) == 3 == len(set(a.schedulers))
    assert addrs(2, kv_events=False).kv_events == ()
    with pytest.raises(ValueError, match="KV event"):
        Addresses("ipc://r", "ipc://d", "ipc://f", ("ipc://s0", "ipc://s1"), ("ipc://e0",))


def test_scheduler_args_survive_spawn_as_typed_objects():
    engine = EngineConfig(model="/m", dtype="float32", max_total_tokens=1024)
    args = SchedulerArgs(
        parent_pid=1,
        addrs=addrs(),
        server=ServerConfig(dp_size=2),
        engine=engine,
        replica=1,
        threads=2,
        cpus=(2, 3),
    )
    back = pickle.loads(pickle.dumps(args))  # what the spawn start method does
    assert back == args and isinstance(back.engine, EngineConfig)
    assert back.scheduler_addr == args.addrs.schedulers[1]
    assert back.kv_events_addr == args.addrs.kv_events[1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.replica = 0


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"replica": 2}, "replica 2"),
        ({"threads": 0}, "threads"),
        ({"cpus": ()}, "cpus"),
        ({"parent_pid": 0}, "parent_pid"),
    ],
)
def test_scheduler_args_are_checked(bad, match):
    fields = dict(parent_pid=1, addrs=addrs(), server=ServerConfig(), engine=EngineConfig())
    with pytest.raises(ValueError, match=match):
        SchedulerArgs(**{**fields, **bad})


def test_front_and_detokenizer_args():
    common = dict(parent_pid=1, addrs=addrs(1, kv_events=False), server=ServerConfig())
    front = FrontArgs(**common, model_path="/m", pids={"scheduler": 7})
    assert pickle.loads(pickle.dumps(front)).pids == {"scheduler": 7}
    assert DetokenizerArgs(**common, model_path="/m").addrs.kv_events == ()
    with pytest.raises(ValueError, match="model_path"):
        DetokenizerArgs(**common, model_path="")


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5, True, "half"])
def test_the_swa_pool_ratio_is_checked(ratio):
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        EngineConfig(swa_full_tokens_ratio=ratio)
