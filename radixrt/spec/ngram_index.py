"""Where each short run of tokens occurs in a radix tree: the index n-gram drafting reads.

Contract:
- ``NgramIndex(cache, min_window, max_window)`` sets itself as ``cache.observer`` and indexes what
  the tree holds already; from then on the tree's inserts, splits, evictions and resets keep it
  current (``detach`` stops that). It changes nothing the cache owns and only reads keys, parents,
  children and access times. A new leaf costs O(its tokens x windows), an evicted leaf the same,
  a split O(the pieces of one run) (each also walks up for ``max_window - 1`` tokens of context).
- A *position* is one token of the tree. For every position at depth >= k below its root or
  namespace, and every window k in ``min_window..max_window``, the index holds the k tokens ending
  there (hashed), in the table of the position's salt. Nothing else: an evicted leaf's positions
  leave with it, and a reset empties the index.
- ``matches`` finds the positions whose k tokens equal the last k of a request's, under one salt;
  each candidate is compared token for token with the tree, so a hash collision is never
  returned. ``tree_continuations`` reads what follows a position from the tree itself.

Positions survive splits: a *run* is the key of a leaf as it was inserted, and a position is
(run, offset in the run). A split cuts a run into pieces, a chain of nodes parent to child, and
moves no position; only a run's last piece can be a leaf, so eviction takes runs from the end.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable

import numpy as np

from radixrt.cache.radix_cache import _TOKEN_BYTES, NamespaceNode, RadixCache, TreeNode

_RUN_SHIFT = 40  # a position is (run id << _RUN_SHIFT) | offset in the run
_OFFSET_MASK = (1 << _RUN_SHIFT) - 1
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: a token's mix is a bijection of its int64 bits
_MIX_SHIFT = np.uint64(29)
_OFFSET = np.uint64(0x2545F4914F6CDD1D)  # so that no token (0 included) mixes to 0
_BASE = np.uint64(0x100000001B3)  # the polynomial hash's base (odd), mod 2**64

_MASK = (1 << 64) - 1
_MIX_INT, _MIX_SHIFT_INT, _OFFSET_INT, _BASE_INT = (
    int(_MIX),
    int(_MIX_SHIFT),
    int(_OFFSET),
    int(_BASE),
)

# A table maps a gram's hash to one position, or to several (a dict in insertion order).
Bucket = int | dict[int, None]


def gram_hashes(
    seq: np.ndarray, first: int, min_window: int, max_window: int
) -> list[tuple[int, int, np.ndarray]]:
    """Hashes of the grams ending at ``seq[first:]`` (int64 tokens; ``seq[:first]`` is context).

    Returns (k, lo, hashes) per window k in ``min_window..max_window`` that has a whole gram:
    ``hashes[j]`` is the hash of ``seq[first + lo + j - k + 1 : first + lo + j + 1]``. Grams that
    would start before ``seq[0]`` are left out (``lo`` skips them). Arithmetic is mod 2**64.
    """
    x = (np.ascontiguousarray(seq, dtype=np.int64).view(np.uint64) + _OFFSET) * _MIX
    x ^= x >> _MIX_SHIFT
    n = len(seq) - first
    h = np.zeros(n, dtype=np.uint64)
    out = []
    for k in range(1, max_window + 1):
        lo = max(0, k - 1 - first)  # the first position with k tokens behind it
        if lo >= n:
            break
        h[lo:] = h[lo:] * _BASE + x[first + lo - k + 1 : first + n - k + 1]
        if k >= min_window:
            out.append((k, lo, h[lo:].copy()))
    return out


def suffix_keys(tokens: np.ndarray, min_window: int, max_window: int) -> dict[int, int]:
    """window k -> the hash of the last k tokens, for each k the tokens are long enough for
    (``gram_hashes``' arithmetic on Python ints: a handful of tokens per call)."""
    keys, h = {}, 0
    for k, token in enumerate(reversed(tokens[-max_window:].tolist()), 1):
        x = ((token + _OFFSET_INT) * _MIX_INT) & _MASK
        x ^= x >> _MIX_SHIFT_INT
        h = (h * _BASE_INT + x) & _MASK
        if k >= min_window:
            keys[k] = h
    return keys


class _Run:
    """One inserted leaf key, as the chain of nodes that holds it now (``starts`` ascending)."""

    __slots__ = ("id", "salt", "starts", "nodes")

    def __init__(self, run_id: int, salt: str | None, node: TreeNode) -> None:
        self.id = run_id
        self.salt = salt
        self.starts = [0]  # offset in the run of each piece's first token
        self.nodes = [node]  # the pieces, parent to child


class NgramIndex:
    """The grams of every position of one radix tree, per salt (see the module docstring)."""

    def __init__(self, cache: RadixCache, min_window: int = 1, max_window: int = 12) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(
                f"n-gram windows need 1 <= min_window <= max_window, got {min_window}, {max_window}"
            )
        if cache.observer is not None:
            raise ValueError(f"the cache already has an observer: {cache.observer!r}")
        self.cache = cache
        self.min_window = min_window
        self.max_window = max_window
        self._clear()
        cache.observer = self
        stack = list(cache.root.children.values())
        while stack:  # parents before children: a node's salt comes from its parent's run
            node = stack.pop()
            if node._key:
                self.on_stored(node)
            stack.extend(node.children.values())

    def detach(self) -> None:
        """Stop observing the cache and forget everything."""
        if self.cache.observer is self:
            self.cache.observer = None
        self._clear()

    @property
    def num_entries(self) -> int:
        """(gram, position) pairs held, over all salts and windows."""
        return sum(
            1 if type(b) is int else len(b)
            for tables in self._tables.values()
            for table in tables
            for b in table.values()
        )

    # ------------------------------------------------------------ observer

    def on_stored(self, leaf: TreeNode) -> None:
        """A new leaf: a run of its own, every gram ending in it indexed."""
        run = _Run(self._next_run, self._salt_below(leaf.parent), leaf)
        self._next_run += 1
        self._runs[run.id] = run
        self._where[leaf.id] = (run, 0)
        self._update(leaf, run.id << _RUN_SHIFT, run.salt, add=True)

    def on_split(self, upper: TreeNode, child: TreeNode) -> None:
        """``upper`` takes the first piece of ``child``'s place in its run; no position moves."""
        run, start = self._where[child.id]
        i = bisect.bisect_left(run.starts, start)
        run.nodes[i] = upper
        run.starts.insert(i + 1, start + upper.num_tokens)
        run.nodes.insert(i + 1, child)
        self._where[upper.id] = (run, start)
        self._where[child.id] = (run, start + upper.num_tokens)

    def on_removed(self, leaf: TreeNode) -> None:
        """An evicted leaf (its run's last piece): its positions leave the index."""
        run, start = self._where.pop(leaf.id)
        assert run.nodes[-1] is leaf, f"{leaf!r} evicted before the rest of its run"
        self._update(leaf, (run.id << _RUN_SHIFT) + start, run.salt, add=False)
        run.starts.pop()
        run.nodes.pop()
        if not run.nodes:
            del self._runs[run.id]

    def on_cleared(self) -> None:
        self._clear()

    # ------------------------------------------------------------ lookup

    def holds(self, key: int, salt: str | None, window: int) -> bool:
        """Whether some position under ``salt`` has a ``window``-token gram hashing to ``key``
        (a hash match only: ``matches`` compares the tokens)."""
        tables = self._tables.get(salt)
        if tables is None or not self.min_window <= window <= self.max_window:
            return False
        return key in tables[window - self.min_window]

    def matches(
        self, tokens: np.ndarray, key: int, salt: str | None, window: int, limit: int, seen: set
    ) -> list[tuple[TreeNode, int]]:
        """Positions (node, index in its key) where the last ``window`` tokens of ``tokens``
        occur under ``salt``; ``key`` is their hash (``suffix_keys``).

        The most recently inserted come first; at most ``limit`` positions not in ``seen`` are
        examined (and added to it), so a position found at a longer window is not counted again.
        """
        tables = self._tables.get(salt)
        if tables is None or not self.min_window <= window <= self.max_window:
            return []
        bucket = tables[window - self.min_window].get(key)
        if bucket is None:
            return []
        want = tokens[-window:].tobytes()
        found, examined = [], 0
        for pos in (bucket,) if type(bucket) is int else reversed(bucket):
            if examined == limit:
                break
            if pos in seen:
                continue
            seen.add(pos)
            examined += 1
            node, idx = self._resolve(pos)
            if _ends_with(node, idx, want):
                found.append((node, idx))
        return found

    def check_integrity(self) -> None:
        """Assert the index holds exactly the grams of the tree's positions, and that every run
        is a chain of the tree's nodes; raises AssertionError."""
        want, nodes = set(), set()
        stack = list(self.cache.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node._key:
                continue
            nodes.add(node.id)
            salt = _salt_of(node)
            seq, first = self._with_context(node)
            for k, lo, hashes in gram_hashes(seq, first, self.min_window, self.max_window):
                want.update((salt, k, h, node.id, lo + j) for j, h in enumerate(hashes.tolist()))
        assert set(self._where) == nodes, "the index's nodes are not the tree's"
        for run in self._runs.values():
            self._check_run(run)
        have = set()
        for salt, tables in self._tables.items():
            assert any(tables), f"salt {salt!r} left with empty tables"
            for k, table in enumerate(tables, self.min_window):
                for h, bucket in table.items():
                    assert type(bucket) is int or len(bucket) > 1, "a bucket of one left as a dict"
                    for pos in (bucket,) if type(bucket) is int else bucket:
                        node, idx = self._resolve(pos)
                        have.add((salt, k, h, node.id, idx))
        assert have == want, f"index entries differ from the tree's: {len(have ^ want)} differ"

    # ------------------------------------------------------------ internals

    def _clear(self) -> None:
        self._tables: dict[str | None, list[dict[int, Bucket]]] = {}
        self._runs: dict[int, _Run] = {}
        self._where: dict[int, tuple[_Run, int]] = {}  # node id -> (its run, its start there)
        self._next_run = 0

    def _salt_below(self, parent: TreeNode) -> str | None:
        """The salt of a new child of ``parent``."""
        if parent._key:
            return self._where[parent.id][0].salt
        return parent.salt if isinstance(parent, NamespaceNode) else None

    def _with_context(self, node: TreeNode) -> tuple[np.ndarray, int]:
        """(up to ``max_window - 1`` tokens above ``node``, then its key) as int64, and how many
        of them are context."""
        need = (self.max_window - 1) * _TOKEN_BYTES
        runs, have, up = [], 0, node.parent
        while have < need and up is not None and up._key:
            runs.append(up._key)
            have += len(up._key)
            up = up.parent
        context = b"".join(reversed(runs))[-need:] if need else b""
        seq = np.frombuffer(context + node._key, dtype=np.int64)
        return seq, len(context) // _TOKEN_BYTES

    def _update(self, node: TreeNode, base: int, salt: str | None, add: bool) -> None:
        """Add (or remove) the grams ending in ``node``'s key, at positions ``base + i``."""
        tables = self._tables.get(salt)
        if tables is None:
            tables = self._tables[salt] = [{} for _ in range(self.max_window - self.min_window + 1)]
        seq, first = self._with_context(node)
        for k, lo, hashes in gram_hashes(seq, first, self.min_window, self.max_window):
            table, positions = (
                tables[k - self.min_window],
                range(base + lo, base + len(seq) - first),
            )
            (_add_all if add else _remove_all)(table, hashes.tolist(), positions)
        if not add and not any(tables):
            del self._tables[salt]

    def _resolve(self, pos: int) -> tuple[TreeNode, int]:
        run, off = self._runs[pos >> _RUN_SHIFT], pos & _OFFSET_MASK
        i = bisect.bisect_right(run.starts, off) - 1
        return run.nodes[i], off - run.starts[i]

    def _check_run(self, run: _Run) -> None:
        assert run.nodes and run.starts[0] == 0, f"run {run.id} is empty"
        for i, node in enumerate(run.nodes):
            assert self._where[node.id] == (run, run.starts[i]), f"{node!r}: stale run place"
            assert _salt_of(node) == run.salt, f"{node!r}: run of another salt"
            if i:
                assert node.parent is run.nodes[i - 1], f"run {run.id}: pieces not a chain"
                assert run.starts[i] == run.starts[i - 1] + run.nodes[i - 1].num_tokens


def tree_continuations(
    node: TreeNode,
    idx: int,
    depth: int,
    breadth: Callable[[int], int],
    max_paths: int,
) -> list[tuple[list[int], list[int]]]:
    """The tokens that follow position ``idx`` of ``node``'s key, read from the tree.

    Returns up to ``max_paths`` (tokens, recency) paths of at most ``depth`` tokens; ``recency[i]``
    is the ``last_access`` of the node holding ``tokens[i]``. Where the tree forks after d tokens
    the path follows the ``breadth(d)`` most recently used children, most recent first. A path
    ends at ``depth`` tokens or at a leaf; a position at a leaf's end has none.
    """
    paths = []
    stack = [(node, idx + 1, [], [])]
    while stack and len(paths) < max_paths:
        node, start, tokens, recency = stack.pop()
        take = np.frombuffer(node._key, dtype=np.int64)[start : start + depth - len(tokens)]
        if take.size:
            tokens = tokens + take.tolist()
            recency = recency + [node.last_access] * take.size
        if len(tokens) >= depth or not node.children:
            if tokens:
                paths.append((tokens, recency))
            continue
        kids = heapq.nlargest(
            breadth(len(tokens)), node.children.values(), key=lambda c: (c.last_access, c.id)
        )
        stack.extend((child, 0, tokens, recency) for child in reversed(kids))
    return paths


def _salt_of(node: TreeNode) -> str | None:
    while node._key:
        node = node.parent
    return node.salt if isinstance(node, NamespaceNode) else None


def _ends_with(node: TreeNode, idx: int, want: bytes) -> bool:
    """Whether the tokens from the root down to position ``idx`` of ``node`` end with ``want``
    (packed int64), compared run by run."""
    end, need = (idx + 1) * _TOKEN_BYTES, len(want)
    while True:
        take = min(end, need)
        if node._key[end - take : end] != want[need - take : need]:
            return False
        need -= take
        if not need:
            return True
        node = node.parent
        if node is None or not node._key:
            return False
        end = len(node._key)


def _add_all(table: dict[int, Bucket], keys: list[int], positions: Iterable[int]) -> None:
    setdefault = table.setdefault
    for key, pos in zip(keys, positions):
        old = setdefault(key, pos)
        if old is not pos:
            if type(old) is int:
                table[key] = {old: None, pos: None}
            else:
                old[pos] = None


def _remove_all(table: dict[int, Bucket], keys: list[int], positions: Iterable[int]) -> None:
    for key, pos in zip(keys, positions):
        old = table[key]
        if type(old) is int:
            assert old == pos, f"position {pos} is not indexed under its gram"
            del table[key]
        else:
            del old[pos]
            if len(old) == 1:
                table[key] = next(iter(old))
