"""Where drafts come from: the ``Proposer`` protocol and the request's own tokens.

Contract:
- ``Proposer.propose(tokens, salt) -> DraftTree``: candidate continuations of ``tokens`` (a
  request's prompt and output so far, its last token last), drawn only from what ``salt``
  (the request's ``cache_salt``) may see; an empty tree when there is nothing to propose.
  A proposer reads: proposing changes nothing a request or the cache owns.
- ``make_proposer(config, cache)``: the proposer of ``config.speculative_algorithm``: for
  NGRAM, ``radixrt.spec.ngram.NgramProposer`` over the request's own tokens and, with the
  radix cache on, every sequence the cache holds (through an index it attaches to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixrt.cache.radix_cache import RadixCache
from radixrt.config import EngineConfig
from radixrt.spec.draft import DraftTree
from radixrt.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], salt: str | None) -> DraftTree:
        """Candidate continuations of ``tokens`` visible under ``salt`` (empty: none)."""
        ...


def make_proposer(config: EngineConfig, cache: RadixCache | None = None) -> Proposer:
    """The drafts of ``config.speculative_algorithm``. ``cache``: the scheduler's radix cache
    (None: the request's own tokens only)."""
    if config.speculative_algorithm != "NGRAM":
        raise ValueError(f"no proposer for speculative_algorithm {config.speculative_algorithm!r}")
    return NgramProposer(
        cache,
        config.draft_tokens,
        min_match_window=config.speculative_ngram_min_match_window_size,
        max_match_window=config.speculative_ngram_max_match_window_size,
        min_bfs_breadth=config.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=config.speculative_ngram_max_bfs_breadth,
        branch_length=config.speculative_ngram_branch_length,
    )
