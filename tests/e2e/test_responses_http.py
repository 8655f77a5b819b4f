"""POST /v1/responses, GET and DELETE /v1/responses/{id} end to end: `radixrt launch` as a
subprocess (tiny model, a store of 4 responses), driven by the `openai` SDK and raw HTTP.

A conversation continued by previous_response_id is sent as its new items only; its prompt
extends the stored token ids, so the radix tree hits every earlier turn."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import Server, assert_idle_kv
from transformers import AutoTokenizer

from radixrt.client import Client
from radixrt.testing import tiny_model_path

KEY, OTHER_KEY = "k-one", "k-two"
STORE_SIZE = 4
MODEL = "tiny"
SYSTEM = "You are terse."
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--api-key",
        f"{KEY},{OTHER_KEY}",
        "--responses-store-size",
        str(STORE_SIZE),
        "--max-new-tokens-limit",
        "64",
        "--served-model-name",
        MODEL,
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


def sdk(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server):
    return sdk(server)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.http, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path("llama"))


def create(oai, prompt: str, **kwargs):
    kwargs.setdefault("max_output_tokens", 8)
    return oai.responses.create(model=MODEL, input=prompt, temperature=0, **kwargs)


def assert_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    return err


def test_a_response_answers_as_chat_completions_does(oai):
    r = create(oai, "Name a colour.", instructions=SYSTEM, max_output_tokens=12)
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same ids: the chat request hits the whole prompt the response left in the tree
    assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.instructions == SYSTEM and r.max_output_tokens == 12 and r.store


def next_prompt_len(tokenizer, history: list[dict], first, text: str) -> int:
    """The tokens a turn after ``first`` (made from ``history``) reads: first's ids (less the
    stop token that ended it), then what the template renders after first's reply."""
    head = [{"role": "system", "content": SYSTEM}]
    seen = tokenizer.apply_chat_template(head + history, tokenize=False, add_generation_prompt=True)
    reply = {"role": "assistant", "content": first.output_text}
    full = tokenizer.apply_chat_template(
        head + history + [reply, {"role": "user", "content": text}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert full.startswith(seen + first.output_text)
    delta = tokenizer.encode(full[len(seen + first.output_text) :])
    kept = first.usage.input_tokens + first.usage.output_tokens - (first.status == "completed")
    return kept + len(delta)


def test_previous_response_id_continues_the_conversation_in_the_tree(oai, zmq_client, tokenizer):
    zmq_client.flush_cache()
    history = [{"role": "user", "content": "Hello there, tell me about radix trees."}]
    first = create(oai, history[0]["content"], instructions=SYSTEM)
    second = create(oai, "And then?", previous_response_id=first.id, instructions=SYSTEM)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == next_prompt_len(tokenizer, history, first, "And then?")
    # Every token of the first turn is in the tree but the last sampled one, whose KV no
    # forward computed.
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= before - 1
    third = create(oai, "Thanks.", previous_response_id=second.id, instructions=SYSTEM)
    before = second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= before - 1
    assert third.usage.input_tokens > before


def test_instructions_are_not_carried_over(oai):
    first = create(oai, "Hi.", instructions=SYSTEM * 8)
    second = create(oai, "More.", previous_response_id=first.id)
    with_them = create(oai, "More.", previous_response_id=first.id, instructions=SYSTEM * 8)
    assert second.usage.input_tokens < with_them.usage.input_tokens - 8 * 3
    assert second.instructions is None


def test_the_stream_is_the_unstreamed_answer_event_by_event(oai):
    plain = create(oai, "Count with me:", max_output_tokens=10)
    events = list(create(oai, "Count with me:", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    closing = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        closing,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text == events[-2].item.content[0].text
    done = events[-1].response
    assert done.output_text == plain.output_text and done.status == plain.status
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == done.id
    assert oai.responses.retrieve(done.id).output_text == plain.output_text  # stored


def test_get_and_delete(oai, http):
    r = create(oai, "Keep this.")
    got = oai.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.usage) == (r.id, r.output_text, r.usage)
    assert oai.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    other = create(oai, "And this.")
    resp = http.delete(f"/v1/responses/{other.id}")
    assert resp.status_code == 200 and resp.json() == {
        "id": other.id,
        "object": "response",
        "deleted": True,
    }
    assert_error(http.delete(f"/v1/responses/{other.id}"), 404, "response_id")


def test_unknown_ids_are_404_naming_them(oai, http):
    err = assert_error(http.get("/v1/responses/resp_nope"), 404, "response_id")
    assert "resp_nope" in err["message"]
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}
    err = assert_error(http.post("/v1/responses", json=body), 404, "previous_response_id")
    assert "resp_nope" in err["message"]
    with pytest.raises(openai.NotFoundError):
        create(oai, "x", previous_response_id="resp_nope")


def test_store_false_keeps_nothing(oai):
    r = create(oai, "Forget this.", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(oai, "What did I say?", previous_response_id=r.id)


def test_another_key_or_salt_does_not_see_it(server, oai):
    other = sdk(server, OTHER_KEY)
    r = create(oai, "Mine.")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(other, "Yours?", previous_response_id=r.id)
    salted = create(oai, "Salted.", extra_body={"cache_salt": "s1"})
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(salted.id)
    assert oai.responses.retrieve(salted.id, extra_query={"cache_salt": "s1"}).id == salted.id
    with pytest.raises(openai.NotFoundError):
        create(oai, "Next.", previous_response_id=salted.id, extra_body={"cache_salt": "s2"})
    nxt = create(oai, "Next.", previous_response_id=salted.id, extra_body={"cache_salt": "s1"})
    assert nxt.usage.input_tokens_details.cached_tokens > salted.usage.input_tokens


def test_the_store_keeps_the_most_recently_used(oai):
    a, b, c, d = (create(oai, f"Number {i}.", max_output_tokens=1) for i in range(STORE_SIZE))
    oai.responses.retrieve(a.id)  # now b is the least recently used
    e = create(oai, "Number 5.", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(b.id)
    for kept in (a, c, d, e):
        assert oai.responses.retrieve(kept.id).id == kept.id


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"colour": 1}, 400, "colour"),
        ({"input": 5}, 400, "input"),
        ({"input": None}, 400, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"max_output_tokens": 65}, 400, "max_output_tokens"),
        ({"temperature": -1.0}, 400, "temperature"),
        ({"background": True}, 400, "background"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"metadata": {"a": 1}}, 400, "metadata"),
        ({"text": {"format": {"type": "yaml"}}}, 400, "text"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0]"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            400,
            "tool_choice",
        ),
        ({"tools": [WEATHER]}, 400, "tool_choice"),  # auto needs a tool-call parser
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "another"}, 404, "model"),
    ],
)
def test_bad_bodies_name_the_field(http, fields, status, param):
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2, **fields}
    err = assert_error(http.post("/v1/responses", json=body), status, param)
    if param == "colour":  # an unknown field is named in the message too
        assert "colour" in err["message"]


def test_function_call_items_and_tools_reach_the_template(oai, tokenizer):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."},
    ]
    r = oai.responses.create(
        model=MODEL,
        input=items,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Paris"}},
    }
    messages = [
        items[0],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    tools = [
        {
            "type": "function",
            "function": {k: WEATHER[k] for k in ("name", "parameters", "description")},
        }
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert r.usage.input_tokens == len(tokenizer.encode(text))
    assert r.tools[0].name == "weather" and r.tool_choice == "none"
    nxt = create(oai, "Thanks.", previous_response_id=r.id, tools=[WEATHER], tool_choice="none")
    assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens


def test_a_json_schema_text_format(oai):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    r = create(
        oai,
        "Pick a colour.",
        max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)
