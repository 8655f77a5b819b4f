"""A copy of a replica's radix tree, built only from its KV events.

Contract:
- ``MirrorTree`` holds the token runs and shape of a ``RadixCache`` (no
  slots, no access times, no locks), under the replica's own node ids, root
  0. Applying every event the cache recorded, in order, makes it exact:
  ``cached_sequences()`` equals the cache's and ``match(tokens, salt)`` equals
  the cache's ``peek_prefix(tokens, salt).hit_len`` (page-aligned; 0 under a
  salt with nothing cached). With ``window`` W (a model with sliding-window
  layers, ``SWARadixCache``), ``KVWindow`` events mark nodes whose sliding
  layers' KV is dropped, and a match is the longest prefix whose last
  min(W, L) tokens are in nodes that hold it, as the cache's is. An event
  that does not fit the tree (an unknown node id, a run that is not whole
  pages, a removal of a node with children) raises ``MirrorError``; the tree
  may then be partly changed.
- ``ReplicaMirror`` is the subscriber side for one replica: it applies
  ``KVEventBatch``es in ``seq`` order (1, 2, 3, ... per publisher process)
  and ignores duplicates. On a gap (or an event that does not fit) it asks
  once for a ``KVSnapshot`` and buffers later batches until one arrives; the
  snapshot replaces the tree and the buffered batches after its ``seq`` are
  replayed. The mirror is as current as the last batch applied: while
  resyncing, ``match`` answers from the stale tree. A snapshot older than
  the last batch applied is ignored. A restarted replica numbers from 1
  again: call ``reset`` first, or its batches read as duplicates.
- Lookups compare packed int64 runs (memcmp per edge), as the cache does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from radixrt.cache.radix_cache import _TOKEN_BYTES, _as_tokens, _pack, common_prefix_len
from radixrt.protocol import (
    KVCleared,
    KVEvent,
    KVEventBatch,
    KVRemoved,
    KVSnapshot,
    KVSplit,
    KVStored,
    KVWindow,
)

ROOT_ID = 0


class MirrorError(ValueError):
    """An event that does not fit the mirror tree: the event stream and the tree disagree."""


class _Node:
    __slots__ = ("id", "key", "head", "parent", "children", "dropped")

    def __init__(self, node_id: int, key: bytes, head: bytes | str, parent: _Node | None) -> None:
        self.dropped = False  # its sliding-window layers' KV is not held (KVWindow)
        self.id = node_id
        self.key = key  # packed int64 token ids; b"" for the root and namespace nodes
        self.head = head  # its key in parent.children: the first page's bytes, or the salt
        self.parent = parent
        self.children: dict[bytes | str, _Node] = {}


class MirrorTree:
    """The token runs and shape of a replica's radix tree, rebuilt from KV events."""

    def __init__(self, page_size: int = 1, window: int = 0) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.page_size, self.window = page_size, window
        self._page_bytes = page_size * _TOKEN_BYTES
        self._apply = {
            KVStored: self._stored,
            KVSplit: self._split,
            KVRemoved: self._removed,
            KVWindow: self._window,
            KVCleared: self._cleared,
        }
        self.clear()

    def clear(self) -> None:
        """Empty the tree (only the root, id 0, is left)."""
        self.root = _Node(ROOT_ID, b"", "", None)
        self._nodes = {ROOT_ID: self.root}
        self.num_tokens = 0  # tokens held by all nodes together

    @property
    def num_nodes(self) -> int:
        """Nodes besides the root (namespace nodes included)."""
        return len(self._nodes) - 1

    def apply(self, event: KVEvent) -> None:
        """Apply one KV event; raises MirrorError if it does not fit the tree."""
        handler = self._apply.get(type(event))
        if handler is None:
            raise TypeError(f"not a KV event: {event!r}")
        handler(event)

    def apply_all(self, events: Sequence[KVEvent]) -> None:
        """Apply events in order."""
        for event in events:
            self.apply(event)

    def match(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Length of the longest cached prefix of ``token_ids`` under ``cache_salt``
        (page-aligned): what the replica's ``peek_prefix(...).hit_len`` returns."""
        node = self.root if cache_salt is None else self.root.children.get(cache_salt)
        tokens = _as_tokens(token_ids)
        n = len(tokens) // self.page_size * self.page_size
        if node is None or not n:
            return 0
        packed, page = _pack(tokens, 0, n), self._page_bytes
        pos, end, path = 0, len(packed), []  # pos in bytes; path: (node, its hit's end)
        while pos < end:
            child = node.children.get(packed[pos : pos + page])
            if child is None:
                break
            edge = child.key
            if packed.startswith(edge, pos):
                pos += len(edge)
                node = child
                path.append((child, pos))
                continue
            hit = common_prefix_len(edge, packed[pos : pos + len(edge)])
            pos += hit - hit % page  # >= one page: the head matched
            path.append((child, pos))
            break
        return self._usable(path) // _TOKEN_BYTES if self.window else pos // _TOKEN_BYTES

    def _usable(self, path: list[tuple[_Node, int]]) -> int:
        """Bytes of the longest prefix along ``path`` whose last min(W, L) tokens are held."""
        best, run, begin, window = 0, 0, 0, self.window * _TOKEN_BYTES
        for node, end in path:  # run: where the held stretch being walked began, or None
            if node.dropped:
                run = None
            else:
                run = begin if run is None else run
                if run == 0 or end - run >= window:
                    best = end
            begin = end
        return best

    def cached_sequences(self) -> set[tuple[str | None, tuple[int, ...]]]:
        """Every (cache_salt, token ids from its root to a leaf), as
        ``RadixCache.cached_sequences``."""
        sequences = set()
        for node in self._nodes.values():
            if node.children or node is self.root:
                continue
            runs = []
            while node.key:
                runs.append(node.key)
                node = node.parent
            salt = node.head if node is not self.root else None
            tokens = np.frombuffer(b"".join(reversed(runs)), dtype=np.int64)
            sequences.add((salt, tuple(tokens.tolist())))
        return sequences

    # ------------------------------------------------------------ internals

    def _node(self, node_id: int, event: KVEvent) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise MirrorError(f"unknown node {node_id} in {event!r}")
        return node

    def _add(self, node: _Node, event: KVEvent) -> None:
        """Register a new node and hang it under its parent."""
        if node.id in self._nodes:
            raise MirrorError(f"node {node.id} already exists: {event!r}")
        if node.head in node.parent.children:
            raise MirrorError(f"node {node.parent.id} already has a child at that head: {event!r}")
        self._nodes[node.id] = node
        node.parent.children[node.head] = node

    def _stored(self, event: KVStored) -> None:
        parent = self._node(event.parent, event)
        if event.cache_salt is not None:
            if parent is not self.root or event.token_ids:
                raise MirrorError(f"a namespace node needs no tokens and the root: {event!r}")
            self._add(_Node(event.node, b"", event.cache_salt, parent), event)
            return
        n = len(event.token_ids)
        if not n or n % self.page_size:
            raise MirrorError(f"{n} tokens are not whole pages of {self.page_size}: {event!r}")
        key = _pack(event.token_ids, 0, n)
        node = _Node(event.node, key, key[: self._page_bytes], parent)
        node.dropped = event.window_dropped
        self._add(node, event)
        self.num_tokens += n

    def _cleared(self, event: KVCleared) -> None:
        self.clear()

    def _split(self, event: KVSplit) -> None:
        child = self._node(event.node, event)
        cut = event.at * _TOKEN_BYTES
        if not 0 < cut < len(child.key) or event.at % self.page_size:
            tokens = len(child.key) // _TOKEN_BYTES
            raise MirrorError(f"cannot split a {tokens}-token edge: {event!r}")
        if event.upper in self._nodes:
            raise MirrorError(f"node {event.upper} already exists: {event!r}")
        parent = child.parent
        upper = _Node(event.upper, child.key[:cut], child.head, parent)
        upper.dropped = child.dropped
        parent.children[upper.head] = upper  # replaces child there
        self._nodes[upper.id] = upper
        child.key = child.key[cut:]
        child.head = child.key[: self._page_bytes]
        child.parent = upper
        upper.children[child.head] = child

    def _removed(self, event: KVRemoved) -> None:
        for node_id in event.nodes:
            node = self._node(node_id, event)
            if node.children or node is self.root:
                raise MirrorError(f"node {node_id} is not a leaf: {event!r}")
            del node.parent.children[node.head]
            del self._nodes[node_id]
            self.num_tokens -= len(node.key) // _TOKEN_BYTES

    def _window(self, event: KVWindow) -> None:
        for node_id in event.nodes:
            node = self._node(node_id, event)
            if not node.key:
                raise MirrorError(f"node {node_id} holds no tokens: {event!r}")
            node.dropped = not event.held


class ReplicaMirror:
    """One replica's mirror tree, kept current from its numbered event batches."""

    def __init__(self, replica: int, max_buffered: int = 4096) -> None:
        """``max_buffered``: batches kept while resyncing (the oldest are dropped beyond it; the
        replay after the snapshot then finds the gap and asks again)."""
        self.replica = replica
        self.tree = MirrorTree()  # replaced by each snapshot applied
        self.seq = 0  # the last batch applied (or the snapshot's seq)
        self.resyncing = False
        self.gaps = 0  # resyncs started: a sequence gap, or a batch that did not fit the tree
        self.resyncs = 0  # snapshots applied
        self._buffer: deque[KVEventBatch] = deque(maxlen=max_buffered)

    def reset(self) -> None:
        """Forget everything: the replica restarted (its next batch is seq 1)."""
        self.tree = MirrorTree()
        self.seq = 0
        self.resyncing = False
        self._buffer.clear()

    def match(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The replica's cached prefix length for ``token_ids``, as far as the mirror knows."""
        return self.tree.match(token_ids, cache_salt)

    def on_batch(self, batch: KVEventBatch) -> bool:
        """Apply the next batch, ignore a duplicate, buffer one while resyncing. Returns True when
        a snapshot should be requested: once per resync, at the batch that starts it."""
        self._check_replica(batch)
        if batch.seq <= self.seq:
            return False
        if self.resyncing:
            self._buffer.append(batch)
            return False
        if batch.seq != self.seq + 1 or not self._apply(batch):
            return self._start_resync(batch)
        return False

    def on_snapshot(self, snap: KVSnapshot) -> bool:
        """Replace the tree with the snapshot's and replay the buffered batches after its seq.

        Returns True when a snapshot should be requested again: the buffered batches do not
        follow on from it (a gap), or it does not build a tree. A snapshot older than the last
        batch applied is ignored (it cannot bring the mirror forward).
        """
        self._check_replica(snap)
        if snap.seq < self.seq:
            return False
        self.resyncing = False  # the request is answered; a new need asks again
        tree = MirrorTree(snap.page_size, snap.window)
        try:
            tree.apply_all(snap.events)
        except MirrorError:
            return self._start_resync(None)
        self.tree, self.seq = tree, snap.seq
        self.resyncs += 1
        return self._replay()

    # ------------------------------------------------------------ internals

    def _check_replica(self, msg: KVEventBatch | KVSnapshot) -> None:
        if msg.replica != self.replica:
            raise ValueError(f"replica {msg.replica}'s message, not {self.replica}'s")

    def _apply(self, batch: KVEventBatch) -> bool:
        """Apply a batch in sequence; False if it did not fit the tree (a resync is due)."""
        if (batch.page_size, batch.window) != (self.tree.page_size, self.tree.window):
            if self.tree.num_nodes:
                return False
            self.tree = MirrorTree(batch.page_size, batch.window)  # the first batch sets them
        try:
            self.tree.apply_all(batch.events)
        except MirrorError:
            return False
        self.seq = batch.seq
        return True

    def _start_resync(self, batch: KVEventBatch | None) -> bool:
        """Enter resync (buffering ``batch``); True the first time, False if already in one."""
        if batch is not None:
            self._buffer.append(batch)
        if self.resyncing:
            return False
        self.resyncing = True
        self.gaps += 1
        return True

    def _replay(self) -> bool:
        """Apply the buffered batches that follow ``seq``, in order; True if a resync is due."""
        pending = sorted((b for b in self._buffer if b.seq > self.seq), key=lambda b: b.seq)
        self._buffer.clear()
        for i, batch in enumerate(pending):
            if batch.seq == self.seq:
                continue  # a duplicate in the buffer
            if batch.seq != self.seq + 1 or not self._apply(batch):
                self._buffer.extend(pending[i:])
                return self._start_resync(None)
        return False
