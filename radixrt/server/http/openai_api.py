"""OpenAI's API: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each request becomes ``n`` engine requests per prompt (choice ``i`` of a
seeded request samples with ``seed + i``); answers and stream chunks have
OpenAI's shapes (``radixrt.server.http.schemas``). ``usage`` counts a
prompt once for its ``n`` choices, and always carries
``prompt_tokens_details.cached_tokens``. With ``--reasoning-parser`` a chat answer's reasoning
goes to ``reasoning_content`` and its structured output applies after the reasoning
(``radixrt.server.http.reasoning``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.front_api import FrontApi
from radixrt.server.http import reasoning
from radixrt.server.http import schemas as api
from radixrt.server.http.context import HttpContext
from radixrt.server.http.jobs import MAX_CHOICES, Choice, Job, Prompt, json_response, sse_events
from radixrt.server.http.tools import ChatTools, chat_tools, template_messages

# apply_chat_template arguments a request's chat_template_kwargs may not set
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "return_dict",
        "return_tensors",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
        "documents",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class OpenAIApi:
    def __init__(self, http: HttpContext, front: FrontApi) -> None:
        self.http, self.front = http, front  # the HTTP plumbing, and the front process
        self.reasoning_parser = reasoning.parser_of(front.server.reasoning_parser)

    # ---------------------------------------------------------- sampling

    def sampling(
        self,
        body: api._Sampling,
        max_tokens: int | None,
        default_max: int,
        logprobs: bool,
        top_logprobs: int,
        index: int,
        plan: reasoning.ChatReasoning | None = None,
        constraint: dict | None = None,
    ) -> SamplingParams:
        seed = body.seed
        if seed is not None and index:
            seed = seed + index if seed + index < 2**63 else seed - index
        fields = dict(
            max_new_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            seed=seed,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            cache_salt=body.cache_salt,
            skip_special_tokens=body.skip_special_tokens,
            **(api.constraint_fields(body) if constraint is None else constraint),
        )
        sp = self.http.make_params(fields, given=max_tokens is not None)
        return sp if plan is None else plan.constrain(sp)

    @staticmethod
    def check_n(n: int) -> None:
        if not 1 <= n <= MAX_CHOICES:
            raise api.ApiError(
                400, f"n must be in [1, {MAX_CHOICES}], got {n}", ErrorCode.INVALID_REQUEST, "n"
            )

    # -------------------------------------------------------------- chat

    def chat_ids(self, body: api.ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
        messages = template_messages(body.messages, self.message_text)
        if not messages:
            raise api.ApiError(400, "messages is empty", ErrorCode.INVALID_REQUEST, "messages")
        kwargs = dict(body.chat_template_kwargs or {})
        bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise api.ApiError(
                400,
                f"chat_template_kwargs may not set {bad}",
                ErrorCode.INVALID_REQUEST,
                "chat_template_kwargs",
            )
        if body.continue_final_message:
            kwargs.update(continue_final_message=True, add_generation_prompt=False)
        else:
            kwargs["add_generation_prompt"] = body.add_generation_prompt
        if tools:
            kwargs["tools"] = tools
        return self.front.encode(self.front.chat_prompt(messages, **kwargs))

    @staticmethod
    def message_text(content: str | list | None, i: int) -> str:
        if content is None or isinstance(content, str):
            return content or ""
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise api.ApiError(
                    400,
                    f"messages[{i}]: only text content parts are supported "
                    f"(got type {part.get('type')!r})",
                    ErrorCode.INVALID_REQUEST,
                    "messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)

    def check_chat(self, body: api.ChatCompletionRequest) -> int | None:
        """Refuse what the chat endpoint does not take; returns the request's max_tokens."""
        self.http.check_model(body.model)
        api.check_neutral(body)
        self.check_n(body.n)
        if (
            body.max_tokens is not None
            and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens
        ):
            raise api.ApiError(
                400,
                "max_tokens and max_completion_tokens differ",
                ErrorCode.INVALID_REQUEST,
                "max_completion_tokens",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise api.ApiError(
                400, "top_logprobs needs logprobs=true", ErrorCode.INVALID_REQUEST, "top_logprobs"
            )
        if body.max_completion_tokens is not None:
            return body.max_completion_tokens
        return body.max_tokens

    async def chat_completions(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, api.ChatCompletionRequest)
        max_tokens = self.check_chat(body)
        tools = chat_tools(body, self.front.server)
        if tools.output.reads_special(self.front.special_tokens):
            body.skip_special_tokens = False  # the call markers are special tokens here
        ids = self.chat_ids(body, tools.template_tools)
        plan = reasoning.chat_reasoning(self.reasoning_parser, body, ids, self.front.decode)
        prompts = [
            Prompt(
                ids,
                self.sampling(
                    body,
                    max_tokens,
                    self.http.default_max_tokens(len(ids)),
                    body.logprobs,
                    body.top_logprobs or 0,
                    i,
                    plan,
                    tools.constraint,
                ),
            )
            for i in range(body.n)
        ]
        meta = (
            f"chatcmpl-{secrets.token_hex(12)}",
            int(time.time()),
            body.model or self.http.model_name,
        )
        result = await self.http.run_job(
            request,
            key,
            prompts,
            body.stream,
            lambda job, first: self.chat_stream(job, first, body, meta, plan, tools),
        )
        if body.stream:
            return result
        choices = [
            api.ChatChoice(
                i,
                *self.chat_message(c.text, c.finish_reason, plan, tools),
                self.chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                if body.logprobs
                else None,
            )
            for i, c in enumerate(result.choices)
        ]
        return json_response(api.ChatCompletion(*meta, choices, self.usage(result.choices, body.n)))

    @staticmethod
    def chat_message(
        text: str, finish_reason: str, plan: reasoning.ChatReasoning | None, tools: ChatTools
    ) -> tuple[api.AssistantMessage, str]:
        """A whole answer's message (reasoning split off first, then tool calls read from the
        content) and its finish reason."""
        thought, content = reasoning.Split("", text) if plan is None else plan.split(text)
        message, reason = tools.output.message(content, finish_reason)
        message.reasoning_content = thought or msgspec.UNSET
        return message, reason

    def chat_stream(
        self,
        job: Job,
        first,
        body: api.ChatCompletionRequest,
        meta,
        plan: reasoning.ChatReasoning | None,
        tools: ChatTools,
    ) -> AsyncIterator[bytes]:
        opts = body.stream_options or api.StreamOptions()
        started: set[int] = set()
        splits = reasoning.StreamSplits(plan)
        streams = [tools.output.stream() for _ in job.choices]

        def render(index: int, d) -> api.ChatCompletionChunk | None:
            thought, text = splits.feed(index, d.text, d.finish_reason is not None)
            text, calls, reason = streams[index].step(text, d.finish_reason)
            if not (
                text
                or thought
                or calls
                or reason is not None
                or index not in started
                or d.token_ids
                and body.logprobs
            ):
                return None  # text held back (a stop string or a tool call may begin there)
            delta = api.ChatDelta(
                content=None if (calls or thought) and not text else text,
                role=None if index in started else "assistant",
                reasoning_content=thought or None,
                tool_calls=calls or None,
            )
            started.add(index)
            lp = (
                self.chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)
                if body.logprobs
                else None
            )
            usage = self.usage(job.choices, body.n) if opts.continuous_usage_stats else None
            return api.ChatCompletionChunk(
                *meta, [api.ChatChunkChoice(index, delta, reason, lp)], usage
            )

        def tail() -> api.ChatCompletionChunk | None:
            return (
                api.ChatCompletionChunk(*meta, [], self.usage(job.choices, body.n))
                if opts.include_usage
                else None
            )

        return sse_events(job, first, render, tail)

    def chat_logprobs(
        self, ids: list[int], lps: list[float] | None, tops: list | None
    ) -> api.ChoiceLogprobs:
        content = []
        for j, (token, lp) in enumerate(zip(ids, lps or ())):
            top = []
            if tops:
                for t, tlp in zip(*tops[j]):
                    text = self.http.token_text(t)
                    top.append(api.TopLogprob(text, tlp, list(text.encode())))
            text = self.http.token_text(token)
            content.append(api.TokenLogprob(text, lp, list(text.encode()), top))
        return api.ChoiceLogprobs(content)

    @staticmethod
    def usage(choices: list[Choice], n: int) -> api.Usage:
        """Prompt and cached tokens once per prompt (the n choices of one share it), completion
        tokens of every choice."""
        prompt = cached = 0
        for start in range(0, len(choices), n):
            group = choices[start : start + n]
            prompt += max(c.prompt_tokens for c in group)
            cached += max(c.cached_tokens for c in group)
        completion = sum(len(c.token_ids) for c in choices)
        spec = {
            k: sum(c.spec.get(k, 0) for c in choices)
            for k in ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens")
        }
        return api.Usage(
            prompt, completion, prompt + completion, api.PromptTokensDetails(cached), **spec
        )

    # ------------------------------------------------------- completions

    def completion_prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """(ids, text) of each prompt: a string, strings, token ids, or lists of token ids."""

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

        if isinstance(prompt, str):
            return [(self.front.encode(prompt), prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [(self.front.encode(p), p) for p in prompt]
            if is_ids(prompt):
                return [(prompt, None)]
            if all(is_ids(p) for p in prompt):
                return [(p, None) for p in prompt]
        raise api.ApiError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list "
            "of lists of token ids (none empty)",
            ErrorCode.INVALID_REQUEST,
            "prompt",
        )

    async def completions(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, api.CompletionRequest)
        self.http.check_model(body.model)
        api.check_neutral(body)
        self.check_n(body.n)
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise api.ApiError(
                400,
                f"logprobs must be in [0, 20], got {body.logprobs}",
                ErrorCode.INVALID_REQUEST,
                "logprobs",
            )
        want_lp = body.logprobs is not None
        prompts = []
        for ids, text in self.completion_prompts(body.prompt):
            start = 1 if body.echo and want_lp and len(ids) > 1 else None
            for j in range(body.n):
                sp = self.sampling(body, body.max_tokens, 16, want_lp, body.logprobs or 0, j)
                prompts.append(Prompt(ids, sp, start, text))
        meta = (
            f"cmpl-{secrets.token_hex(12)}",
            int(time.time()),
            body.model or self.http.model_name,
        )
        result = await self.http.run_job(
            request,
            key,
            prompts,
            body.stream,
            lambda job, first: self.completion_stream(job, first, body, prompts, meta),
        )
        if body.stream:
            return result
        choices = []
        for i, (c, p) in enumerate(zip(result.choices, prompts)):
            head = self.echo_text(p) if body.echo else ""
            lp = self.completion_logprobs(c, p, body.echo) if want_lp else None
            choices.append(api.CompletionChoice(i, head + c.text, c.finish_reason, lp))
        return json_response(api.Completion(*meta, choices, self.usage(result.choices, body.n)))

    def echo_text(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.front.decode(p.ids)

    def completion_stream(
        self, job: Job, first, body: api.CompletionRequest, prompts: list[Prompt], meta
    ) -> AsyncIterator[bytes]:
        opts = body.stream_options or api.StreamOptions()
        started: set[int] = set()
        offsets = [0] * len(prompts)  # text offset of each choice's next token
        sent = [0] * len(prompts)  # tokens whose logprobs went out

        def render(index: int, d) -> api.Completion | None:
            c, p, first_chunk = job.choices[index], prompts[index], index not in started
            text = self.echo_text(p) + d.text if body.echo and first_chunk else d.text
            if not (text or d.finish_reason is not None or first_chunk):
                return None
            started.add(index)
            lp = None
            if body.logprobs is not None:
                lp = self.completion_logprobs(
                    c, p, body.echo and first_chunk, sent[index], offsets[index]
                )
                offsets[index] += sum(len(t) for t in lp.tokens)
                sent[index] = len(c.token_ids)
            usage = self.usage(job.choices, body.n) if opts.continuous_usage_stats else None
            return api.Completion(
                *meta, [api.CompletionChoice(index, text, d.finish_reason, lp)], usage
            )

        def tail() -> api.Completion | None:
            return (
                api.Completion(*meta, [], self.usage(job.choices, body.n))
                if opts.include_usage
                else None
            )

        return sse_events(job, first, render, tail)

    def completion_logprobs(
        self, c: Choice, p: Prompt, echo: bool, since: int = 0, offset: int = 0
    ) -> api.CompletionLogprobs:
        """Logprobs of c's tokens from ``since`` on, after the prompt's when ``echo`` (the
        prompt's first token has none); text offsets counted from ``offset``."""
        ids: list[int] = []
        lps: list[float | None] = []
        tops: list = []
        if echo:
            rest = len(p.ids) - 1
            ids += p.ids
            lps += [None, *(c.prompt_logprobs or [None] * rest)]
            tops += [None, *(c.prompt_top_logprobs or [None] * rest)]
        ids += c.token_ids[since:]
        lps += c.logprobs[since:]
        tops += c.top_logprobs[since:] or [None] * (len(c.token_ids) - since)
        tokens = [self.http.token_text(t) for t in ids]
        text_offset, pos = [], offset
        for t in tokens:
            text_offset.append(pos)
            pos += len(t)
        top_dicts = [
            None if top is None else {self.http.token_text(t): lp for t, lp in zip(*top)}
            for top in tops
        ]
        return api.CompletionLogprobs(tokens, lps, top_dicts, text_offset)
