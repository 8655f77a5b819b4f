"""Reasoning in chat completions end to end: `radixrt launch --reasoning-parser qwen3` on the tiny
model with a Qwen3-style chat template (its generation prompt opens ``<think>``, or closes it with
``enable_thinking`` false), driven by the `openai` SDK and raw HTTP.

The random model never writes ``</think>`` by itself, so the tests that need the reasoning to end
bound it with ``thinking_token_budget`` (the grammar then allows only ``</think>``); greedy
outputs are exact, so one request's reasoning is the same text as another's unconstrained tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from server_harness import Server, assert_idle_kv

from radixrt.client import Client
from radixrt.testing import tiny_model_path

THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHAT = [{"role": "user", "content": "What is two plus two?"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer"],
}
GREEDY = {"temperature": 0.0}
MODEL = "thinking"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    """The tiny llama's folder with THINKING_TEMPLATE as its chat template (weights linked)."""
    src = tiny_model_path("llama")
    dst = tmp_path_factory.mktemp("thinking-model")
    for name in os.listdir(src):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(src, name), dst / name)
    (dst / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return str(dst)


@pytest.fixture(scope="module")
def server(thinking_model):
    srv = Server(
        "--model", thinking_model, "--reasoning-parser", "qwen3", "--served-model-name", MODEL
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, timeout=60) as c:
        yield c


@pytest.fixture(scope="module", autouse=True)
def idle_kv_at_the_end(server):
    yield
    with Client(server.address, timeout=60) as c:
        assert_idle_kv(c)


def chat(http: httpx.Client, **fields) -> dict:
    """The JSON answer to a chat request (asserted 200)."""
    resp = http.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed(oai: openai.OpenAI, **fields) -> dict[int, tuple[str, str, str, list[str]]]:
    """Each choice's (reasoning, content, finish_reason, the chunks' reasoning pieces) from a
    streamed chat request."""
    sdk = {k: fields.pop(k) for k in ("max_tokens", "n", "seed", "response_format") if k in fields}
    stream = oai.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, extra_body={**GREEDY, **fields}, **sdk
    )
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            acc = out.setdefault(c.index, {"pieces": [], "content": "", "finish": None})
            piece = (c.delta.model_extra or {}).get("reasoning_content")
            if piece is not None:
                acc["pieces"].append(piece)
            acc["content"] += c.delta.content or ""
            acc["finish"] = c.finish_reason or acc["finish"]
    return {
        i: ("".join(a["pieces"]), a["content"], a["finish"], a["pieces"]) for i, a in out.items()
    }


def test_the_reasoning_is_split_from_the_content(http) -> None:
    split = chat(http, max_tokens=24, thinking_token_budget=4)
    whole = chat(http, max_tokens=24, thinking_token_budget=4, separate_reasoning=False)
    msg, raw = split["choices"][0]["message"], whole["choices"][0]["message"]
    assert "reasoning_content" not in raw  # kept whole: the reasoning is in the content
    assert msg["reasoning_content"] and msg["content"]
    assert raw["content"] == msg["reasoning_content"] + "</think>" + msg["content"]
    for count in ("prompt_tokens", "completion_tokens"):
        assert split["usage"][count] == whole["usage"][count]
    # the budget's reasoning is the model's own first 4 tokens, free of the grammar
    free = chat(http, max_tokens=4)
    assert free["choices"][0]["message"]["reasoning_content"] == msg["reasoning_content"]


def test_reasoning_that_never_ends_is_all_reasoning(http) -> None:
    out = chat(http, max_tokens=10)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    assert out["usage"]["completion_tokens"] == 10


def test_thinking_disabled_answers_in_the_content(http) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 12}
    msg = chat(http, **off)["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"]
    assert chat(http, **off, separate_reasoning=False)["choices"][0]["message"] == msg


def test_a_stream_reassembles_the_unstreamed_answer(oai, http) -> None:
    fields = {"max_tokens": 24, "thinking_token_budget": 5}
    want = chat(http, **fields)["choices"][0]
    got = streamed(oai, **fields)[0]
    msg = want["message"]
    assert got[:3] == (msg["reasoning_content"], msg["content"], want["finish_reason"])
    assert len(got[3]) > 1  # the reasoning streamed as it came
    whole = streamed(oai, **fields, stream_reasoning=False)[0]
    assert whole[:3] == got[:3] and whole[3] == [msg["reasoning_content"]]
    kept = streamed(oai, **fields, separate_reasoning=False)[0]
    assert kept[:3] == ("", msg["reasoning_content"] + "</think>" + msg["content"], got[2])


def test_each_sampled_choice_streams_its_own_split(oai, http) -> None:
    fields = {"max_tokens": 16, "thinking_token_budget": 3, "n": 2, "seed": 5, "temperature": 1.0}
    want = chat(http, **fields)["choices"]
    got = streamed(oai, **fields)
    assert len(got) == 2
    for c in want:
        r, t, finish, _ = got[c["index"]]
        assert (r, t, finish) == (
            c["message"]["reasoning_content"],
            c["message"]["content"],
            c["finish_reason"],
        )


def test_a_json_schema_applies_after_free_reasoning(oai, http) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=200,
        response_format=fmt,
        extra_body={**GREEDY, "thinking_token_budget": 6},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    free = chat(http, max_tokens=6)["choices"][0]["message"]["reasoning_content"]
    assert choice.message.model_extra["reasoning_content"] == free
    got = streamed(oai, max_tokens=200, response_format=fmt, thinking_token_budget=6)[0]
    assert got[:3] == (free, choice.message.content, "stop")


@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        ({"regex": "(yes|no), [a-z]{2,6}"}, r"(yes|no), [a-z]{2,6}"),
        ({"ebnf": 'root ::= "x=" [0-9] [0-9]?'}, r"x=[0-9][0-9]?"),
        ({"response_format": {"type": "json_object"}}, r"\{.*\}"),
    ],
)
def test_regex_ebnf_and_json_object_apply_after_the_reasoning(http, constraint, pattern) -> None:
    choice = chat(http, max_tokens=120, thinking_token_budget=3, **constraint)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["reasoning_content"]
    assert re.fullmatch(pattern, choice["message"]["content"], re.S), choice
    if "response_format" in constraint:
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_constrained_answer_whose_reasoning_never_ends_stops_at_max_tokens(http) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    choice = chat(http, max_tokens=12, response_format=fmt)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == ""
    free = chat(http, max_tokens=12)["choices"][0]["message"]["reasoning_content"]
    assert choice["message"]["reasoning_content"] == free


def test_thinking_disabled_constrains_from_the_first_token(http) -> None:
    choice = chat(
        http,
        max_tokens=120,
        regex="[a-z]{3}",
        thinking_token_budget=2,
        chat_template_kwargs={"enable_thinking": False},
    )["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch("[a-z]{3}", choice["message"]["content"])
    assert "reasoning_content" not in choice["message"]


def test_a_negative_thinking_budget_is_a_400_naming_it(http) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": CHAT, "thinking_token_budget": -1})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "thinking_token_budget" and ">= 0" in err["message"]


def test_an_unknown_reasoning_parser_is_refused_at_launch() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "radixrt.cli", "launch", "--reasoning-parser", "deepseek"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "reasoning_parser 'deepseek' is not known" in proc.stderr
    assert "deepseek-r1, qwen3" in proc.stderr
