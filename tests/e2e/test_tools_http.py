"""Tool calling in /v1/chat/completions, end to end: `radixrt launch --tool-call-parser hermes
--enable-auto-tool-choice` on the tiny model with a tools-aware (Hermes-style ChatML) chat
template, driven by the `openai` SDK, raw HTTP and LangChain's ChatOpenAI.bind_tools."""

from __future__ import annotations

import json
import shutil
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from server_harness import Server, assert_idle_kv

from radixrt.client import Client
from radixrt.testing import tiny_model_path

# ChatML with the tools in the system turn, calls and results written as Hermes/Qwen2.5 do.
TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall one as <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>' }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments}
    | tojson) + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def function(name: str, description: str, properties: dict) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    function(
        "get_weather",
        "The weather in a city.",
        {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "unit": {"enum": ["c", "f"]},
        },
    ),
    function(
        "add",
        "Add two small numbers.",
        {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
    ),
    function("note", "Write a note.", {"text": {"type": "string", "maxLength": 12}}),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
PROMPTS = [
    ASK,
    [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Add 4 and 5."}],
    [{"role": "user", "content": "Note: buy milk."}],
]
FORCED_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny llama with the tools-aware chat template."""
    folder = tmp_path_factory.mktemp("tools-model")
    shutil.copytree(tiny_model_path("llama"), folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(
        "--model",
        model_dir,
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--served-model-name",
        "tiny",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def zmq_client(server):
    with Client(server.address, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_kv_after(server, zmq_client):
    yield
    if server.proc.poll() is None:
        assert_idle_kv(zmq_client)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, timeout=120) as c:
        yield c


def chat(oai, messages=ASK, **kwargs):
    kwargs.setdefault("max_tokens", 256)
    return oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, **kwargs)


def check_calls(message, names=tuple(SCHEMAS)) -> None:
    """Every call has an id, type function, a name among ``names`` and arguments that
    validate against its tool's schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def reassemble(stream) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A streamed choice's content, calls (name, arguments) and finish reason, checking the
    deltas' shape: each call's id, type and name in its first delta only."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function", d
                    assert d.function.name, d
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def whole(choice) -> tuple[str | None, list[tuple[str, str]], str]:
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content, calls, choice.finish_reason


# ------------------------------------------------------------------ forced calls


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_one_valid_call(oai, seed) -> None:
    for messages in PROMPTS:
        r = chat(oai, messages, tool_choice="required", parallel_tool_calls=False, seed=seed)
        choice = r.choices[0]
        check_calls(choice.message)
        assert len(choice.message.tool_calls) == 1
        assert choice.message.content is None and choice.finish_reason == "tool_calls"


def test_required_with_parallel_calls(oai) -> None:
    r = chat(oai, tool_choice="required", seed=7, n=3)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message)
        else:  # cut short in a later call: the calls before it are whole
            assert choice.finish_reason == "length"
            for call in choice.message.tool_calls or ():
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_named_function_is_called(oai, name) -> None:
    for seed in (1, 2):
        r = chat(oai, tool_choice={"type": "function", "function": {"name": name}}, seed=seed)
        check_calls(r.choices[0].message, names=(name,))
        assert len(r.choices[0].message.tool_calls) == 1
        assert r.choices[0].finish_reason == "tool_calls"


# ------------------------------------------------------------------------ auto


def test_auto_reads_a_call_out_of_the_reply(oai) -> None:
    """The reply is forced (a regex) to text and a Hermes call; auto parses it."""
    regex = r"Let me add\. " + FORCED_CALL.replace("{", r"\{").replace("}", r"\}")
    r = chat(oai, tool_choice="auto", temperature=0, extra_body={"regex": regex})
    choice = r.choices[0]
    assert choice.message.content == "Let me add. "
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert choice.finish_reason == "tool_calls"
    stream = chat(oai, tool_choice="auto", temperature=0, extra_body={"regex": regex}, stream=True)
    assert reassemble(stream) == whole(choice)


def test_auto_without_a_call_is_plain_content(oai) -> None:
    r = chat(oai, temperature=0, max_tokens=24)  # auto: the default with tools
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    plain = oai.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=24)
    assert plain.choices[0].message.tool_calls is None


def test_none_shows_the_tools_but_reads_no_calls(oai, model_dir) -> None:
    regex = FORCED_CALL.replace("{", r"\{").replace("}", r"\}")
    r = chat(oai, tool_choice="none", extra_body={"regex": regex})
    assert r.choices[0].message.content == FORCED_CALL
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == prompt_tokens(model_dir, ASK, TOOLS)


# ------------------------------------------------------------------- streaming


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_deltas_reassemble_to_the_whole_answer(oai, choice) -> None:
    for messages in PROMPTS:
        r = chat(oai, messages, tool_choice=choice, temperature=0)
        stream = chat(oai, messages, tool_choice=choice, temperature=0, stream=True)
        assert reassemble(stream) == whole(r.choices[0])


# -------------------------------------------------------------------- round trip


def prompt_tokens(model_dir: str, messages: list[dict], tools: list[dict]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return len(tok.encode(text))


def test_a_full_round_trip(oai, model_dir) -> None:
    first = chat(oai, tool_choice={"type": "function", "function": {"name": "add"}}, seed=3)
    [call] = first.choices[0].message.tool_calls
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    final = chat(oai, history, tool_choice="none", max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    # the template received the call's arguments as an object, and the result
    rendered = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "add", "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    assert final.usage.prompt_tokens == prompt_tokens(model_dir, rendered, TOOLS)
    as_text = json.loads(json.dumps(rendered))
    as_text[1]["tool_calls"][0]["function"]["arguments"] = call.function.arguments
    assert final.usage.prompt_tokens != prompt_tokens(model_dir, as_text, TOOLS)
    again = chat(oai, history, tool_choice="required", parallel_tool_calls=False, seed=4)
    check_calls(again.choices[0].message)


# ------------------------------------------------------------------------ errors


def error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_bad_tool_requests_are_400_naming_the_field(http) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    post = lambda **kw: http.post("/v1/chat/completions", json={**body, **kw})  # noqa: E731
    bad_schema = function("f", "", {"x": {"type": "strin"}})
    err = error(post(tools=[TOOLS[0], bad_schema]))
    assert err["param"] == "tools" and "tools[1].function.parameters" in err["message"]
    assert "strin" in err["message"]
    err = error(post(tools=[{"type": "function", "function": {"name": "has space"}}]))
    assert err["param"] == "tools" and "tools[0].function.name" in err["message"]
    err = error(post(tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert err["param"] == "tool_choice" and "'nope'" in err["message"]
    assert "'get_weather'" in err["message"]
    err = error(post(tool_choice="sometimes"))
    assert err["param"] == "tool_choice"
    tool_reply = [*ASK, {"role": "tool", "content": "5"}]
    err = error(post(messages=tool_reply))
    assert err["param"] == "messages" and "tool_call_id" in err["message"]
    bad_args = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}
    err = error(post(messages=[*ASK, {"role": "assistant", "tool_calls": [bad_args]}]))
    assert "messages[1].tool_calls[0].function.arguments" in err["message"]
    fmt = {"type": "json_object"}
    err = error(post(tool_choice="required", response_format=fmt))
    assert err["param"] == "response_format" and "'required'" in err["message"]
    err = error(post(tools=None, functions=[TOOLS[1]["function"]]))
    assert err["param"] == "functions"
    err = error(post(tools=None, tool_choice="required"))
    assert err["param"] == "tool_choice"


def test_server_info_shows_the_tool_settings(http) -> None:
    info = http.get("/server_info").json()
    assert info["tool_call_parser"] == "hermes" and info["enable_auto_tool_choice"] is True


# ---------------------------------------------------------------------- LangChain


def test_langchain_bind_tools_gets_a_call(server) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        base_url=server.http + "/v1", api_key="x", model="tiny", max_tokens=128, seed=5
    )
    for choice in ("get_weather", "any"):
        msg = llm.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Oslo?")
        [call] = msg.tool_calls[:1]
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        assert call["args"]["city"] in ("Paris", "Oslo") and call["args"]["unit"] in ("c", "f")


def flat(tool: dict) -> dict:
    """A chat tool in the Responses API's shape."""
    return {"type": "function", **tool["function"]}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_responses_call_tools_and_continue_with_their_results(oai, choice) -> None:
    first = oai.responses.create(
        model="tiny",
        input="Add 4 and 5.",
        tools=[flat(t) for t in TOOLS],
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed", first.output
    call = calls[0]
    if isinstance(choice, dict):
        assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    nxt = oai.responses.create(
        model="tiny",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "9"}],
        previous_response_id=first.id,
        tools=[flat(t) for t in TOOLS],
        tool_choice="none",
        temperature=0,
        max_output_tokens=8,
    )
    assert not [o for o in nxt.output if o.type == "function_call"]
    # the first turn's prompt and call (but its last token) came from the cache
    assert nxt.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
