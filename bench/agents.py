"""Tool-using agents through ``/v1/chat/completions`` and through ``/v1/responses`` with
``previous_response_id`` (issue 37's benchmark).

``--agents`` agents run at once, each for ``--turns`` turns against one ``radixrt launch``
(default model unless ``--model``; ``--tool-call-parser``, default ``hermes``). Every turn
but the last asks for a tool call (``tool_choice`` ``required``); the client validates the
call's arguments against the tool's schema, runs the tool (a seeded fake: a JSON result of
``--result-words`` words) and sends its result; the last turn asks for a final answer
(``tool_choice`` ``none``). Requests are streamed, greedy, up to ``--max-tokens`` tokens.

- ``chat``: the client keeps the conversation and sends all of it every turn (assistant
  ``tool_calls`` and ``tool`` messages), as agents built on chat completions do;
- ``responses``: the client sends only the new items (the first turn's message, then each
  ``function_call_output``) with ``previous_response_id`` and the same ``instructions``
  (a turn's own, as OpenAI defines them); the server keeps the conversation.

Reports per endpoint: request bytes the client sent per turn (first, last, and their ratio),
prompt tokens, prefill tokens computed (``prompt - cached``), the cache hit rate, new tokens
per turn (a turn's prompt tokens minus the previous turn's prompt and output tokens) and
prefill computed over new tokens, TTFT p50 / p99 (the first streamed event carrying output),
the share of tool calls whose arguments validate, and the issue's targets with PASS or FAIL
(``checks``): 100 % valid arguments with ``required``; with ``/v1/responses``, client bytes
per turn independent of the conversation's length (last turn / first tool-result turn <= 1.2)
and prefill computed <= 1.05x the new tokens. Writes ``bench/results/agents.json`` and a
Markdown table on stdout.

    python bench/agents.py --agents 8 --turns 10
    python bench/agents.py --agents 2 --turns 3 --max-tokens 64   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).parent))
import routing  # noqa: E402  (radixrt launched as a subprocess)

RESULTS = Path(__file__).parent / "results"
ENDPOINTS = ("chat", "responses")
TOOLS = [
    {
        "name": "search_files",
        "description": "Search the project's files for a text; returns matching lines.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 40},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query", "max_results"],
            "additionalProperties": False,
        },
    },
    {
        "name": "read_file",
        "description": "Read lines of a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 60},
                "start": {"type": "integer", "minimum": 1},
                "count": {"type": "integer", "minimum": 1, "maximum": 200},
            },
            "required": ["path", "start", "count"],
            "additionalProperties": False,
        },
    },
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
TASKS = (
    "Find where the configuration file is parsed and explain how defaults are chosen.",
    "Locate the function that retries network requests and summarize its back-off policy.",
    "Find every place the cache is flushed and say which of them run on shutdown.",
    "Find the command-line entry point and list the sub-commands it registers.",
    "Find the test that covers the tokenizer and say what it checks.",
    "Locate the database migration code and explain how versions are ordered.",
    "Find where logging is configured and list the handlers it installs.",
    "Find where user input is validated and list the fields that are checked.",
)
WORDS = "alpha beta gamma delta config parse default retry cache flush token test log".split()
SYSTEM = "You are a coding agent. Use the tools to inspect the project, then answer briefly."


@dataclass
class Turn:
    bytes_sent: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    calls: int = 0
    valid: int = 0
    required: bool = False


@dataclass
class Agent:
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


def tool_result(rng: random.Random, name: str, words: int) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(max(words // 8, 1))]
    return json.dumps({"tool": name, "lines": lines})


def valid(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


async def sse(client: httpx.AsyncClient, url: str, body: dict, turn: Turn, start: float):
    """The stream's events (JSON); records the request's bytes and its first output's time."""
    data = json.dumps(body).encode()
    turn.bytes_sent = len(data)
    headers = {"content-type": "application/json"}
    async with client.stream("POST", url, content=data, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if turn.ttft is None and carries_output(event):
                turn.ttft = time.perf_counter() - start
            yield event


def carries_output(event: dict) -> bool:
    if event.get("object") == "chat.completion.chunk":
        for c in event.get("choices", []):
            delta = c.get("delta", {})
            if delta.get("content") or delta.get("tool_calls"):
                return True
        return False
    return event.get("type") in (
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",
    )


# ---------------------------------------------------------------------------------- chat


async def chat_turn(client, args, messages: list[dict], required: bool) -> tuple[Turn, dict]:
    turn = Turn(required=required)
    body = {
        "model": args.served_model,
        "messages": messages,
        "tools": [{"type": "function", "function": t} for t in TOOLS],
        "tool_choice": "required" if required else "none",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    content, calls, usage = [], {}, {}
    async for event in sse(client, "/v1/chat/completions", body, turn, time.perf_counter()):
        usage = event.get("usage") or usage
        for c in event.get("choices", []):
            delta = c.get("delta", {})
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
    count_usage(turn, usage.get("prompt_tokens", 0), usage, usage.get("completion_tokens", 0))
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return turn, message


async def chat_agent(client, args, k: int) -> Agent:
    rng, agent = random.Random(f"{args.seed}:{k}"), Agent()
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASKS[k % len(TASKS)]},
    ]
    for t in range(args.turns):
        required = t < args.turns - 1
        turn, message = await chat_turn(client, args, messages, required)
        agent.turns.append(turn)
        messages.append(message)
        for call in message.get("tool_calls", []):
            turn.calls += 1
            turn.valid += valid(call["function"]["name"], call["function"]["arguments"])
            result = tool_result(rng, call["function"]["name"], args.result_words)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if required and "tool_calls" not in message:
            messages.append({"role": "user", "content": "Use a tool."})
    return agent


# ----------------------------------------------------------------------------- responses


async def responses_turn(client, args, items, previous: str | None, required: bool):
    turn = Turn(required=required)
    body = {
        "model": args.served_model,
        "input": items,
        "tools": [{"type": "function", **t} for t in TOOLS],
        "tool_choice": "required" if required else "none",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": args.max_tokens,
        "stream": True,
        "instructions": SYSTEM,  # a turn's own (OpenAI does not carry them over)
    }
    if previous is not None:
        body["previous_response_id"] = previous
    response = None
    async for event in sse(client, "/v1/responses", body, turn, time.perf_counter()):
        if event.get("type") in ("response.completed", "response.incomplete"):
            response = event["response"]
    if response is None:
        raise RuntimeError("the stream ended without response.completed")
    usage = response.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    count_usage(
        turn, usage.get("input_tokens", 0), {"cached": cached}, usage.get("output_tokens", 0)
    )
    calls = [o for o in response.get("output", []) if o.get("type") == "function_call"]
    return turn, response["id"], calls


async def responses_agent(client, args, k: int) -> Agent:
    rng, agent = random.Random(f"{args.seed}:{k}"), Agent()
    items: list = [{"role": "user", "content": TASKS[k % len(TASKS)]}]
    previous = None
    for t in range(args.turns):
        required = t < args.turns - 1
        turn, previous, calls = await responses_turn(client, args, items, previous, required)
        agent.turns.append(turn)
        items = []
        for call in calls:
            turn.calls += 1
            turn.valid += valid(call["name"], call["arguments"])
            result = tool_result(rng, call["name"], args.result_words)
            items.append(
                {"type": "function_call_output", "call_id": call["call_id"], "output": result}
            )
        if not items:
            items = [{"role": "user", "content": "Use a tool."}]
    return agent


def count_usage(turn: Turn, prompt: int, usage: dict, output: int) -> None:
    turn.prompt_tokens, turn.output_tokens = prompt, output
    details = usage.get("prompt_tokens_details") or {}
    turn.cached_tokens = usage.get("cached", details.get("cached_tokens", 0))


# ------------------------------------------------------------------------------- report


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def summarize(agents: list[Agent], wall: float) -> dict:
    turns = [t for a in agents for t in a.turns]
    prompt = sum(t.prompt_tokens for t in turns)
    computed = sum(t.prompt_tokens - t.cached_tokens for t in turns)
    new, later = 0, 0
    for a in agents:
        for before, t in zip(a.turns, a.turns[1:]):
            new += t.prompt_tokens - before.prompt_tokens - before.output_tokens
            later += t.prompt_tokens - t.cached_tokens
    by_turn = [
        [a.turns[i].bytes_sent for a in agents if len(a.turns) > i]
        for i in range(max(len(a.turns) for a in agents))
    ]
    mean_bytes = [sum(b) / len(b) for b in by_turn if b]
    required = [t for t in turns if t.required]
    calls = sum(t.calls for t in required)
    return {
        "agents": len(agents),
        "turns": len(turns),
        "errors": [a.error for a in agents if a.error],
        "wall_s": wall,
        "bytes_per_turn": mean_bytes,
        "bytes_last_over_second": mean_bytes[-1] / mean_bytes[1] if len(mean_bytes) > 2 else None,
        "prompt_tokens": prompt,
        "prefill_computed": computed,
        "hit_rate": 1 - computed / prompt if prompt else 0.0,
        "new_tokens_after_first": new,
        "prefill_over_new": later / new if new > 0 else None,
        "ttft_p50_s": percentile([t.ttft for t in turns if t.ttft is not None], 50),
        "ttft_p99_s": percentile([t.ttft for t in turns if t.ttft is not None], 99),
        "required_turns": len(required),
        "required_turns_with_a_call": sum(t.calls > 0 for t in required),
        "tool_calls": calls,
        "valid_share": sum(t.valid for t in required) / calls if calls else 0.0,
        "turns_by_agent": [[asdict(t) for t in a.turns] for a in agents],
    }


def checks(results: dict) -> dict:
    out = {}
    for name, s in results.items():
        full = s["required_turns_with_a_call"] == s["required_turns"] and s["valid_share"] == 1.0
        out[f"{name}: every required turn calls a tool with valid arguments"] = full
    r = results.get("responses")
    if r is not None:
        ratio = r["bytes_last_over_second"]
        out["responses: client bytes per turn independent of length (last/second <= 1.2)"] = (
            ratio is not None and ratio <= 1.2
        )
        out["responses: prefill computed <= 1.05x new tokens"] = (
            r["prefill_over_new"] is not None and r["prefill_over_new"] <= 1.05
        )
    return out


def table(results: dict) -> str:
    rows = [
        "| endpoint | wall s | bytes/turn first / last | prompt tok | prefill computed | hit rate"
        " | prefill / new tok | TTFT p50 / p99 s | valid args |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        b = s["bytes_per_turn"]
        pn = "-" if s["prefill_over_new"] is None else f"{s['prefill_over_new']:.3f}"
        rows.append(
            f"| {name} | {s['wall_s']:.1f} | {b[0]:.0f} / {b[-1]:.0f} | {s['prompt_tokens']} |"
            f" {s['prefill_computed']} | {s['hit_rate']:.3f} | {pn} |"
            f" {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} |"
            f" {s['valid_share']:.0%} of {s['tool_calls']} |"
        )
    return "\n".join(rows)


async def run_endpoint(url: str, args, name: str) -> dict:
    agent_fn = chat_agent if name == "chat" else responses_agent
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        (await client.post("/flush_cache")).raise_for_status()
        start = time.perf_counter()

        async def one(k: int) -> Agent:
            try:
                return await agent_fn(client, args, k)
            except Exception as e:  # reported, the others run on
                return Agent(error=f"agent {k}: {e}")

        agents = await asyncio.gather(*(one(k) for k in range(args.agents)))
        return summarize(
            [a for a in agents if a.turns] or [Agent([Turn()])], time.perf_counter() - start
        ) | {"errors": [a.error for a in agents if a.error]}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        return platform.processor()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--result-words", type=int, default=48)
    p.add_argument("--endpoints", default=",".join(ENDPOINTS))
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tool-call-parser", default="hermes")
    p.add_argument(
        "--radixrt-args", default="", help="added to radixrt launch (--radixrt-args='--x y')"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(RESULTS / "agents.json"))
    args = p.parse_args(argv)
    unknown = set(args.endpoints.split(",")) - set(ENDPOINTS)
    if unknown:
        p.error(f"unknown endpoints {sorted(unknown)}; known: {', '.join(ENDPOINTS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    flags = ["--tool-call-parser", args.tool_call_parser, *shlex.split(args.radixrt_args)]
    server = routing.Launched(args, *flags)
    try:
        info = httpx.get(server.http + "/server_info", timeout=30).json()
        args.served_model = httpx.get(server.http + "/v1/models", timeout=30).json()["data"][0][
            "id"
        ]
        results = {
            name: asyncio.run(run_endpoint(server.http, args, name))
            for name in args.endpoints.split(",")
        }
    finally:
        server.stop()
    report = {
        "cpu": cpu_model(),
        "command": " ".join(sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "server": {k: info.get(k) for k in ("model_path", "tool_call_parser", "exact_outputs")},
        "results": results,
        "checks": checks(results),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)))
    print(f"CPU: {report['cpu']}\n")
    print(table(results))
    print()
    for name, s in results.items():
        for e in s["errors"]:
            print(f"ERROR ({name}) {e}")
    for name, ok in report["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


if __name__ == "__main__":
    main()
