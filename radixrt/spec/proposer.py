"""Where drafts come from: the ``Proposer`` protocol and the request's own tokens.

Contract:
- ``Proposer.propose(tokens, salt) -> DraftTree``: candidate continuations of ``tokens`` (a
  request's prompt and output so far, its last token last), drawn only from what ``salt``
  (the request's ``cache_salt``) may see; an empty tree when there is nothing to propose.
  A proposer reads: proposing changes nothing a request or the cache owns.
- ``OwnTokensProposer``: the longest suffix of ``tokens`` of ``min_window`` to ``max_window``
  tokens that occurred earlier in ``tokens`` (the latest such occurrence on a tie); its
  continuation there, up to ``max_tokens`` tokens, is one chain. Where the continuation
  reaches the end of ``tokens`` it goes on as the draft itself predicts (a repeat of period
  ``len(tokens) - 1 - end of the occurrence``). Costs O(len(tokens)) per call, vectorised.
- ``FirstProposal(proposers)``: the first non-empty tree of several sources, in order.
- ``make_proposer(config, cache)``: the proposer of ``config.speculative_algorithm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from radixrt.config import EngineConfig
from radixrt.spec.draft import DraftTree


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], salt: str | None) -> DraftTree:
        """Candidate continuations of ``tokens`` visible under ``salt`` (empty: none)."""
        ...


class OwnTokensProposer:
    """Drafts a chain from an earlier occurrence of the request's own latest tokens."""

    def __init__(self, max_tokens: int, min_window: int = 1, max_window: int = 12) -> None:
        if not 1 <= min_window <= max_window or max_tokens < 1:
            raise ValueError(
                f"OwnTokensProposer needs 1 <= min_window <= max_window and max_tokens >= 1, got "
                f"{min_window}, {max_window}, {max_tokens}"
            )
        self.max_tokens, self.min_window, self.max_window = max_tokens, min_window, max_window

    def propose(self, tokens: Sequence[int], salt: str | None) -> DraftTree:
        ids = np.asarray(tokens, dtype=np.int64)
        end = self._occurrence(ids)
        if end is None:
            return DraftTree()
        after = ids[end + 1 :].tolist()  # what followed the occurrence: never empty
        return DraftTree.chain([after[t % len(after)] for t in range(self.max_tokens)])

    def _occurrence(self, ids: np.ndarray) -> int | None:
        """Where the longest earlier occurrence of the suffix ends (the latest among equals);
        None below ``min_window`` tokens."""
        n = len(ids)
        if n < self.min_window + 1:
            return None
        ends = np.flatnonzero(ids[:-1] == ids[-1])  # [c] candidate ends, ascending
        if ends.size == 0:
            return None
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for w in range(1, min(self.max_window, n - 1)):
            back = ends - w
            alive &= back >= 0
            alive[alive] = ids[back[alive]] == ids[n - 1 - w]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_window:
            return None
        return int(ends[np.flatnonzero(length == best)[-1]])


class FirstProposal:
    """The first non-empty draft of ``proposers``, asked in order."""

    def __init__(self, proposers: Sequence[Proposer]) -> None:
        self.proposers = list(proposers)

    def propose(self, tokens: Sequence[int], salt: str | None) -> DraftTree:
        for proposer in self.proposers:
            tree = proposer.propose(tokens, salt)
            if len(tree):
                return tree
        return DraftTree()


def make_proposer(config: EngineConfig, cache=None) -> Proposer:
    """The drafts of ``config.speculative_algorithm`` ("NGRAM": the request's own tokens).
    ``cache``: the scheduler's radix cache, for a proposer that indexes it."""
    if config.speculative_algorithm != "NGRAM":
        raise ValueError(f"no proposer for speculative_algorithm {config.speculative_algorithm!r}")
    return OwnTokensProposer(
        config.draft_tokens,
        config.speculative_ngram_min_match_window_size,
        config.speculative_ngram_max_match_window_size,
    )
