"""The server on a tiny gemma3_text (sliding-window layers in their own KV pool) and a tiny
qwen3_moe (mixture of experts): chat through the ``openai`` SDK, structured outputs, the cached
prefix of a second request, and the idle KV invariant of both pools."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import Server, assert_idle_kv

from radixrt import Client
from radixrt.testing import make_tiny_model

SYSTEM = "You are a terse assistant who answers every question about the weather. " * 3
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_moe"])
def server(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    srv = Server("--model", path)
    yield request.param, srv
    srv.stop()


def test_chat_structured_outputs_and_a_cached_prefix(server):
    arch, srv = server
    oai = openai.OpenAI(base_url=srv.http + "/v1", api_key="x", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id

    def chat(question: str, max_tokens: int = 12, **kwargs):
        return oai.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
            **kwargs,
        )

    first = chat("Is it raining?")
    assert first.choices[0].message.content and first.usage.completion_tokens >= 1
    second = chat("Will it snow tomorrow?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 20 < cached < second.usage.prompt_tokens  # the shared system prompt, past the window
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    point = chat("Give a point as JSON.", response_format=fmt, max_tokens=48)
    jsonschema.validate(json.loads(point.choices[0].message.content), POINT)
    info = httpx.get(f"{srv.http}/get_server_info").json()["internal_states"][0]
    if arch == "gemma3_text":  # its sliding layers' pool, beside the full one
        assert info["swa_slots"] < info["full_slots"]
    with Client(srv.address, timeout=60) as c:
        assert_idle_kv(c)  # both pools' partition at idle
