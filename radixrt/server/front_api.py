"""What the HTTP front may ask of the front process: ``FrontApi``, and the errors it raises.

The HTTP handlers (``radixrt.server.http``) run inside the TokenizerManager
process, and see it only through this interface, which
``radixrt.server.front.Front`` implements: the settings and the model's
limits, API keys, the tokenizer and chat template, admitting requests with a
sink for their deltas, aborting them, control requests, health and metrics.
This module imports nothing else of ``radixrt.server``, so the HTTP package
depends on the rest of the server through it alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from radixrt.config import ServerConfig
from radixrt.sampling import SamplingParams


class RequestError(Exception):
    """A request refused or failed: ``code`` is a ``radixrt.protocol.ErrorCode``."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status  # the HTTP status, where the code alone does not decide it


@dataclass(frozen=True, slots=True)
class FrontStatus:
    """Whether the server takes requests: draining, and which replicas serve."""

    draining: bool
    replicas_up: tuple[int, ...]
    replicas_down: tuple[int, ...]


class FrontApi(Protocol):
    """The front process as its HTTP side sees it.

    A request's sink is an ``asyncio.Queue`` that receives ``(index,
    TextDelta)`` for each of its text deltas and ``(index, RequestError)``
    when it fails; the last delta has a ``finish_reason``.
    """

    special_tokens: tuple[str, ...]  # the texts of the tokenizer's special tokens

    @property
    def server(self) -> ServerConfig:
        """The server's settings."""

    @property
    def model(self) -> Mapping[str, Any]:
        """The model and its limits as the replicas reported them (``model``, ``model_name``,
        ``max_context``, ``vocab_size``, ``kv_slots``, ...)."""

    def authorized(self, key: str | None) -> bool:
        """Whether ``key`` may use the server (always, when it has no API key)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (with the tokenizer's special tokens, e.g. BOS, unless
        ``add_special_tokens`` is False)."""

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens kept)."""

    def chat_prompt(self, messages: list[dict], **template_kwargs: Any) -> str:
        """The chat template applied to ``messages``; RequestError when the template fails."""

    def limit_new_tokens(self, sp: SamplingParams, given: bool) -> SamplingParams:
        """``sp`` within ``max_new_tokens_limit`` (a default yields; a given value over it is
        refused with RequestError)."""

    def open_response(self, identity: bytes, req_id: str, count: int) -> None:
        """Admit ``count`` requests of one response from client ``identity`` (their ids start
        at ``req_id``), or raise RequestError; until ``close_response`` a drain waits for it."""

    def submit(
        self,
        identity: bytes,
        req_id: str,
        ids: list[int],
        sp: SamplingParams,
        *,
        api_key: str | None,
        logprob_start_len: int | None = None,
        stream: bool = False,
        sink: asyncio.Queue | None = None,
        index: int = 0,
        embed: bool = False,
    ) -> str:
        """Validate one request and send it to a replica; its server rid (RequestError if
        refused). ``embed``: an embedding request (no tokens; its final delta carries the
        embedding), whose ``sp`` counts for ``cache_salt`` only."""

    def abort(self, rid: str) -> None:
        """Stop a request still in flight and free its KV; nothing if it finished."""

    def close_response(self) -> None:
        """The response ``open_response`` admitted is written (or abandoned)."""

    def control(self, kind: str, replica: int = 0) -> asyncio.Future:
        """Ask the replicas (``server_info``, ``flush_cache``, ``health``, ``kv_snapshot``);
        the future gets the combined data, or a RequestError as its result."""

    def status(self) -> FrontStatus:
        """Draining, and which replicas serve."""

    def metrics(self, scheduler_stats: Mapping[str, Any]) -> bytes:
        """The Prometheus exposition, given a ``server_info`` answer (empty if none came)."""
