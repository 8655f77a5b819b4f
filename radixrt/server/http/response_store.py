"""The stored responses of ``POST /v1/responses``: a bounded LRU, scoped per API key and salt.

Contract:
- ``ResponseStore(capacity)`` keeps at most ``capacity`` responses over every
  scope; storing one more evicts the least recently used (stored, read by
  ``get`` or continued by ``previous_response_id``).
- A response lives in the scope it was made in, ``(api_key, cache_salt)``:
  ``get`` and ``delete`` under any other scope find nothing, as if the id did
  not exist.
- ``StoredResponse`` holds what a next turn needs so that the client never
  resends the conversation: its chat messages (without the turn's
  ``instructions``, which OpenAI does not carry over), and the token ids the
  model saw (the prompt's, then the output's), with the text those ids stand
  for (``prompt_text`` + ``output_text``), so that the next turn's prompt can
  extend the same ids and hit the whole conversation in the radix tree.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

Scope = tuple[str | None, str | None]  # (API key, cache_salt) of the request that made it


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    body: Any  # the Response object GET returns
    messages: tuple[dict, ...]  # the conversation, ending with this turn's assistant message
    ids: array  # int32: the prompt's token ids, then the output's
    prompt_text: str  # the chat template's rendering that the prompt ids stand for
    output_text: str  # the output's text as generated (before any tool-call parsing)
    ends_with_stop: bool  # the last output id is the stop token that ended it


class ResponseStore:
    """Stored responses by (scope, id), least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a response store holds at least 1 response, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[tuple[Scope, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, scope: Scope, stored: StoredResponse) -> list[str]:
        """Store ``stored`` as the most recently used; the ids it evicted."""
        key = (scope, stored.id)
        self.entries[key] = stored
        self.entries.move_to_end(key)
        evicted = []
        while len(self.entries) > self.capacity:
            (_, old), _ = self.entries.popitem(last=False)
            evicted.append(old)
        return evicted

    def get(self, scope: Scope, response_id: str) -> StoredResponse | None:
        """The response stored under ``scope`` (now the most recently used), or None."""
        stored = self.entries.get((scope, response_id))
        if stored is not None:
            self.entries.move_to_end((scope, response_id))
        return stored

    def delete(self, scope: Scope, response_id: str) -> bool:
        """Remove the response stored under ``scope``; whether there was one."""
        return self.entries.pop((scope, response_id), None) is not None
