"""SGLang's ``/get_load`` body, built from a ``server_info`` answer without a server."""

from __future__ import annotations

from radixrt.server.http.app import worker_loads


def test_worker_loads_counts_held_and_waiting_tokens():
    info = {
        "kv_slots": 100,
        "free_slots": 50,
        "evictable_tokens": 20,
        "running": 2,
        "waiting": 3,
        "waiting_tokens": 7,
    }
    (load,) = worker_loads(info)
    assert load == {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 37}
    assert all(type(v) is int for v in load.values())


def test_worker_loads_one_entry_per_replica():
    base = {"kv_slots": 10, "free_slots": 10, "evictable_tokens": 0, "running": 0, "waiting": 0}
    info = {**base, "replicas": [{**base, "replica": 0}, {**base, "replica": 1, "waiting": 2}]}
    loads = worker_loads(info)
    assert [(x["dp_rank"], x["num_waiting_reqs"]) for x in loads] == [(0, 0), (1, 2)]
