"""The request side of ``POST /v1/responses``: its body, its input items, and the prompt.

Contract:
- ``ResponsesRequest`` decodes strictly (an unknown field is a 400 naming it);
  the fields radixrt does not do are accepted at their neutral values only
  (``check_request``).
- ``input_messages``: a string is one user message; a list holds ``message``
  items (roles user, system, developer (as system), assistant; content a
  string or ``input_text``/``output_text`` parts), ``function_call`` items
  (an assistant message's ``tool_calls``, merged into the assistant message
  just before, arguments parsed to a dict where they are a JSON object, as
  Hugging Face chat templates expect) and ``function_call_output`` items
  (``tool`` messages). Anything else is a 400 naming ``input``.
- ``chat_tools`` / ``chat_tool_choice``: the Responses shapes of function
  tools and of ``tool_choice`` in the Chat Completions shapes the chat
  template and the tool-call parsers take.
- ``conversation_prompt``: the prompt of a turn. After a stored response it
  is that response's token ids followed by the tokens of what the chat
  template renders after its conversation, so it extends, token for token,
  what the radix tree holds of the previous turns (the model's own output
  tokens stay, where a fresh tokenization of the same text could split it
  otherwise); when the template renders the earlier turns otherwise (other
  instructions or tools, a template that rewrites past turns) the whole
  conversation is tokenized afresh.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from radixrt import grammar
from radixrt.protocol import ErrorCode
from radixrt.server.front_api import FrontApi
from radixrt.server.http import schemas as api
from radixrt.server.http.response_store import StoredResponse

INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
MAX_METADATA = 16  # OpenAI's limits: pairs, key and value characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
# fields accepted at these values only
NEUTRAL = {
    "background": (None, False),
    "include": (None, []),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "reasoning": (None, {}),
    "service_tier": (None, "auto", "default"),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "conversation": (None,),
    "context_management": (None, []),
    "stream_options": (None, {}, {"include_obfuscation": False}),
}


class ResponsesRequest(api._Strict):
    """OpenAI's ``POST /v1/responses`` body (and vLLM's and SGLang's sampling extras)."""

    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # hints that change nothing in the answer
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's and SGLang's
    cache_salt: str | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    # accepted at their neutral values only (NEUTRAL)
    background: bool | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    stream_options: dict[str, Any] | None = None


def bad(message: str, param: str) -> api.ApiError:
    return api.ApiError(400, message, ErrorCode.INVALID_REQUEST, param)


def check_request(body: ResponsesRequest, max_new_tokens_limit: int) -> None:
    """400 naming the first field of ``body`` radixrt does not do as asked."""
    api.refuse_unsupported(body, NEUTRAL)
    limit, wanted = max_new_tokens_limit, body.max_output_tokens
    if wanted is not None and not 1 <= wanted <= limit:
        raise bad(f"max_output_tokens must be in [1, {limit}], got {wanted}", "max_output_tokens")
    meta = body.metadata or {}
    if len(meta) > MAX_METADATA or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in meta.items()
    ):
        raise bad(
            f"metadata holds at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} "
            f"characters and values of at most {MAX_METADATA_VALUE}",
            "metadata",
        )


def text_constraint(text: dict[str, Any] | None) -> dict[str, Any]:
    """The SamplingParams constraint of ``text.format``: text, json_object or json_schema."""
    text = text or {}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown or text.get("verbosity") not in (None, "medium"):
        raise bad(f"text: only format is supported (got {sorted(text)})", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": grammar.JSON_OBJECT}
    if kind == "json_schema" and isinstance(fmt.get("schema"), (dict, bool)):
        return {"json_schema": fmt["schema"]}
    raise bad(
        "text.format must be {'type': 'text'}, {'type': 'json_object'} or "
        "{'type': 'json_schema', 'name': ..., 'schema': {...}}",
        "text",
    )


# ------------------------------------------------------------ input items


def input_messages(value: str | list[dict[str, Any]] | None) -> list[dict]:
    """The chat messages of a request's ``input``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise bad("input is required: a string or a non-empty list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(item_message(item, i))
        elif kind == "function_call":
            add_function_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append(tool_message(item, i))
        else:
            raise bad(
                f"input[{i}]: items of type {kind!r} are not supported "
                "(message, function_call, function_call_output)",
                "input",
            )
    return messages


def item_message(item: dict, i: int) -> dict:
    role = INPUT_ROLES.get(item.get("role"))
    if role is None:
        raise bad(
            f"input[{i}]: role must be one of {sorted(INPUT_ROLES)}, got {item.get('role')!r}",
            "input",
        )
    return {"role": role, "content": item_text(item.get("content"), f"input[{i}].content")}


def item_text(content: Any, where: str) -> str:
    """The text of a string, or of a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}: only {' and '.join(TEXT_PARTS)} parts are supported", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def add_function_call(messages: list[dict], item: dict, i: int) -> None:
    """A function_call item as a tool call of the assistant message it follows (or a new one)."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad(f"input[{i}]: a function_call needs {name} (a string)", "input")
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": template_arguments(item["arguments"])},
    }
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def template_arguments(arguments: str) -> dict | str:
    """A call's arguments as chat templates take them: the JSON object parsed, else the text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def tool_message(item: dict, i: int) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise bad(f"input[{i}]: a function_call_output needs call_id (a string)", "input")
    output = item_text(item.get("output"), f"input[{i}].output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


# ------------------------------------------------------------------ tools


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict]:
    """Responses function tools as Chat Completions tools (``{"type", "function": {...}}``)."""
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise bad(
                f"{where}: only function tools are supported, got {tool.get('type')!r}", where
            )
        unknown = sorted(set(tool) - TOOL_KEYS)
        if unknown:
            raise bad(f"{where}: unknown fields {unknown}", where)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad(f"{where}: a function tool needs a name", where)
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}: parameters must be a JSON Schema object", where)
        function = {"name": tool["name"], "parameters": params or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None, tools: list[dict]) -> str | dict:
    """``tool_choice`` in the Chat Completions shape ("auto" by default); a 400 for a choice
    that names no given function or needs tools that are absent."""
    if choice is None or choice in ("none", "auto"):
        return choice or "auto"
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        named = None
    elif isinstance(choice, dict) and choice.get("type") == "function":
        named = choice.get("name")
        if named not in names:
            raise bad(f"tool_choice names the function {named!r}, not among tools", "tool_choice")
    else:
        raise bad(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
            "tool_choice",
        )
    if not tools:
        raise bad("tool_choice 'required' needs tools", "tool_choice")
    return "required" if named is None else {"type": "function", "function": {"name": named}}


# ----------------------------------------------------------------- prompt


class ConversationPrompt(NamedTuple):
    ids: list[int]  # what the model reads
    text: str  # the chat template's rendering those ids stand for (instructions included)
    messages: list[dict]  # the conversation so far, without the instructions


def conversation_prompt(
    front: FrontApi,
    prev: StoredResponse | None,
    instructions: str | None,
    messages: list[dict],
    tools: list[dict],
) -> ConversationPrompt:
    """The prompt of a turn: ``prev``'s conversation (if any), then ``messages``, rendered
    after ``instructions`` (a system message) with ``tools``, ending with the assistant's
    turn."""
    convo = [*(prev.messages if prev is not None else ()), *messages]
    head = [{"role": "system", "content": instructions}] if instructions else []
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    text = front.chat_prompt(head + convo, add_generation_prompt=True, **kwargs)
    ids = None
    if prev is not None:
        ids = extended_ids(front, prev, text)
        if ids is None:
            ids = reply_kept_ids(front, prev, text, head, kwargs)
    return ConversationPrompt(front.encode(text) if ids is None else ids, text, convo)


def extended_ids(front: FrontApi, prev: StoredResponse, text: str) -> list[int] | None:
    """``prev``'s ids followed by the tokens of what ``text`` adds after ``prev``'s prompt and
    output; None when ``text`` does not begin with them. A stop token that ended ``prev`` is
    left for the template's own end of turn (its KV was never computed: nothing is lost)."""
    seen = prev.prompt_text + prev.output_text
    if not text.startswith(seen):
        return None
    base = prev.ids[:-1] if prev.ends_with_stop else prev.ids
    return [*base, *plain_ids(front, text[len(seen) :])]


def reply_kept_ids(
    front: FrontApi, prev: StoredResponse, text: str, head: list[dict], kwargs: dict
) -> list[int] | None:
    """Where the template writes ``prev``'s reply its own way (a tool call's JSON as it
    dumps it): ``prev``'s prompt and its reply's own tokens, then the tokens of the
    template's rendering from the last special token it writes in the reply's turn (its end
    of turn) on. The stop token that ended the reply gives way to the template's (its KV was
    never computed: nothing is lost). None unless the reply ended with a stop token and
    ``text`` begins with the template's rendering of ``prev``'s conversation."""
    if not prev.ends_with_stop:
        return None
    rendered = front.chat_prompt([*head, *prev.messages], add_generation_prompt=False, **kwargs)
    if not (rendered.startswith(prev.prompt_text) and text.startswith(rendered)):
        return None
    reply = rendered[len(prev.prompt_text) :]
    at = max((reply.rfind(t) for t in front.special_tokens if t), default=-1)
    if at < 0:
        return None
    return [*prev.ids[:-1], *plain_ids(front, reply[at:] + text[len(rendered) :])]


def plain_ids(front: FrontApi, text: str) -> list[int]:
    """The ids of ``text`` without the tokens the tokenizer puts before every text (a BOS)."""
    ids, added = front.encode(text), front.encode("")
    return ids[len(added) :] if added and ids[: len(added)] == added else ids
