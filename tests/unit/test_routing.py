"""The front's routing between data-parallel replicas, without processes: mirrors fed with KV
event batches, loads booked by the router itself."""

from __future__ import annotations

import dataclasses

import pytest

from radixrt.config import ServerConfig
from radixrt.protocol import KVEventBatch, KVStored
from radixrt.server.controls import Gather, combine, split_id, sub_id
from radixrt.server.routing import Replica, Router


def make_router(n: int = 2, **server) -> Router:
    config = ServerConfig(dp_size=n, **server)
    replicas = [Replica(i, sock=None) for i in range(n)]
    for r in replicas:
        r.up = True
    return Router(config, replicas)


def cache(replica: Replica, tokens: list[int], seq: int = 1) -> None:
    """The replica's tree gains ``tokens`` under its root (as its events say)."""
    event = KVStored(node=seq, parent=0, token_ids=tokens)
    assert not replica.mirror.on_batch(KVEventBatch(replica=replica.index, seq=seq, events=[event]))


def test_round_robin_and_shortest_queue():
    rr = make_router(3, load_balance_method="round_robin")
    assert [rr.choose([1, 2], None, None).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    sq = make_router(2, load_balance_method="shortest_queue")
    first = sq.choose([1] * 100, None, None)
    sq.routed("a", first, [1] * 100, None)
    assert sq.choose([2] * 10, None, None).index != first.index
    sq.started("a")  # its prefill is done: the load is gone
    assert first.waiting_tokens == 0 and first.in_flight == 1
    assert sq.finished("a") is first and first.in_flight == 0


def test_cache_aware_follows_the_mirrors_then_the_load():
    router = make_router(2)
    a, b = router.replicas
    prefix = list(range(100, 200))
    cache(b, prefix)
    assert router.choose(prefix + [7, 8], None, None) is b  # the longest cached prefix
    assert router.choose(prefix + [7], "tenant", None) is a  # another namespace: no hit
    assert router.choose(prefix[:10] + [0] * 90, None, None) is a  # below cache_threshold
    router.routed("big", b, [5] * 10_000, None)  # b is now far behind: out of balance
    assert router.choose(prefix + [7, 8], None, None) is a


def test_pending_requests_count_as_cached():
    router = make_router(2)
    prompt = list(range(1000, 1300))
    first = router.choose(prompt + [1], None, None)
    router.routed("r1", first, prompt + [1], None)
    assert first.waiting_tokens == 301
    # before any event: the second request of the group follows the first
    assert router.choose(prompt + [2], None, None) is first
    router.routed("r2", first, prompt + [2], None)
    assert first.waiting_tokens == 301 + 1  # only its own question is left to prefill
    router.finished("r1")
    router.finished("r2")
    assert first.pending == {} and first.waiting_tokens == 0


def test_routing_keys_pin_and_a_replica_going_down():
    router = make_router(2, load_balance_method="round_robin")
    pinned = router.choose([1], None, "k")
    router.routed("r", pinned, [1], None)
    assert all(router.choose([9], None, "k") is pinned for _ in range(4))
    assert router.down(pinned.index) == ["r"]
    assert not pinned.up and "k" not in router.pins
    assert router.choose([1], None, "k") is not pinned
    assert router.up == [r for r in router.replicas if r is not pinned]


def test_gather_combines_replicas_and_survives_one_going_down():
    from radixrt.protocol import ControlReply, ErrorReply

    got = []
    g = Gather("server_info", {0, 1}, got.append)
    assert split_id(sub_id("q7", 1)) == ("q7", 1)
    one = {"replica": 0, "kv_slots": 10, "prompt_tokens": 4, "cached_tokens": 1, "model": "m"}
    assert not g.reply(0, ControlReply(req_id="q7/0", data=one))
    assert g.drop(1)  # replica 1 went down: answered with what came
    assert got[0]["kv_slots"] == 10 and got[0]["replicas"] == [one]
    both = combine({1: {**one, "replica": 1, "cached_tokens": 3}, 0: one})
    assert both["kv_slots"] == 20 and both["hit_rate"] == 0.5 and both["model"] == "m"
    assert [r["replica"] for r in both["replicas"]] == [0, 1]
    errs = []
    g = Gather("flush_cache", {0, 1}, errs.append)
    g.reply(1, ErrorReply(req_id="x/1", code="busy", message="flush_cache needs an idle server"))
    assert g.reply(0, ControlReply(req_id="x/0", data={"ok": True}))
    assert errs[0].code == "busy"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_threads_per_replica_default_divides_the_cpus(n):
    import os

    config = ServerConfig(dp_size=n)
    assert config.replica_threads == max(1, len(os.sched_getaffinity(0)) // n)
    assert dataclasses.replace(config, threads_per_replica=3).replica_threads == 3
