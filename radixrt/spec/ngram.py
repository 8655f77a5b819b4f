"""N-gram drafts (``speculative_algorithm="NGRAM"``): from the request's own tokens and the tree.

Contract:
- ``NgramProposer(cache_or_index, num_draft_tokens, ...)`` reads a ``RadixCache`` through an
  ``NgramIndex`` (made and attached here when given the cache; None: the request's own tokens
  only). ``propose(tokens, salt)`` returns a ``DraftTree`` of at most ``num_draft_tokens`` tokens
  to follow ``tokens`` (the request's prompt and output so far), empty when nothing matches. It
  changes nothing: not the tree, not its access times.
- Matching: for n from ``max_match_window`` down to ``min_match_window`` (at most
  ``len(tokens)``), the occurrences of the last n tokens (a) earlier in ``tokens``, ending before
  its last token, and (b) among the tree's positions under ``salt`` (never another salt's). Each
  occurrence counts once, at its longest window; per window and source at most ``max_matches``
  are examined, the latest first. Its *continuations*: (a) the tokens after it in ``tokens``; (b)
  the tokens after it in the tree, forking into the most recently used children
  (``tree_continuations``, at most ``max_bfs_breadth`` paths). All are cut at ``branch_length``
  tokens (at most ``num_draft_tokens``) and merged into one trie. Shorter windows are tried
  only while the trie holds fewer than ``num_draft_tokens`` tokens.
- Ranking: a token's rank is (the longest window it continues, how many continuations pass
  through it, its recency: the tree node's ``last_access``; the request's own tokens rank as more
  recent than anything cached, later ones more). The best ``num_draft_tokens`` are kept, parents
  before children, at most ``breadth`` children per token; the tree lists them depth first, best
  child first, so ``branches()[0]`` is the best continuation taken greedily.
- Breadth (SGLang's BFS breadth): a match of window n allows ``min_bfs_breadth + (max_match_window
  - n - depth) * scale`` children at depth ``depth`` (scale = (max_bfs_breadth - min_bfs_breadth)
  / (max_match_window - min_match_window + 1)), never fewer than ``min_bfs_breadth``: shorter,
  less certain matches branch wider, and every match narrows with depth.

Settings are SGLang's ``--speculative-num-draft-tokens`` and ``--speculative-ngram-{min,max}-
match-window-size`` / ``-{min,max}-bfs-breadth`` / ``-branch-length`` (here: the most tokens one
occurrence continues with), with one difference: ``num_draft_tokens`` counts the proposed tokens
only (SGLang's also counts the verified tree's root, the last token). SGLang's ``-match-type``,
``-max-trie-depth`` and ``-capacity`` have no counterpart: ranking is fixed, and the tree is the
store.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np
import torch

from radixrt.cache.radix_cache import RadixCache
from radixrt.spec.draft import DraftTree
from radixrt.spec.ngram_index import NgramIndex, suffix_keys, tree_continuations

_OWN_RECENCY = 1 << 62  # the request's own tokens: more recent than any cache clock


class NgramProposer:
    """Drafts from n-gram matches in the request's tokens and the radix tree."""

    def __init__(
        self,
        cache_or_index: RadixCache | NgramIndex | None,
        num_draft_tokens: int,
        min_match_window: int = 1,
        max_match_window: int = 12,
        min_bfs_breadth: int = 1,
        max_bfs_breadth: int = 10,
        max_matches: int = 16,
        branch_length: int | None = None,
    ) -> None:
        """``max_matches``: occurrences examined per window and source (the lookup's bound);
        ``branch_length``: the most tokens taken after one occurrence (default: no more than
        ``num_draft_tokens``)."""
        _check_settings(
            num_draft_tokens, min_match_window, max_match_window, min_bfs_breadth, max_bfs_breadth
        )
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if branch_length is not None and branch_length < 1:
            raise ValueError(f"speculative_ngram_branch_length must be >= 1, got {branch_length}")
        self.num_draft_tokens = num_draft_tokens
        self.branch_length = min(num_draft_tokens, branch_length or num_draft_tokens)
        self.min_match_window = min_match_window
        self.max_match_window = max_match_window
        self.min_bfs_breadth = min_bfs_breadth
        self.max_bfs_breadth = max_bfs_breadth
        self.max_matches = max_matches
        self._scale = (max_bfs_breadth - min_bfs_breadth) / (
            max_match_window - min_match_window + 1
        )
        if isinstance(cache_or_index, RadixCache):
            cache_or_index = NgramIndex(cache_or_index, min_match_window, max_match_window)
        elif cache_or_index is not None and not (
            cache_or_index.min_window <= min_match_window
            and max_match_window <= cache_or_index.max_window
        ):
            raise ValueError(
                f"the index holds windows {cache_or_index.min_window}..{cache_or_index.max_window}"
                f", not {min_match_window}..{max_match_window}"
            )
        self.index: NgramIndex | None = cache_or_index

    def breadth(self, window: int, depth: int) -> int:
        """Children allowed at ``depth`` (0: the first draft token) below a match of ``window``."""
        wide = self.min_bfs_breadth + (self.max_match_window - window - depth) * self._scale
        return max(self.min_bfs_breadth, int(wide))

    def propose(
        self, tokens: Sequence[int] | np.ndarray | torch.Tensor, salt: str | None = None
    ) -> DraftTree:
        """The draft to follow ``tokens`` (see the module docstring)."""
        arr = _int64_array(tokens)
        if not self._may_match(arr, salt):
            return DraftTree()
        trie, budget = _DraftTrie(), self.num_draft_tokens
        own = own_matches(arr, self.min_match_window, self.max_match_window)
        keys = {}
        if self.index is not None:
            keys = suffix_keys(arr, self.min_match_window, self.max_match_window)
        seen: set[int] = set()
        for n in range(min(self.max_match_window, arr.size), self.min_match_window - 1, -1):
            for p in own[n][: self.max_matches].tolist() if n in own else ():
                follow = arr[p + 1 : p + 1 + self.branch_length].tolist()
                trie.add(follow, n, [_OWN_RECENCY + p] * len(follow))
            if self.index is not None:
                self._add_cached(trie, arr, keys[n], salt, n, seen)
            if len(trie) >= budget:
                break
        return trie.select(budget, self.breadth)

    def _may_match(self, arr: np.ndarray, salt: str | None) -> bool:
        """Whether the last ``min_match_window`` tokens occur earlier in ``arr`` or (by hash) in
        the tree: every match of any window contains such an occurrence, so False means the
        draft is empty (the common case on text that does not repeat, answered cheaply)."""
        m = self.min_match_window
        if arr.size <= m:
            return self.index is not None and arr.size == m and self._index_holds(arr, m, salt)
        ends = np.flatnonzero(arr[m - 1 : -1] == arr[-1]) + (m - 1)
        for j in range(1, m):
            if not ends.size:
                break
            ends = ends[arr[ends - j] == arr[-1 - j]]
        return bool(ends.size) or (self.index is not None and self._index_holds(arr, m, salt))

    def _index_holds(self, arr: np.ndarray, m: int, salt: str | None) -> bool:
        return self.index.holds(suffix_keys(arr, m, m)[m], salt, m)

    def _add_cached(
        self, trie: _DraftTrie, arr: np.ndarray, key: int, salt: str | None, n: int, seen: set
    ) -> None:
        """Merge the tree's continuations of the window-``n`` suffix into ``trie``."""
        found = self.index.matches(arr, key, salt, n, self.max_matches, seen)
        for node, idx in found:
            paths = tree_continuations(
                node, idx, self.branch_length, lambda d: self.breadth(n, d), self.max_bfs_breadth
            )
            for path, recency in paths:
                trie.add(path, n, recency)


def own_matches(tokens: np.ndarray, min_window: int, max_window: int) -> dict[int, np.ndarray]:
    """Window n -> the end positions p < len(tokens) - 1 whose longest match with the end of
    ``tokens`` is n tokens (``tokens[p-n+1 : p+1] == tokens[-n:]``; n capped at ``max_window``),
    latest first. Vectorized: O(len(tokens)) plus O(candidates x max_window)."""
    size = tokens.size
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.arange(ends.size)
    for j in range(1, min(max_window, size)):
        if not alive.size:
            break
        before = ends[alive] - j
        keep = before >= 0
        keep[keep] = tokens[before[keep]] == tokens[size - 1 - j]
        alive = alive[keep]
        length[alive] += 1
    groups = {}
    for n in range(min_window, max_window + 1):
        found = ends[length == n]
        if found.size:
            groups[n] = found[::-1]
    return groups


class _DraftTrie:
    """Candidate continuations merged by token; node 0 is the root (the request's last token)."""

    def __init__(self) -> None:
        self.token = [-1]
        self.parent = [-1]
        self.depth = [-1]
        self.children: list[dict[int, int]] = [{}]
        self.window = [0]  # the longest match a continuation through the node came from
        self.count = [0]  # continuations through the node
        self.recency = [0]  # the latest access of the tree nodes (or own positions) behind it

    def __len__(self) -> int:
        return len(self.token) - 1

    def add(self, tokens: list[int], window: int, recency: list[int]) -> None:
        node = 0
        self.window[0] = max(self.window[0], window)
        for token, when in zip(tokens, recency):
            child = self.children[node].get(token)
            if child is None:
                child = len(self.token)
                self.children[node][token] = child
                self.token.append(token)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
                self.children.append({})
                self.window.append(window)
                self.count.append(0)
                self.recency.append(when)
            self.count[child] += 1
            self.window[child] = max(self.window[child], window)
            self.recency[child] = max(self.recency[child], when)
            node = child

    def _rank(self, node: int) -> tuple[int, int, int, int]:
        """Smaller is better: longer window, more continuations, more recent, then added first."""
        return (-self.window[node], -self.count[node], -self.recency[node], node)

    def select(self, budget: int, breadth: Callable[[int, int], int]) -> DraftTree:
        """The best ``budget`` nodes (a parent before its children, at most ``breadth(window,
        depth + 1)`` children per node) as a DraftTree, depth first, best child first."""
        taken = [0] * len(self.token)
        kept: set[int] = set()
        heap = [self._rank(c) for c in self.children[0].values()]
        heapq.heapify(heap)
        while heap and len(kept) < budget:
            node = heapq.heappop(heap)[-1]
            parent = self.parent[node]
            if taken[parent] >= breadth(self.window[parent], self.depth[parent] + 1):
                continue
            taken[parent] += 1
            kept.add(node)
            for child in self.children[node].values():
                heapq.heappush(heap, self._rank(child))
        return self._emit(kept)

    def _emit(self, kept: set[int]) -> DraftTree:
        tokens, parents = [], []
        stack = [(c, -1) for c in self._kept_children(0, kept)]
        while stack:
            node, parent = stack.pop()
            parents.append(parent)
            tokens.append(self.token[node])
            stack.extend((c, len(tokens) - 1) for c in self._kept_children(node, kept))
        return DraftTree(tokens, parents)

    def _kept_children(self, node: int, kept: set[int]) -> list[int]:
        """Kept children of ``node``, worst first (the order a stack pops best first)."""
        return sorted((c for c in self.children[node].values() if c in kept), key=self._rank)[::-1]


def _check_settings(
    num_draft_tokens: int, min_window: int, max_window: int, min_breadth: int, max_breadth: int
) -> None:
    if num_draft_tokens < 1:
        raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if not 1 <= min_window <= max_window:
        raise ValueError(
            "speculative_ngram_min_match_window_size and _max_match_window_size need "
            f"1 <= min <= max, got {min_window} and {max_window}"
        )
    if not 1 <= min_breadth <= max_breadth:
        raise ValueError(
            "speculative_ngram_min_bfs_breadth and _max_bfs_breadth need 1 <= min <= max, "
            f"got {min_breadth} and {max_breadth}"
        )


def _int64_array(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.cpu().numpy()
    arr = np.asarray(tokens)
    if arr.dtype != np.int64:
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    return arr.reshape(-1)
