"""Admission: who may ask, and what a request must be to reach a replica.

- API keys: with ``api_key`` (one key, or several separated by commas) every
  request must carry one of them (compared in constant time);
  ``isolate_by_api_key`` prefixes each request's ``cache_salt`` with a hash of
  its key, so tenants never share cached prefixes.
- Text: the tokenizer, and the chat template for ``messages`` (a template
  error is the request's fault: ``invalid_request``).
- Limits: a client may have ``max_requests_per_client`` requests in flight;
  ``max_new_tokens`` is capped at ``max_new_tokens_limit`` (an explicit value
  over it is refused); a prompt must be non-empty, within
  ``max_prompt_tokens``, shorter than the context and the KV pool, and made of
  ids in the vocabulary; no new request is taken while the server drains, nor
  one whose ``req_id`` the client already has in flight.

Every refusal is a ``RequestError`` with its ``ErrorCode``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from radixrt.config import ServerConfig
from radixrt.protocol import ErrorCode
from radixrt.sampling import SamplingParams
from radixrt.server.drain import Drain
from radixrt.server.front_api import RequestError
from radixrt.server.request_table import RequestTable


class Admission:
    def __init__(
        self, server: ServerConfig, tokenizer: Any, requests: RequestTable, drain: Drain
    ) -> None:
        self.server, self.tokenizer = server, tokenizer
        self.requests, self.drain = requests, drain
        self.api_keys = server.api_keys  # derived once: checked on every request

    def authorized(self, key: str | None) -> bool:
        if not self.api_keys:
            return True
        given = (key or "").encode()
        return any(hmac.compare_digest(given, k) for k in self.api_keys)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: list[dict], **template_kwargs: Any) -> str:
        """The chat template applied to messages, ending with the assistant's turn."""
        template_kwargs.setdefault("add_generation_prompt", True)
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
        except Exception as e:  # a template error is the request's fault
            raise RequestError(ErrorCode.INVALID_REQUEST, f"chat template failed: {e}") from None

    def check(self, identity: bytes, req_id: str, count: int = 1) -> None:
        """Raise unless ``count`` new requests from this client may start now."""
        if self.drain.requested:
            raise RequestError(
                ErrorCode.SHUTTING_DOWN, "the server is shutting down; no new requests"
            )
        if self.requests.rid_of(identity, req_id) is not None:
            raise RequestError(ErrorCode.DUPLICATE_RID, f"request {req_id!r} is already in flight")
        per_client = self.server.max_requests_per_client
        in_flight = self.requests.in_flight(identity)
        if in_flight + count > per_client:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"this client has {in_flight} requests in flight; the limit is {per_client}",
                status=429,
            )

    def limit_new_tokens(self, sp: SamplingParams, given: bool) -> SamplingParams:
        """Apply ``max_new_tokens_limit``: a default yields to it, an explicit value over it is
        refused."""
        limit = self.server.max_new_tokens_limit
        if not given:
            sp.max_new_tokens = min(sp.max_new_tokens, limit)
        if sp.max_new_tokens > limit:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"max_new_tokens {sp.max_new_tokens} is over the server's limit of {limit}",
            )
        return sp

    def isolate(self, sp: SamplingParams, api_key: str | None) -> SamplingParams:
        """With ``isolate_by_api_key``: ``sp`` salted with a hash of its key (and its own
        salt), so tenants never share cached prefixes."""
        if not self.server.isolate_by_api_key:
            return sp
        tenant = hashlib.sha256(f"{api_key}\0{sp.cache_salt or ''}".encode()).hexdigest()
        return dataclasses.replace(sp, cache_salt=f"tenant:{tenant[:32]}")

    def validate(
        self, ids: list[int], logprob_start_len: int | None, limits: Mapping[str, Any]
    ) -> None:
        """Raise unless the prompt fits the server's and the model's ``limits``."""
        if not ids:
            raise RequestError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        cap = self.server.max_prompt_tokens
        n = len(ids)
        if cap is not None and n > cap:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {n} tokens; the server accepts at most {cap}",
            )
        if n >= limits["max_context"]:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {n} tokens; the context is {limits['max_context']} tokens",
            )
        if n >= limits["kv_slots"]:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {n} tokens; the KV pool holds {limits['kv_slots']}",
            )
        vocab = limits["vocab_size"]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, f"token ids outside [0, {vocab}): {bad[:5]}"
            )
        start = logprob_start_len
        if start is not None and not 1 <= start < n:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"logprob_start_len {start} is outside [1, {n}) for a {n}-token prompt",
            )
