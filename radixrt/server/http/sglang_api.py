"""SGLang's native ``POST /generate``: ``text`` or ``input_ids`` (one prompt or a list),
``sampling_params`` with SGLang's names, optional logprobs; streams carry the cumulative
``text`` and ``output_ids`` of each prompt, as SGLang's do; ``meta_info`` has
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``cached_tokens_details`` (how
many of them were found on the device, in the host tier and in storage), ``finish_reason`` and
the speculative counters ``spec_verify_ct``, ``spec_draft_tokens``, ``spec_accepted_tokens``
(0 without ``--speculative-algorithm``).
The body may carry the fields SGLang's router adds (``model``, logging hints, SGLang's
output options at their defaults); a ``model`` other than the served one is a 404.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixrt.output import cached_tokens_details
from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.front_api import FrontApi
from radixrt.server.http import schemas as api
from radixrt.server.http.context import HttpContext
from radixrt.server.http.jobs import Choice, Job, Prompt, json_response, sse_events


class SGLangApi:
    def __init__(self, http: HttpContext, front: FrontApi) -> None:
        self.http, self.front = http, front  # the HTTP plumbing, and the front process

    # -------------------------------------------------- SGLang /generate

    def sglang_params(self, raw: Any, body: api.GenerateReqInput) -> SamplingParams:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise api.ApiError(
                400,
                "sampling_params must be an object (or a list of them, one per prompt)",
                ErrorCode.INVALID_REQUEST,
                "sampling_params",
            )
        fields = dict(raw)
        neutral = {
            "n": 1,
            "spaces_between_special_tokens": True,
            "no_stop_trim": False,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_new_tokens": 0,
        }
        for name, value in neutral.items():
            if name in fields and fields.pop(name) != value:
                raise api.ApiError(
                    400,
                    f"sampling_params.{name}={raw[name]!r} is not supported by this server",
                    ErrorCode.INVALID_REQUEST,
                    "sampling_params",
                )
        if "sampling_seed" in fields:
            fields["seed"] = fields.pop("sampling_seed")
        known = set(SamplingParams.__dataclass_fields__) - {"logprobs", "top_logprobs"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise api.ApiError(
                400,
                f"unknown sampling_params {unknown}",
                ErrorCode.INVALID_REQUEST,
                "sampling_params",
            )
        fields.update(
            logprobs=body.return_logprob,
            top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
        )
        return self.http.make_params(fields, given="max_new_tokens" in fields)

    def sglang_prompts(self, body: api.GenerateReqInput) -> tuple[list[Prompt], bool]:
        """The prompts of a /generate body, and whether it was a batch."""
        if (body.text is None) == (body.input_ids is None):
            raise api.ApiError(
                400, "pass exactly one of text and input_ids", ErrorCode.INVALID_REQUEST, "text"
            )
        if body.text is not None:
            batch = isinstance(body.text, list)
            texts = body.text if batch else [body.text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise api.ApiError(
                    400,
                    "text must be a string or a non-empty list of strings",
                    ErrorCode.INVALID_REQUEST,
                    "text",
                )
            ids = [self.front.encode(t) for t in texts]
        else:
            x = body.input_ids
            batch = isinstance(x, list) and bool(x) and all(isinstance(p, list) for p in x)
            ids = x if batch else [x]
            if not all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in ids):
                raise api.ApiError(
                    400,
                    "input_ids must be a list of token ids or a list of such lists",
                    ErrorCode.INVALID_REQUEST,
                    "input_ids",
                )
        raw = body.sampling_params
        per = raw if isinstance(raw, list) else [raw] * len(ids)
        if len(per) != len(ids):
            raise api.ApiError(
                400,
                f"{len(per)} sampling_params for {len(ids)} prompts",
                ErrorCode.INVALID_REQUEST,
                "sampling_params",
            )
        start = None
        if body.return_logprob and body.logprob_start_len >= 0:
            start = max(1, body.logprob_start_len)
        return [
            Prompt(
                p,
                self.sglang_params(r, body),
                start if start is not None and start < len(p) else None,
            )
            for p, r in zip(ids, per)
        ], batch

    async def generate(self, request: Request, key: str | None) -> Response:
        body = await self.http.read(request, api.GenerateReqInput)
        self.http.check_model(body.model)
        api.refuse_unsupported(body, api.GENERATE_NEUTRAL)
        prompts, batch = self.sglang_prompts(body)
        t0 = time.monotonic()
        result = await self.http.run_job(
            request,
            key,
            prompts,
            body.stream,
            lambda job, first: self.generate_stream(job, first, body, prompts, t0),
        )
        if body.stream:
            return result
        outs = [self.sglang_output(i, result, p, body, t0) for i, p in enumerate(prompts)]
        return json_response(outs if batch else outs[0])

    def sglang_output(
        self, index: int, job: Job, p: Prompt, body: api.GenerateReqInput, t0: float
    ) -> dict:
        c = job.choices[index]
        reason = c.finish_reason
        finish = None
        if reason == "length":
            finish = {"type": "length", "length": len(c.token_ids)}
        elif reason == "stop":
            finish = {"type": "stop", "matched": c.token_ids[-1] if c.token_ids else None}
        elif reason is not None:
            finish = {"type": reason, "message": None}
        meta = {
            "id": job.rids[index],
            "finish_reason": finish,
            "prompt_tokens": len(p.ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens,
            "cached_tokens_details": cached_tokens_details(c.cached_tokens, c.cached_below),
            "e2e_latency": time.monotonic() - t0,
            **c.spec,
        }
        if body.return_logprob:
            meta.update(self.logprobs(c, p, body))
        return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta, "index": index}

    def logprobs(self, c: Choice, p: Prompt, body: api.GenerateReqInput) -> dict:
        """SGLang's logprob fields: ``[logprob, token id, token text or None]`` per token."""

        def entry(lp: float | None, token: int) -> list:
            return [
                lp,
                token,
                self.http.token_text(token) if body.return_text_in_logprobs else None,
            ]

        def tops(top_lists: list | None) -> list:
            return (
                [[entry(lp, t) for t, lp in zip(*top)] for top in top_lists or ()]
                if body.top_logprobs_num
                else []
            )

        out = {
            "output_token_logprobs": [entry(lp, t) for lp, t in zip(c.logprobs, c.token_ids)],
            "output_top_logprobs": tops(c.top_logprobs),
        }
        if p.logprob_start_len is not None:
            first = [entry(None, p.ids[0])] if body.logprob_start_len == 0 else []
            scored = p.ids[p.logprob_start_len :]
            out["input_token_logprobs"] = first + [
                entry(lp, t) for lp, t in zip(c.prompt_logprobs or (), scored)
            ]
            out["input_top_logprobs"] = [None] * len(first) + tops(c.prompt_top_logprobs)
        return out

    def generate_stream(
        self, job: Job, first, body: api.GenerateReqInput, prompts: list[Prompt], t0: float
    ) -> AsyncIterator[bytes]:
        return sse_events(
            job, first, lambda index, d: self.sglang_output(index, job, prompts[index], body, t0)
        )
