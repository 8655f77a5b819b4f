"""Two `radixrt launch` servers behind a real `sglang-router` process (its ``cache_aware``
policy) on loopback: requests of every API complete through it, groups of requests that share
a long prefix stick to one worker (read from each worker's own counters and ``cached_tokens``),
and ``/get_load`` has the shape the router parses."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import Server, assert_idle_kv, free_port, start_sglang_router, stop_process

from radixrt.client import Client

pytest.importorskip("sglang_router", reason="sglang-router (the test extra) is not installed")

GROUPS, PER_GROUP = 4, 4


@pytest.fixture(scope="module")
def servers():
    srvs = []
    try:
        srvs.extend(Server() for _ in range(2))
        yield srvs
    finally:
        for srv in srvs:
            srv.stop()


@pytest.fixture(scope="module")
def router(servers):
    """The router's base URL; the router process is killed at teardown."""
    port = free_port()
    proc = start_sglang_router([s.http for s in servers], "cache_aware", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture
def http(router):
    with httpx.Client(base_url=router, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_kv_after(servers):
    """After every test: both servers run and hold the idle KV invariant."""
    yield
    for srv in servers:
        assert srv.proc.poll() is None
        with Client(srv.address, timeout=60) as c:
            assert_idle_kv(c)


def sse_data(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def scheduler_state(srv: Server) -> dict:
    info = httpx.get(f"{srv.http}/get_server_info", timeout=30).json()
    return info["internal_states"][0]


def test_requests_complete_through_router(http):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}
    out = http.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(out["output_ids"]) == 4 and out["text"]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        chunks = sse_data(resp)
    assert chunks[-1]["meta_info"]["completion_tokens"] == 4
    assert len(chunks[-1]["output_ids"]) == 4

    model = http.get("/v1/models").json()["data"][0]["id"]  # the router wants a model
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {"model": model, "messages": messages, "max_tokens": 3}
    done = http.post("/v1/chat/completions", json=chat).json()
    assert done["choices"][0]["finish_reason"] == "length", done
    assert done["usage"]["completion_tokens"] == 3
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as resp:
        deltas = sse_data(resp)
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"

    comp = {"model": model, "prompt": "Once upon a time", "max_tokens": 3}
    done = http.post("/v1/completions", json=comp).json()
    assert done["choices"][0]["finish_reason"] == "length"
    with http.stream("POST", "/v1/completions", json={**comp, "stream": True}) as resp:
        assert sse_data(resp)[-1]["choices"][0]["finish_reason"] == "length"


def test_unsupported_fields_still_refused(http, servers):
    resp = http.post("/generate", json={"text": "hi", "return_hidden_states": True})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "return_hidden_states"
    direct = httpx.post(f"{servers[0].http}/generate", json={"text": "hi", "bogus": 1})
    assert direct.status_code == 400 and "bogus" in direct.json()["error"]["message"]
    wrong = httpx.post(f"{servers[0].http}/generate", json={"text": "hi", "model": "other"})
    assert wrong.status_code == 404, wrong.text


def group_prompt(group: int, question: int) -> str:
    words = random.Random(group).choices(
        ["river", "stone", "lamp", "orbit", "cedar", "velvet", "harbor", "quartz", "maple"], k=120
    )
    return f"Archive {group}: " + " ".join(words) + f". Question {question}: which word comes?"


def generate(router: str, prompt: str, new_tokens: int = 2) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0}}
    resp = httpx.post(f"{router}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def test_prefix_groups_stick_to_one_worker(router, servers):
    assert httpx.post(f"{router}/flush_cache", timeout=30).status_code == 200
    before = [scheduler_state(s) for s in servers]
    # A prompt that matches no worker's tree goes to the worker with the fewest requests in
    # flight, so the groups' first requests are sent at once (and decode a while) to spread
    # the groups; every one has finished before the group's later requests are sent.
    with ThreadPoolExecutor(GROUPS) as pool:
        firsts = list(pool.map(lambda g: generate(router, group_prompt(g, 0), 16), range(GROUPS)))
        later = [(g, q) for q in range(1, PER_GROUP) for g in range(GROUPS)]
        metas = list(pool.map(lambda gq: generate(router, group_prompt(*gq)), later))
    prefix_len = min(m["prompt_tokens"] for m in firsts) - 12  # the question's tokens, at most
    for (g, q), meta in zip(later, metas):
        assert meta["cached_tokens"] >= prefix_len, (g, q, meta, prefix_len)
    after = [scheduler_state(s) for s in servers]
    served = [a.get("requests", 0) - b.get("requests", 0) for a, b in zip(after, before)]
    cached = [a.get("cached_tokens", 0) - b.get("cached_tokens", 0) for a, b in zip(after, before)]
    assert sum(served) == GROUPS * PER_GROUP, served
    assert all(n % PER_GROUP == 0 for n in served), served  # whole groups per worker
    assert all(n > 0 for n in served), served  # new groups spread over both
    for n, c in zip(served, cached):
        assert c >= (n // PER_GROUP) * (PER_GROUP - 1) * prefix_len, (served, cached)


def test_get_load_shape(router, servers):
    for srv in servers:
        loads = httpx.get(f"{srv.http}/get_load", timeout=30).json()
        assert loads == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    # the router parses each worker's /get_load; a worker it cannot read shows load -1
    seen = httpx.get(f"{router}/get_loads", timeout=30).json()["workers"]
    assert {w["worker"] for w in seen} == {s.http for s in servers}
    assert all(w["load"] == 0 for w in seen), seen
