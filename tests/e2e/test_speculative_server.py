"""Speculative decoding through the server (``--speculative-algorithm NGRAM``): the same bits
as an Engine without speculation, drafts from another request's cached output, the counters in
SGLang's ``meta_info``, several tokens per streamed chunk reassembling to the whole, the
settings in ``server_info``, the Prometheus metrics, and the idle KV invariant; all through two
data-parallel replicas (``--dp-size 2``), each drafting from its own tree, with one Engine's
bits."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import httpx
import openai
import pytest
from server_harness import Server, assert_idle_kv

from radixrt import AsyncClient, Client, Engine, SamplingParams
from radixrt.testing import output_bits, tiny_model_path

VOCAB = 256
N_OUT = 24


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6", "--dp-size", "2"
    )
    yield srv
    srv.stop()


def generate(srv: Server, ids: list[int], stream: bool = False) -> dict | list[dict]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": N_OUT, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }
    if not stream:
        return httpx.post(f"{srv.http}/generate", json=body, timeout=120).json()
    with httpx.stream("POST", f"{srv.http}/generate", json=body, timeout=120) as r:
        lines = [x[len("data: ") :] for x in r.iter_lines() if x.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def test_outputs_drafts_counters_and_streams(server):
    rng = random.Random(3)
    ids = [rng.randrange(10, VOCAB) for _ in range(40)]
    with Engine(model=tiny_model_path("llama"), dtype="float32", max_total_tokens=8192) as eng:
        sp = SamplingParams(max_new_tokens=N_OUT, temperature=0, ignore_eos=True)
        want = eng.generate(input_ids=[ids], sampling_params=sp)[0].token_ids
    first = generate(server, ids)
    assert first["output_ids"] == want
    second = generate(server, ids)  # a second user: drafted from the first's cached output
    assert second["output_ids"] == want
    meta = second["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accepted_tokens"] >= N_OUT // 2, meta
    assert meta["spec_draft_tokens"] >= meta["spec_accepted_tokens"]
    chunks = generate(server, ids, stream=True)
    assert chunks[-1]["output_ids"] == want  # cumulative, as SGLang streams
    assert len(chunks) < N_OUT  # accepted drafts arrive several tokens to a chunk

    oai = openai.OpenAI(base_url=server.http + "/v1", api_key="x", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    kw = dict(
        model=model, prompt=ids, max_tokens=N_OUT, temperature=0, extra_body={"ignore_eos": True}
    )
    done = oai.completions.create(**kw)
    whole = done.choices[0].text
    assert done.usage.model_extra["spec_accepted_tokens"] >= N_OUT // 2  # drafted from the tree
    pieces = [c.choices[0].text for c in oai.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole

    states = httpx.get(f"{server.http}/get_server_info").json()["internal_states"]
    assert all(s["speculative_algorithm"] == "NGRAM" for s in states)
    assert all(s["speculative_num_draft_tokens"] == 6 for s in states)
    assert sum(s["spec_accepted_tokens"] for s in states) >= meta["spec_accepted_tokens"]
    metrics = httpx.get(f"{server.http}/metrics").text
    assert "radixrt:spec_accepted_tokens_total" in metrics
    assert "radixrt:spec_accept_length_bucket" in metrics
    with Client(server.address, timeout=60) as c:
        assert_idle_kv(c)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative-algorithm", "EAGLE"], "EAGLE"),
        (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "0"], "draft"),
        (["--speculative-num-draft-tokens", "4"], "speculative_algorithm"),
    ],
)
def test_bad_speculative_settings_are_refused_by_name(flags, message):
    cmd = [sys.executable, "-m", "radixrt.cli", "launch", "--model", tiny_model_path("llama")]
    done = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


def test_two_replicas_speculate_with_the_bits_of_one_engine(server):
    """Prompts spread over both replicas; sent again, each goes back to the replica that cached
    it and is drafted from its own output there. Greedy and seeded tokens and logprobs equal
    an Engine's without speculation."""
    rng = random.Random(5)
    ids = [[rng.randrange(10, VOCAB) for _ in range(30 + 7 * i)] for i in range(4)]
    sps = [
        SamplingParams(max_new_tokens=N_OUT, temperature=t, seed=i, ignore_eos=True, logprobs=True)
        for i, t in enumerate([0.0, 0.0, 0.8, 1.0])
    ]

    async def rounds() -> tuple[list, list]:
        async with AsyncClient(server.address, timeout=120) as c:
            first = await asyncio.gather(
                *(c.generate(input_ids=i, sampling_params=sp) for i, sp in zip(ids, sps))
            )
            second = await asyncio.gather(
                *(c.generate(input_ids=i, sampling_params=sp) for i, sp in zip(ids, sps))
            )
            return first, second

    with Engine(model=tiny_model_path("llama"), dtype="float32", max_total_tokens=8192) as eng:
        want = [output_bits(o) for o in eng.generate(input_ids=ids, sampling_params=sps)]
    with Client(server.address, timeout=60) as c:
        before = [r.get("requests", 0) for r in c.server_info()["replicas"]]
        first, second = asyncio.run(rounds())
        info = c.server_info()
        assert_idle_kv(c)
    assert [output_bits(o) for o in first] == want
    assert [output_bits(o) for o in second] == want
    assert all(o.spec_accepted_tokens >= N_OUT // 2 for o in second[:2]), second
    served = [r.get("requests", 0) - b for r, b in zip(info["replicas"], before)]
    assert len(served) == 2 and all(served) and sum(served) == 8, served
    assert [r["speculative_algorithm"] for r in info["replicas"]] == ["NGRAM"] * 2
