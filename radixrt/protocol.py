"""Messages exchanged between radixrt components.

Every message is a ``msgspec.Struct``; the server issue adds the wire union.
"""

from __future__ import annotations

import msgspec


class GenerateOutput(msgspec.Struct, kw_only=True):
    """The result of one generation request."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[float] | None = None
