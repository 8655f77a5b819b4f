"""Data-parallel replicas behind one front: routing, KV events, a replica that dies."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest
import zmq
from server_harness import Server, assert_idle_kv, free_port, wait_idle

from radixrt.cache.mirror import ReplicaMirror
from radixrt.client import Client, ServerError
from radixrt.protocol import ErrorCode, KVEventBatch, decode
from radixrt.sampling import SamplingParams
from radixrt.testing import tiny_model_path

GREEDY = {"temperature": 0.0, "max_new_tokens": 4}
GROUPS, ROUNDS, PREFIX, SUFFIX = 5, 4, 96, 8  # an odd group count: round_robin cannot align


def shared_prefix_rounds(vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """ROUNDS rounds of GROUPS prompts: in each round, one new question per group after the
    group's own long prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(PREFIX)] for _ in range(GROUPS)]
    return [
        [p + [rng.randrange(vocab) for _ in range(SUFFIX)] for p in prefixes] for _ in range(ROUNDS)
    ]


def hit_rate(outs) -> float:
    return sum(o.cached_tokens for o in outs) / sum(o.prompt_tokens for o in outs)


def run_rounds(server: Server, rounds) -> tuple[list, float]:
    """Each round's prompts sent at once; (outputs, the fleet's hit rate)."""
    outs = []
    with Client(server.address, timeout=120) as c:
        c.flush_cache()
        for prompts in rounds:
            outs += c.generate_batch(input_ids=prompts, sampling_params=GREEDY)
        assert_idle_kv(c)
    return outs, hit_rate(outs)


def start_servers(*argvs: tuple[str, ...]) -> list[Server]:
    """Servers started side by side (each a `radixrt launch` subprocess)."""
    out: list = [None] * len(argvs)

    def start(i: int) -> None:
        out[i] = Server(*argvs[i])

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(argvs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def events_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def fleets(events_endpoint):
    """Two replicas routed cache_aware (publishing their KV events outside too) and two routed
    round_robin, one thread each."""
    aware, robin = start_servers(
        ("--dp-size", "2", "--kv-events-endpoint", events_endpoint),
        ("--dp-size", "2", "--load-balance-method", "round_robin"),
    )
    yield {"cache_aware": aware, "round_robin": robin}
    aware.stop()
    robin.stop()


def test_two_replicas_route_from_the_trees(fleets, engine_factory):
    import torch

    eng = engine_factory(tiny_model_path("llama"))  # one replica, in this process
    rounds = shared_prefix_rounds(eng.model_config.vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica
    try:
        single = [
            o
            for prompts in rounds
            for o in eng.generate(
                input_ids=prompts, sampling_params=[SamplingParams(**GREEDY)] * len(prompts)
            )
        ]
    finally:
        torch.set_num_threads(threads)
    hit_single = hit_rate(single)
    aware, hit_aware = run_rounds(fleets["cache_aware"], rounds)
    robin, hit_robin = run_rounds(fleets["round_robin"], rounds)
    print(
        f"hit rate: one replica {hit_single:.3f}, cache_aware {hit_aware:.3f}, "
        f"round_robin {hit_robin:.3f}"
    )
    assert [o.token_ids for o in aware] == [o.token_ids for o in single]
    assert [o.token_ids for o in robin] == [o.token_ids for o in single]
    assert hit_aware >= 0.95 * hit_single
    assert hit_robin < 0.9 * hit_single
    with Client(fleets["cache_aware"].address) as c:
        info = c.server_info()
    assert info["dp_size"] == 2 and len(info["replicas"]) == 2
    assert all(r["requests"] > 0 for r in info["replicas"])  # both replicas served groups
    assert info["requests"] == sum(r["requests"] for r in info["replicas"])


def test_replicas_give_the_bits_of_one_server(fleets):
    """Exact outputs: tokens, logprobs and top logprobs from two replicas (routed cache_aware
    and round_robin, so each sees other batches and cache hits) are the same bits as from one
    --dp-size 1 server."""
    from radixrt.testing import output_bits

    rounds = shared_prefix_rounds(2048, seed=1)
    params = {"temperature": 0.0, "max_new_tokens": 6, "logprobs": True, "top_logprobs": 2}

    def bits(server: Server) -> list:
        with Client(server.address, timeout=120) as c:
            assert c.server_info()["exact_outputs"] is True
            c.flush_cache()
            return [
                output_bits(o)
                for prompts in rounds
                for o in c.generate_batch(input_ids=prompts, sampling_params=params)
            ]

    (single,) = start_servers(())
    try:
        want = bits(single)
    finally:
        single.stop()
    assert "radixrt: outputs: exact" in single.proc.stderr.read()  # the launch log says so
    assert bits(fleets["cache_aware"]) == want
    assert bits(fleets["round_robin"]) == want


def test_routing_key_pins_requests_to_one_replica(fleets):
    srv = fleets["round_robin"]
    with Client(srv.address, timeout=60) as c:
        vocab = c.info["vocab_size"]
        prompt = [random.Random(7).randrange(vocab) for _ in range(64)]
        outs = [
            c.generate(input_ids=prompt, sampling_params=GREEDY, routing_key="pin")
            for _ in range(4)
        ]
        assert [o.cached_tokens for o in outs[1:]] == [63] * 3  # round robin alone would miss
        before = [r["requests"] for r in c.server_info()["replicas"]]
        c.score(prompt, [[1, 2], [3]])
        after = [r["requests"] for r in c.server_info()["replicas"]]
        assert sorted(a - b for a, b in zip(after, before)) == [0, 3]  # prefix + 2 on one


def test_metrics_and_server_info_per_replica(fleets):
    srv = fleets["cache_aware"]
    text = httpx.get(srv.http + "/metrics").text
    assert 'radixrt:num_running_reqs{replica="1"}' in text
    assert 'radixrt:replica_up{replica="0"} 1.0' in text
    assert 'radixrt:routed_requests_total{replica="1"}' in text
    info = httpx.get(srv.http + "/get_server_info").json()
    assert [s["replica"] for s in info["internal_states"]] == [0, 1]
    assert httpx.get(srv.http + "/health").status_code == 200


def test_outside_subscriber_mirrors_every_replica(fleets, events_endpoint):
    srv, endpoint = fleets["cache_aware"], events_endpoint
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        with Client(srv.address, timeout=60) as c:
            rounds = shared_prefix_rounds(c.info["vocab_size"], seed=3)
            for prompts in rounds:
                c.generate_batch(input_ids=prompts, sampling_params=GREEDY)
            wait_idle(c)
            mirrors = [ReplicaMirror(0), ReplicaMirror(1)]
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and sub.poll(500):
                batch = decode(sub.recv())
                assert isinstance(batch, KVEventBatch)
                if mirrors[batch.replica].on_batch(batch):
                    mirrors[batch.replica].on_snapshot(c.kv_snapshot(batch.replica))
            for i, mirror in enumerate(mirrors):
                snap = ReplicaMirror(i)
                snap.on_snapshot(c.kv_snapshot(i))
                assert mirror.tree.cached_sequences() == snap.tree.cached_sequences()
                assert mirror.seq == snap.seq
            assert sum(m.tree.num_tokens for m in mirrors) > 0
            with pytest.raises(ServerError) as e:
                c.kv_snapshot(5)
            assert e.value.code == ErrorCode.INVALID_REQUEST
    finally:
        sub.close(0)
        ctx.term()


def load(address: str, n: int, results: list) -> None:
    """n concurrent requests; each result or ServerError goes into results."""
    with Client(address, timeout=120) as c:

        def one(i: int) -> None:
            try:
                results.append(
                    c.generate(
                        f"request {i} keeps the replicas busy",
                        {"temperature": 0.0, "max_new_tokens": 300, "ignore_eos": True},
                    )
                )
            except ServerError as e:
                results.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def kill_replica_under_load(srv: Server, c: Client) -> int:
    """SIGKILL replica 1 while 12 requests run on both; check every request was answered, the
    ones on replica 1 with replica_failed; its old pid."""
    victim = c.server_info()["pids"]["scheduler_1"]
    results: list = []
    loader = threading.Thread(target=load, args=(srv.address, 12, results))
    loader.start()
    wait_for(lambda: c.server_info()["replicas"][1]["running"] > 0)
    os.kill(victim, signal.SIGKILL)
    loader.join(120)
    assert len(results) == 12  # every request answered
    failed = [r for r in results if isinstance(r, ServerError)]
    assert failed and all(e.code == ErrorCode.REPLICA_FAILED for e in failed), failed
    assert len(failed) < 12  # the other replica's requests finished
    assert srv.proc.poll() is None  # the server serves on
    outs = c.generate_batch(["after the failure"] * 4, {"max_new_tokens": 4})
    assert all(o.finish_reason == "length" for o in outs)
    return victim


def test_a_restarted_replica_rejoins():
    srv = Server("--dp-size", "2", "--load-balance-method", "round_robin", "--dp-restart")
    try:
        with Client(srv.address, timeout=60) as c:
            victim = kill_replica_under_load(srv, c)
            wait_for(lambda: c.server_info()["replicas_up"] == [0, 1])
            assert c.server_info()["pids"]["scheduler_1"] != victim
            assert httpx.get(srv.http + "/health").content == b""
            outs = c.generate_batch(["back again"] * 4, {"max_new_tokens": 4})
            assert all(o.finish_reason == "length" for o in outs)
            info = assert_idle_kv(c)
            assert [r["requests"] > 0 for r in info["replicas"]] == [True, True]
    finally:
        srv.stop()
    assert "restarting it" in srv.proc.stderr.read()


def test_the_others_serve_on_without_a_dead_replica(fleets):
    """The module's last test: it takes a replica of the round_robin fleet down for good."""
    srv = fleets["round_robin"]
    with Client(srv.address, timeout=60) as c:
        kill_replica_under_load(srv, c)
        health = httpx.get(srv.http + "/health")
        assert health.status_code == 200 and health.json()["replicas_down"] == [1]
        assert c.server_info()["replicas_up"] == [0]
        info = assert_idle_kv(c)  # on the survivor
        assert [r["replica"] for r in info["replicas"]] == [0]
    srv.stop()
    assert "serving on 1 of 2 replicas" in srv.proc.stderr.read()


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_bad_dp_settings_are_refused():
    from radixrt.config import ServerConfig

    for kwargs, word in (
        ({"dp_size": 0}, "dp_size"),
        ({"load_balance_method": "random"}, "load_balance_method"),
        ({"cache_threshold": 2.0}, "cache_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"threads_per_replica": 0}, "threads_per_replica"),
    ):
        with pytest.raises(ValueError, match=word):
            ServerConfig(**kwargs)
