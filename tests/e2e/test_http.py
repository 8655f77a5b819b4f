"""The HTTP front end to end: `radixrt launch` as a real subprocess, driven by the official
`openai` SDK (sync and async), raw HTTP (httpx) and SGLang's native endpoints."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server, assert_idle_kv

from radixrt.client import Client, ServerError
from radixrt.testing import tiny_model_path

KEY, OTHER_KEY = "k-one", "k-two"
MAX_BYTES = 64 * 1024
PER_CLIENT = 16
NEW_TOKENS_LIMIT = 64
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--api-key",
        f"{KEY},{OTHER_KEY}",
        "--isolate-by-api-key",
        "--max-message-bytes",
        str(MAX_BYTES),
        "--max-requests-per-client",
        str(PER_CLIENT),
        "--max-new-tokens-limit",
        str(NEW_TOKENS_LIMIT),
        "--max-prompt-tokens",
        "512",
        "--served-model-name",
        "tiny",
        "--debug-faults",
        "stop_check",
        "--constrained-json-disable-any-whitespace",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def zmq_client(server):
    with Client(server.address, timeout=60, api_key=KEY) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_kv_after(server, zmq_client):
    """After every test: the server still runs and the idle KV invariant holds."""
    yield
    if server.proc.poll() is None:
        assert_idle_kv(zmq_client)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.http, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    from radixrt import Engine

    eng = Engine(model=tiny_model_path("llama"), dtype="float32", max_total_tokens=8192)
    yield eng
    eng.check_memory()


def greedy(engine, prompt: str | list[int], n: int) -> tuple[str, list[int]]:
    from radixrt import SamplingParams

    sp = SamplingParams(max_new_tokens=n, temperature=0.0)
    out = (
        engine.generate(prompt, sp)
        if isinstance(prompt, str)
        else engine.generate(input_ids=[prompt], sampling_params=sp)
    )[0]
    return out.text, out.token_ids


def chat_text(engine, messages) -> str:
    return engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def sse_events(resp: httpx.Response) -> list:
    """The data of every SSE event; the last one must be [DONE]."""
    events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# ----------------------------------------------------------- the openai SDK


def test_chat_greedy_equals_engine(oai, engine):
    want, ids = greedy(engine, chat_text(engine, CHAT), 12)
    r = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == len(ids) == 12
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(chat_text(engine, CHAT)))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_greedy_equals_engine_for_text_and_ids(oai, engine):
    want, _ = greedy(engine, "The radix tree", 10)
    r = oai.completions.create(model="tiny", prompt="The radix tree", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    prompt_ids = engine.tokenizer.encode("Token ids 1 2 3")
    want_ids, _ = greedy(engine, prompt_ids, 10)
    r = oai.completions.create(model="tiny", prompt=prompt_ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == want_ids and r.usage.prompt_tokens == len(prompt_ids)
    r = oai.completions.create(
        model="tiny", prompt=["The radix tree", "Token ids 1 2 3"], max_tokens=10, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == want and r.choices[1].text == want_ids


def test_completion_default_max_tokens_is_16(oai):
    r = oai.completions.create(
        model="tiny", prompt="count", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16


def test_chat_stream_with_usage_equals_unstreamed(oai):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    whole = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert (
        last.usage.prompt_tokens_details.cached_tokens > 0
    )  # the unstreamed call cached the prompt


def test_completion_stream(oai, engine):
    want, _ = greedy(engine, "Streams of", 8)
    chunks = list(
        oai.completions.create(
            model="tiny", prompt="Streams of", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_seeds(oai):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=7, n=3)
    r = oai.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert (
        r.usage.completion_tokens == sum(len(oai_tokens(c)) for c in r.choices)
        or r.usage.completion_tokens == 24
    )
    again = oai.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert len({c.message.content for c in r.choices}) > 1  # each choice draws its own tokens
    streamed = list(oai.chat.completions.create(stream=True, **kwargs))
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in r.choices]


def oai_tokens(choice) -> list:
    return choice.logprobs.content if choice.logprobs else []


def test_stop_strings(oai, engine):
    text, _ = greedy(engine, "Stop here:", 16)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    r = oai.completions.create(
        model="tiny", prompt="Stop here:", max_tokens=16, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(
        oai.completions.create(
            model="tiny", prompt="Stop here:", max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[: text.find(stop)]


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.top_logprobs[0].logprob == pytest.approx(
            tok.logprob, abs=1e-5
        )  # greedy: the top one
        assert [t.logprob for t in tok.top_logprobs] == sorted(
            (t.logprob for t in tok.top_logprobs), reverse=True
        )
        assert tok.bytes == list(tok.token.encode())
    assert "".join(t.token for t in content) == r.choices[0].message.content
    streamed = list(
        oai.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    got = [
        t.logprob
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert got == pytest.approx([t.logprob for t in content], abs=1e-5)


def test_completion_logprobs_with_echo(oai, engine):
    prompt = "Echo this"
    n_prompt = len(engine.tokenizer.encode(prompt))
    r = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == n_prompt + 4
    )
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # scoring only (what lm-eval-harness sends): max_tokens 0, echo, logprobs
    score = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert score.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:n_prompt]
    assert score.usage.completion_tokens == 0


def test_completion_logprobs_are_the_engines_bits(oai, engine):
    """Exact outputs over HTTP: a completion's prompt and output logprobs (JSON numbers) are
    the bits the in-process Engine gives the same request, under concurrent load."""
    from concurrent.futures import ThreadPoolExecutor

    from radixrt import SamplingParams

    prompt = "Count: one, two, three,"
    ids = engine.tokenizer.encode(prompt)
    req = engine.add_request(
        ids, SamplingParams(max_new_tokens=5, temperature=0, logprobs=True), logprob_start_len=1
    )
    while not req.finished:
        engine.step()
    want = engine.make_output(req)

    def one(_):
        return oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, echo=True
        )

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for r in results:
        lp = r.choices[0].logprobs.token_logprobs
        assert lp[1 : len(ids)] == want.prompt_logprobs
        assert lp[len(ids) :] == want.logprobs


def test_async_client_concurrent_streams(server):
    async def run() -> list[str]:
        aoai = openai.AsyncOpenAI(
            base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=60
        )

        async def one(i: int) -> str:
            stream = await aoai.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, usage = [], None
            async for chunk in stream:
                parts += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            assert usage.completion_tokens == 8
            return "".join(parts)

        streamed = await asyncio.gather(*(one(i) for i in range(6)))
        whole = await aoai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "question 3"}],
            max_tokens=8,
            temperature=0,
            user="u-3",
        )
        assert streamed[3] == whole.choices[0].message.content
        done = await aoai.completions.create(
            model="tiny", prompt="async", max_tokens=6, temperature=0
        )
        parts = [
            c.choices[0].text
            async for c in await aoai.completions.create(
                model="tiny", prompt="async", max_tokens=6, temperature=0, stream=True
            )
        ]
        assert "".join(parts) == done.choices[0].text and done.usage.completion_tokens == 6
        await aoai.close()
        return streamed

    assert len(asyncio.run(run())) == 6


def test_shared_prefix_reports_cached_tokens(oai, zmq_client):
    zmq_client.flush_cache()
    system = {
        "role": "system",
        "content": "A long shared system prompt about radix trees and caches. " * 4,
    }
    first = oai.chat.completions.create(
        model="tiny",
        messages=[system, {"role": "user", "content": "one"}],
        max_tokens=2,
        temperature=0,
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = oai.chat.completions.create(
        model="tiny",
        messages=[system, {"role": "user", "content": "two"}],
        max_tokens=2,
        temperature=0,
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 20
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_api_keys_isolate_caches_and_cache_salt(server, oai):
    other = openai.OpenAI(
        base_url=server.http + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=60
    )
    prompt = "Tenant isolation: this prompt is cached per key. " * 3
    oai.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert (
        other.completions.create(
            model="tiny", prompt=prompt, max_tokens=1
        ).usage.prompt_tokens_details.cached_tokens
        == 0
    )
    assert (
        oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=1
        ).usage.prompt_tokens_details.cached_tokens
        > 0
    )
    salted = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "s1"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_models_and_sglang_info_endpoints(oai, http):
    (card,) = oai.models.list().data
    assert card.id == "tiny" and card.object == "model" and card.owned_by
    raw = http.get("/v1/models").json()["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(raw)
    assert raw["root"] == tiny_model_path("llama") and raw["max_model_len"] > 0
    info = http.get("/get_model_info").json()
    assert info["model_path"] == tiny_model_path("llama") and info["is_generation"] is True
    server_info = http.get("/get_server_info").json()
    state = server_info["internal_states"][0]
    assert {"kv_slots", "free_slots", "evictable_tokens", "protected_tokens", "hit_rate"} <= set(
        state
    )
    assert "last_gen_throughput" in state and "api_key" not in server_info
    kernels = state["kernels"]  # which linear path each weight shape runs, and the elementwise
    assert kernels["linear"] and {"rms_norm", "rotary", "silu_mul"} <= set(kernels)
    assert state["attention_backend"] in ("cpu", "torch")
    assert state["gc_frozen_objects"] > 1000  # the scheduler froze what it built at start
    # whether forwards run as one C call per step (the tiny model's calibrated paths decide)
    chain = state["decode_chain"]
    assert chain.startswith("off: ") or re.search(r"forwards of up to \d+ tokens$", chain), chain
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/get_server_info").json()["internal_states"][0]["evictable_tokens"] == 0


def test_sglang_generate(http, engine):
    want, ids = greedy(engine, "Native API", 6)
    r = http.post(
        "/generate",
        json={"text": "Native API", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    )
    out = r.json()
    assert r.status_code == 200 and out["text"] == want and out["output_ids"] == ids
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("Native API"))
    assert meta["completion_tokens"] == 6 and meta["cached_tokens"] >= 0
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    batch = http.post(
        "/generate",
        json={
            "input_ids": [[5, 6, 7], [8, 9, 10, 11]],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    ).json()
    assert [len(o["output_ids"]) for o in batch] == [3, 3]
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 3
    assert all(len(t) == 2 for t in batch[0]["meta_info"]["output_top_logprobs"])
    scored = http.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7, 8],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1},
        },
    ).json()["meta_info"]
    assert [t[1] for t in scored["input_token_logprobs"]] == [5, 6, 7, 8]
    assert scored["input_token_logprobs"][0][0] is None and all(
        t[0] <= 0 for t in scored["input_token_logprobs"][1:]
    )
    with http.stream(
        "POST",
        "/generate",
        json={
            "text": "Native API",
            "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        },
    ) as s:
        events = sse_events(s)
    assert events[-1]["text"] == want  # cumulative, as SGLang streams it
    assert [e["meta_info"]["completion_tokens"] for e in events] == sorted(
        e["meta_info"]["completion_tokens"] for e in events
    )


# ---------------------------------------------------------------- errors


def test_error_statuses(server, http):
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 4}
    assert_error(httpx.post(server.http + "/v1/chat/completions", json=chat), 401, "unauthorized")
    assert_error(
        httpx.post(
            server.http + "/v1/chat/completions",
            json=chat,
            headers={"Authorization": "Bearer wrong"},
        ),
        401,
    )
    assert httpx.get(server.http + "/health").status_code == 200  # no key needed
    assert httpx.get(server.http + "/metrics").status_code == 200
    assert_error(http.post("/v1/chat/completions", content=b"{not json"), 400, "malformed")
    assert (
        assert_error(http.post("/v1/chat/completions", json={**chat, "max_tokens": "x"}), 400)[
            "param"
        ]
        == "max_tokens"
    )
    assert (
        assert_error(http.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400)[
            "param"
        ]
        == "temperature"
    )
    assert (
        "bogus"
        in assert_error(http.post("/v1/chat/completions", json={**chat, "bogus": 1}), 400)[
            "message"
        ]
    )
    assert_error(http.post("/v1/chat/completions", json={**chat, "frequency_penalty": 0.5}), 400)
    assert_error(http.post("/v1/chat/completions", json={**chat, "messages": []}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": [], "max_tokens": 2}), 400)
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": NEW_TOKENS_LIMIT + 1}),
        400,
        "limit_exceeded",
    )
    assert_error(
        http.post("/v1/completions", json={"prompt": "word " * 600, "max_tokens": 1}),
        400,
        "prompt_too_long",
    )
    assert_error(http.post("/v1/completions", json={"prompt": [99999999], "max_tokens": 1}), 400)
    assert (
        assert_error(
            http.post("/v1/chat/completions", json={**chat, "model": "gpt-9"}),
            404,
            "model_not_found",
        )["param"]
        == "model"
    )
    assert_error(http.get("/v1/nowhere"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)
    assert_error(http.post("/v1/completions", content=b"x" * (MAX_BYTES + 1)), 413, "too_large")
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": PER_CLIENT + 1}),
        429,
    )
    assert_error(
        http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stop": ["<fault:stop_check>"]}
        ),
        500,
        "internal",
    )
    with http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "stream": True, "stop": ["<fault:stop_check>"]},
    ) as s:
        s.read()  # the failure comes before the first token, so the stream has a status to tell it
        assert_error(s, 500, "internal")
    r = http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_fuzzed_bodies_never_break_the_server(http):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=20)
    )
    values = st.recursive(
        scalars,
        lambda x: st.lists(x, max_size=4) | st.dictionaries(st.text(max_size=8), x, max_size=4),
        max_leaves=12,
    )
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    completion = {"prompt": "fuzz", "max_tokens": 2}
    generate = {"text": "fuzz", "sampling_params": {"max_new_tokens": 2}}
    fields = [
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "top_k",
        "min_p",
        "prompt",
        "echo",
        "model",
        "sampling_params",
        "text",
        "input_ids",
        "cache_salt",
        "ignore_eos",
        "max_completion_tokens",
        "stop_token_ids",
    ]
    routes = {"/v1/chat/completions": chat, "/v1/completions": completion, "/generate": generate}
    body = (
        st.tuples(st.sampled_from(sorted(routes)), st.sampled_from(fields), values).map(
            lambda t: (t[0], json.dumps({**routes[t[0]], t[1]: t[2]}, allow_nan=True).encode())
        )
        | st.tuples(st.sampled_from(sorted(routes)), st.binary(max_size=64))
        | st.tuples(st.sampled_from(sorted(routes)), values.map(lambda v: json.dumps(v).encode()))
    )
    seen = []

    @settings(
        max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(body)
    def check(case):
        route, data = case
        resp = http.post(route, content=data)
        seen.append(resp.status_code)
        assert resp.status_code in (200, 400, 404, 413, 429), (
            route,
            data,
            resp.status_code,
            resp.text,
        )
        if resp.status_code != 200:
            assert_error(resp, resp.status_code)

    check()
    assert seen.count(400) > 50 and 200 in seen
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_disconnect_mid_stream_aborts_and_frees_kv(server, zmq_client):
    body = {
        "model": "tiny",
        "prompt": "a long answer",
        "max_tokens": NEW_TOKENS_LIMIT,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(
        base_url=server.http, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as c:
        with c.stream("POST", "/v1/completions", json=body) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            assert zmq_client.server_info()["running"] == 1
    info = assert_idle_kv(zmq_client)
    assert info["finished_abort"] >= 1 and info["protected_tokens"] == 0


# --------------------------------------------------------------- metrics


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.http + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("" if not sample.labels else str(sorted(sample.labels.items())))
            out[key] = sample.value
    return out


def test_metrics_move_with_requests(server, oai):
    before = metrics(server)
    length = "radixrt:requests_total[('finish_reason', 'length')]"
    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt="metrics please",
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks
    oai.completions.create(
        model="tiny",
        prompt="metrics please",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = metrics(server)
    assert after[length] == before.get(length, 0) + 2
    assert after["radixrt:generation_tokens_total"] == before["radixrt:generation_tokens_total"] + 8
    assert after["radixrt:prompt_tokens_total"] > before["radixrt:prompt_tokens_total"]
    assert (
        after["radixrt:cached_tokens_total"] > before["radixrt:cached_tokens_total"]
    )  # the second hit
    assert (
        after["radixrt:time_to_first_token_seconds_count"]
        == before["radixrt:time_to_first_token_seconds_count"] + 2
    )
    assert (
        after["radixrt:inter_token_latency_seconds_count"]
        == before["radixrt:inter_token_latency_seconds_count"] + 6
    )
    assert (
        after["radixrt:e2e_request_latency_seconds_count"]
        == before["radixrt:e2e_request_latency_seconds_count"] + 2
    )
    assert after["radixrt:kv_slots"] == 8192 and after["radixrt:num_running_reqs"] == 0
    assert after["radixrt:kv_slots_free"] + after["radixrt:kv_slots_evictable"] == 8192
    assert 0 < after["radixrt:cache_hit_rate"] <= 1


# ------------------------------------------------------------------ drain


def test_sigterm_drain_over_http():
    srv = Server("--grace-period", "60")
    try:
        body = {"prompt": "drain me", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(base_url=srv.http, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as s,
        ):
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            for _ in range(100):
                if c.get("/health").status_code == 503:
                    break
            assert_error(c.get("/health"), 503, "shutting_down")
            assert_error(
                c.post("/v1/completions", json={"prompt": "late", "max_tokens": 1}),
                503,
                "shutting_down",
            )
            rest = [
                json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"
            ]
            assert rest[-1]["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


# ---------------------------------------------------------- structured outputs

PERSON = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "n"],
}


def test_chat_response_format_json_schema_and_json_object(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    for temperature in (0.0, 1.0):
        r = oai.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=48,
            temperature=temperature,
            seed=5,
            response_format=fmt,
            n=2,
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = oai.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=48, response_format={"type": "json_object"}
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_and_ebnf_extra_fields_on_chat_and_completions(oai):
    date = r"\d{4}-\d{2}-\d{2}"
    r = oai.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=20, extra_body={"regex": date}
    )
    assert re.fullmatch(date, r.choices[0].message.content)
    r = oai.completions.create(
        model="tiny",
        prompt="Answer:",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"ebnf": 'root ::= ("yes" | "no") "!"'},
    )
    assert r.choices[0].text in ("yes!", "no!") and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=48,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
    )
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_generate_and_the_zmq_client_take_constraints(http, zmq_client):
    body = {
        "text": "Q:",
        "sampling_params": {"max_new_tokens": 48, "json_schema": json.dumps(PERSON)},
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), PERSON)
    body["sampling_params"] = {"max_new_tokens": 20, "regex": "(cat|dog)s?"}
    assert re.fullmatch("(cat|dog)s?", http.post("/generate", json=body).json()["text"])
    from radixrt import SamplingParams

    out = zmq_client.generate(
        "Q:", sampling_params=SamplingParams(max_new_tokens=20, regex="[0-9]{3}")
    )
    assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "stop"
    with pytest.raises(ServerError) as e:
        zmq_client.generate("Q:", sampling_params={"max_new_tokens": 4, "regex": "(unclosed"})
    assert e.value.code == "invalid_grammar" and "regex" in str(e.value)


def test_bad_constraints_are_400_naming_the_problem(http):
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 4}
    err = assert_error(
        http.post("/v1/chat/completions", json={**chat, "regex": "[a-"}), 400, "invalid_grammar"
    )
    assert err["param"] == "regex" and "Unclosed" in err["message"]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    err = assert_error(
        http.post("/v1/chat/completions", json={**chat, "response_format": bad_schema}),
        400,
        "invalid_grammar",
    )
    assert err["param"] == "json_schema" and "nope" in err["message"]
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ebnf": "root ::= x"}),
        400,
        "invalid_grammar",
    )
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert (
        "json_schema.schema"
        in assert_error(
            http.post("/v1/chat/completions", json={**chat, "response_format": no_schema}),
            400,
            "invalid_request",
        )["message"]
    )
    assert (
        "'yaml'"
        in assert_error(
            http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "yaml"}}),
            400,
            "invalid_request",
        )["message"]
    )
    assert (
        "at most one"
        in assert_error(
            http.post("/v1/chat/completions", json={**chat, "regex": "a", "ebnf": 'root ::= "a"'}),
            400,
            "invalid_request",
        )["message"]
    )
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": "{oops"}}
    assert_error(http.post("/generate", json=body), 400, "invalid_grammar")
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200  # and the server serves on
