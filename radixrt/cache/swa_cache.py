"""The radix tree for a model with sliding-window layers: a prefix is a hit only where the
sliding layers' KV of its last W tokens is still held.

Contract (beyond ``RadixCache``'s, whose API and invariants it keeps):
- Values are full slots of an ``SWASlotAllocator``. A node is *live* when every token of it
  holds an SWA slot, a *tombstone* when none does: the sliding layers' KV of a stretch of
  tokens is dropped (tombstoned) apart from its full KV.
- ``window`` W (transformers' ``sliding_window``: a query at position p attends keys
  p - W + 1 .. p). A prefix of length L is *usable* when its last min(W, L) tokens are in
  live nodes (the token after it reads W - 1 of them: one is spare, so the rule and the
  release below both read "the last W tokens"). ``match_prefix`` returns the longest
  usable prefix of the tokens' hit: a hit ending in a tombstone, or fewer than W tokens
  after one, is cut back to where the window is whole (a split is made only where the cut
  hit ends inside an edge). ``peek_prefix`` finds the same, changing nothing.
- ``lock(node)`` takes the full lock on the path (``RadixCache.lock``) and a *window lock*
  (``swa_lock_ref``) on the node's window, its last min(W, depth) tokens, which keeps them
  live; it first splits the node where the window starts, so a window is a whole number of
  nodes (later splits keep it so) and ``unlock`` walks the same tokens. Locking a node
  whose window is not live raises. ``unlock_window(node)`` drops the window lock alone (a
  request past its window); ``unlock(node, window=False)`` then drops the full lock. The
  caller knows which locks it holds (``release_behind`` says when the window lock goes).
- ``insert_prefix(tokens, slots)``: the caller's tokens that hold no SWA slot (released
  behind its window) become tombstones; tombstoned tree tokens for which the caller holds
  SWA slots adopt them (``SWASlotAllocator.adopt_swa``) and are live again. So after an
  insert, every token whose SWA KV the caller held is live in the tree, and the caller's
  window can be locked at the inserted key's end.
- Eviction: ``evict`` (the full pool) removes unlocked leaves, tombstoned leaves first (no
  match can end in one), then least recently used, and frees their full and SWA slots.
  ``evict_swa`` tombstones live nodes without a window lock, at any depth, least recently
  used first (under either eviction policy) and ancestors before descendants on a tie,
  and frees only their SWA slots. ``swa_evictable_size`` / ``swa_protected_size`` count
  live tokens without / with a window lock (as ``evictable_size`` / ``protected_size`` do
  for the full lock).
- Events (``record_events=True``): ``RadixCache``'s, plus one ``KVWindow`` per node that
  turns tombstone (``held`` False: ``evict_swa``, an insert's tokens without SWA slots) or
  live again (an insert that revives it); a new node is live, a split's parts keep their
  state, and ``snapshot_events`` marks tombstones (``KVStored.window_dropped``). A
  ``MirrorTree`` of ``window`` W replaying them matches as ``peek_prefix`` does.
- A running request gives back the SWA KV behind its window with ``release_behind``: what
  it holds in the sliding layers stays O(W) (plus the tokens of the step it computes).
- Page size 1 only, and no hierarchical tiers (``on_evict``): the allocator refuses other
  page sizes, and the constructor takes no ``on_evict``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from sortedcontainers import SortedList

from radixrt.cache import check_slot_partition
from radixrt.cache.radix_cache import (
    _TOKEN_BYTES,
    InsertResult,
    MatchResult,
    PeekResult,
    RadixCache,
    TreeNode,
    _as_tokens,
)
from radixrt.cache.swa_allocator import SWASlotAllocator, _slots_np
from radixrt.protocol import KVStored, KVWindow

_EMPTY = torch.empty(0, dtype=torch.int64)


class SWATreeNode(TreeNode):
    __slots__ = ("swa_tombstone", "swa_lock_ref", "swa_entry", "depth")

    def __init__(self, *args, depth: int = 0) -> None:
        super().__init__(*args)
        self.swa_tombstone = False  # True: no token of the node holds an SWA slot
        self.swa_lock_ref = 0  # window locks covering the node (<= lock_ref)
        self.swa_entry: tuple | None = None  # its tuple in the SWA-evictable set, if there
        self.depth = depth  # tokens from its root (root or namespace) to the node's end

    def __repr__(self) -> str:
        dead = ", tombstone" if self.swa_tombstone else ""
        return (
            f"SWATreeNode(id={self.id}, len={self.num_tokens}, depth={self.depth}, "
            f"lock_ref={self.lock_ref}, swa_lock_ref={self.swa_lock_ref}{dead})"
        )


class SWARadixCache(RadixCache):
    """Prefix tree over token ids for a model with sliding-window layers of window W."""

    def __init__(
        self,
        allocator: SWASlotAllocator,
        window: int,
        page_size: int = 1,
        eviction_policy: str = "lru",
        record_events: bool = False,
    ) -> None:
        if not isinstance(allocator, SWASlotAllocator):
            raise TypeError(f"SWARadixCache needs an SWASlotAllocator, got {type(allocator)}")
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window = window
        super().__init__(allocator, page_size, eviction_policy, record_events, self._forget_swa)

    def _init_tree(self) -> None:
        super()._init_tree()
        self.swa_evictable_size = 0
        self.swa_protected_size = 0
        self._swa_evictable = SortedList()

    # ------------------------------------------------------------------ API

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> MatchResult:
        """Longest usable prefix of ``token_ids`` in ``cache_salt``'s namespace (see the module
        docstring); ``last_node`` ends exactly at it. Refreshes the path's last access."""
        start = self._start(cache_salt)
        if start is None:
            return MatchResult(0, _EMPTY, self.root)
        tokens = _as_tokens(token_ids)
        node, pos, _, _ = self._walk(start, tokens, len(tokens), split=False)
        hit, last = self._usable(node, pos)
        if last._key and hit < last.depth:
            last = self._split(last, hit - (last.depth - last.num_tokens))
        self._touch_path(last, hit=True)
        return MatchResult(hit, self._path_slots(last), last)

    def peek_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PeekResult:
        """The hit ``match_prefix`` would find, changing nothing; ``last_node`` is the node whose
        edge holds the hit's end."""
        start = self._start(cache_salt)
        if start is None:
            return PeekResult(0, self.root)
        tokens = _as_tokens(token_ids)
        node, pos, _, _ = self._walk(start, tokens, len(tokens), split=False)
        return PeekResult(*self._usable(node, pos))

    def insert_prefix(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, cache_salt: str | None = None
    ) -> InsertResult:
        """``RadixCache.insert_prefix``; then the new tokens whose slots hold no SWA slot are
        tombstones, and tombstoned tokens of the cached part take the caller's SWA slots where
        it holds them. The caller frees its slots of the cached part as with ``RadixCache``
        (their adopted SWA slots are no longer theirs)."""
        slots = _slots_np(kv_indices)
        inserted = super().insert_prefix(token_ids, slots, cache_salt)
        n = inserted.kv_indices.numel()
        if n:
            held = self.allocator.translate(slots[:n]).numpy() != 0
            self._settle(inserted.last_node, slots[:n], held, inserted.cached_len)
        return inserted

    def lock(self, node: TreeNode) -> None:
        """Full lock on node..root and a window lock on node's last min(W, depth) tokens;
        raises RuntimeError (locking nothing) if that window is not live."""
        if not node._key:
            return  # the root or a namespace: a 0-token hit
        window = min(self.window, node.depth)
        nodes = self._window_nodes(node, window, align=True)
        dead = [n for n in nodes if n.swa_tombstone]
        if dead:
            raise RuntimeError(f"lock of {node!r}: its window holds a tombstone {dead[0]!r}")
        super().lock(node)
        self._add_window_ref(nodes, 1)

    def unlock(self, node: TreeNode, window: bool = True, released: int | None = None) -> None:
        """Drop the full lock and, unless ``window`` is False (dropped already), the window
        lock: node's last min(W, depth) tokens, or those from ``released`` on where
        ``release_behind`` has slid it (``released``: its last return)."""
        if window:
            self.unlock_window(node, released)
        super().unlock(node)

    def unlock_window(self, node: TreeNode, released: int | None = None) -> None:
        """Drop node's window lock alone (its tokens stay cached and become SWA-evictable): the
        tokens from ``released`` (None: ``window_start(depth)``) to node's end."""
        if not node._key:
            return
        nodes = self._window_nodes(node, node.depth - self._lock_start(node, released))
        if any(n.swa_lock_ref <= 0 for n in nodes):
            raise RuntimeError(f"window unlock of {node!r}, whose window is not locked")
        self._add_window_ref(nodes, -1)

    def _lock_start(self, node: TreeNode, released: int | None) -> int:
        """Where the window lock at node begins: W tokens before its end, later where it has
        slid (``released``)."""
        start = self.window_start(node.depth)
        return start if released is None else max(start, released)

    def _slide_window(self, node: TreeNode, old: int, new: int) -> None:
        """Move the start of node's window lock from position ``old`` to ``new`` (old < new <
        depth): the tokens between them lose the lock (splitting the node where ``new``
        falls), so a request past part of its window protects only what it still reads."""
        depth = node.depth
        kept = self._window_nodes(node, depth - new, align=True)
        held = self._window_nodes(node, depth - old)
        self._add_window_ref(kept, 1)
        self._add_window_ref(held, -1)

    def window_start(self, prefix_len: int) -> int:
        """Where a request's SWA needs begin once it holds a lock at ``prefix_len`` tokens: the
        ``released`` to start ``release_behind`` from (after admission and each re-lock)."""
        return max(0, prefix_len - self.window)

    def release_behind(
        self, node: TreeNode, prefix_len: int, slots: torch.Tensor, released: int, kv_len: int
    ) -> int:
        """A running request with ``kv_len`` tokens computed gives back the SWA KV behind its
        window: it keeps positions ``kv_len - W ..`` (what its next token's window reads).

        ``node``/``prefix_len``: its lock and the tokens the tree holds for it; ``slots``: its
        ``req_to_token`` row; ``released``: the value the previous call returned (or
        ``window_start(prefix_len)`` after a lock). Its private tokens' SWA slots are freed;
        its window lock slides with it (the tree's tokens it passes stay, SWA-evictable) and
        is dropped once the window passes ``prefix_len``. The window lock covers positions
        ``released .. prefix_len`` while ``released < prefix_len``. Returns the new
        ``released``.
        """
        target = kv_len - self.window
        if target <= released:
            return released
        if released < prefix_len <= target:
            self.unlock_window(node, released)
        elif released < prefix_len:
            self._slide_window(node, max(released, self.window_start(prefix_len)), target)
        lo = max(released, prefix_len)
        if target > lo:
            self.allocator.free_swa(slots[lo:target])
        return target

    def evict_swa(self, num_tokens: int) -> int:
        """Tombstone live nodes without a window lock, least recently used first, until
        ``num_tokens`` SWA slots are freed; returns how many were (less if no more can be)."""
        freed, slots = 0, []
        while freed < num_tokens and self._swa_evictable:
            node = self._swa_evictable[0][-1]
            slots.append(node._np)
            self._set_live(node, False)
            freed += node.num_tokens
        if slots:
            self.allocator.free_swa(np.concatenate(slots))
        return freed

    def all_swa_slots(self) -> torch.Tensor:
        """Every SWA slot the tree holds (those of its live nodes)."""
        vals = [n._np for n in self._nodes() if n._key and not n.swa_tombstone]
        return self.allocator.translate(np.concatenate(vals)) if vals else _EMPTY

    def pool_stats(self) -> dict[str, int]:
        """Both pools' slots: size, free, held by the tree (evictable + protected), held by
        running requests (the rest)."""
        a = self.allocator
        tree, swa_tree = self.total_size(), self.swa_evictable_size + self.swa_protected_size
        return {
            "full_slots": a.capacity,
            "full_free": a.available,
            "full_tree": tree,
            "full_evictable": self.evictable_size,
            "full_requests": a.capacity - a.available - tree,
            "swa_slots": a.swa_capacity,
            "swa_free": a.swa_available,
            "swa_tree": swa_tree,
            "swa_evictable": self.swa_evictable_size,
            "swa_requests": a.swa_capacity - a.swa_available - swa_tree,
        }

    def check_integrity(self) -> None:
        """``RadixCache.check_integrity``, then every SWA invariant: live nodes' tokens all map
        to SWA slots and tombstones' none, window locks only on live nodes and under full
        locks, depths, the SWA sizes and the SWA-evictable set."""
        super().check_integrity()
        evictable = protected = 0
        want = set()
        for node in self._nodes():
            if not node._key:
                continue
            self._check_swa_node(node)
            if node.swa_tombstone:
                continue
            if node.swa_lock_ref:
                protected += node.num_tokens
            else:
                evictable += node.num_tokens
                want.add(node.id)
        assert evictable == self.swa_evictable_size, (
            f"swa_evictable_size {self.swa_evictable_size} != {evictable}"
        )
        assert protected == self.swa_protected_size, (
            f"swa_protected_size {self.swa_protected_size} != {protected}"
        )
        in_set = {e[-1].id for e in self._swa_evictable}
        assert len(in_set) == len(self._swa_evictable), "a node is in the SWA set twice"
        assert in_set == want, f"SWA set {sorted(in_set)} != unlocked live nodes {sorted(want)}"
        for e in self._swa_evictable:
            assert e is e[-1].swa_entry and e == self._swa_key(e[-1]), f"stale SWA entry {e[:-1]}"

    # ------------------------------------------------------------ internals

    def _check_swa_node(self, node: SWATreeNode) -> None:
        assert isinstance(node, SWATreeNode), f"{node!r} is not an SWATreeNode"
        above = node.parent.depth if node.parent._key else 0
        assert node.depth == above + node.num_tokens, f"{node!r}: depth != parent's + length"
        assert 0 <= node.swa_lock_ref <= node.lock_ref, f"{node!r}: window lock without full lock"
        held = self.allocator.translate(node._np).numpy() != 0
        if node.swa_tombstone:
            assert node.swa_lock_ref == 0, f"{node!r}: a window lock on a tombstone"
            assert not held.any(), f"{node!r}: a tombstone holds SWA slots"
        else:
            assert held.all(), f"{node!r}: a live node has tokens without SWA slots"

    def _start(self, cache_salt: str | None) -> TreeNode | None:
        return self.root if cache_salt is None else self._namespace(cache_salt, create=False)

    def _usable(self, node: TreeNode, pos: int) -> tuple[int, TreeNode]:
        """(L, the node whose edge holds L's end): the longest usable prefix of the path from
        the root to ``node``, cut at ``pos`` tokens."""
        path = []
        while node._key:
            path.append(node)
            node = node.parent
        best, best_node, run = 0, node, 0  # run: where the live stretch being walked began
        for n in reversed(path):
            if n.swa_tombstone:
                run = None
                continue
            begin, end = n.depth - n.num_tokens, min(n.depth, pos)
            run = begin if run is None else run
            if run == 0 or end - run >= self.window:
                best, best_node = end, n
        return best, best_node

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        values = []
        while node._key:
            values.append(node._np)
            node = node.parent
        if not values:
            return _EMPTY
        return torch.from_numpy(np.concatenate(values[::-1]) if len(values) > 1 else values[0])

    def _settle(
        self, last: SWATreeNode, slots: np.ndarray, held: np.ndarray, cached_len: int
    ) -> None:
        """After an insert of ``slots`` (the caller's, ``held``: which hold SWA slots) ending at
        ``last``: tombstone the new tokens without SWA, revive the cached tombstoned tokens the
        caller holds SWA for. Splits nodes where that changes along them."""
        node = last
        while node._key:
            parent, begin, end = node.parent, node.depth - node.num_tokens, node.depth
            mask = held[begin:end]
            if begin >= cached_len and not mask.all():  # the insert's own tokens
                for piece, live in self._split_runs(node, mask):
                    if not live:
                        self._set_live(piece, False)  # their SWA slots were freed already
            elif begin < cached_len and node.swa_tombstone and mask.any():
                for piece, live in self._split_runs(node, mask):
                    if live:
                        at = piece.depth - piece.num_tokens
                        self.allocator.adopt_swa(piece._np, slots[at : piece.depth])
                        self._set_live(piece, True)
            node = parent

    def _split_runs(self, node: SWATreeNode, mask: np.ndarray) -> list[tuple[SWATreeNode, bool]]:
        """Split node where ``mask`` (one bool per token) changes; the pieces top-down, each
        with its mask value."""
        cuts = (np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist()
        pieces, done = [], 0
        for cut in cuts:
            pieces.append((self._split(node, cut - done), bool(mask[done])))
            done = cut
        pieces.append((node, bool(mask[done])))
        return pieces

    def _set_live(self, node: SWATreeNode, live: bool) -> None:
        """Mark a node without window locks live or tombstoned (its slots already say so)."""
        assert node.swa_lock_ref == 0 and node.swa_tombstone == live
        in_full_set = node.entry is not None
        if in_full_set:  # its key in the full set ranks tombstones first
            self._remove_evictable(node)
        if live:
            node.swa_tombstone = False
            self.swa_evictable_size += node.num_tokens
            self._swa_attach(node)
        else:
            self._swa_detach(node)
            node.swa_tombstone = True
            self.swa_evictable_size -= node.num_tokens
        if in_full_set:
            self._add_evictable(node)
        if self._events is not None:
            self._events.append(KVWindow(nodes=[node.id], held=live))

    def _window_nodes(
        self, node: SWATreeNode, window: int, align: bool = False
    ) -> list[SWATreeNode]:
        """The nodes holding node's last ``window`` tokens, bottom-up. With ``align``, first
        split the node where the window starts; without, the window must already be whole
        nodes (as every window lock leaves it)."""
        nodes, total = [], 0
        while total < window:
            nodes.append(node)
            total += node.num_tokens
            node = node.parent
        if total > window:
            assert align, f"a window of {window} tokens does not end on a node boundary"
            self._split(nodes[-1], total - window)
        return nodes

    def _add_window_ref(self, nodes: list[SWATreeNode], delta: int) -> None:
        for node in nodes:
            if node.swa_lock_ref == 0:
                self._swa_detach(node)
                self.swa_evictable_size -= node.num_tokens
                self.swa_protected_size += node.num_tokens
            node.swa_lock_ref += delta
            if node.swa_lock_ref == 0:
                self.swa_protected_size -= node.num_tokens
                self.swa_evictable_size += node.num_tokens
                self._swa_attach(node)

    def _forget_swa(self, leaf: SWATreeNode) -> None:
        """``evict`` is about to drop ``leaf`` (unlocked): its SWA slots go with its full ones."""
        self._swa_detach(leaf)
        if not leaf.swa_tombstone:
            self.swa_evictable_size -= leaf.num_tokens

    def _stored_event(self, node: TreeNode) -> KVStored:
        event = super()._stored_event(node)
        if isinstance(node, SWATreeNode) and node.swa_tombstone:  # not a namespace node
            event.window_dropped = True
        return event

    def _new_node(self, key, head, value, parent) -> SWATreeNode:
        depth = len(key) // _TOKEN_BYTES + (
            parent.depth if parent is not None and parent._key else 0
        )
        node = SWATreeNode(self._next_id, key, head, value, parent, depth=depth)
        self._next_id += 1
        return node

    def _split(self, child: SWATreeNode, n: int) -> SWATreeNode:
        upper = super()._split(child, n)
        upper.swa_tombstone = child.swa_tombstone
        upper.swa_lock_ref = child.swa_lock_ref
        self._swa_attach(upper)
        return upper

    def _touch_path(self, node, hit, new_leaf=None) -> TreeNode:
        """``RadixCache._touch_path``, keeping the SWA set's keys (which hold last access)
        current; a new leaf is live."""
        path, up = [], node
        while up._key:
            path.append(up)
            self._swa_detach(up)
            up = up.parent
        leaf = super()._touch_path(node, hit, new_leaf)
        if new_leaf is not None:
            self.swa_evictable_size += leaf.num_tokens
            path.append(leaf)
        for n in path:
            self._swa_attach(n)
        return leaf

    def _entry(self, node: TreeNode) -> tuple:
        return (not node.swa_tombstone, *super()._entry(node))

    def _swa_key(self, node: SWATreeNode) -> tuple:
        return (node.last_access, node.depth, node.id, node)

    def _swa_attach(self, node: SWATreeNode) -> None:
        if node.swa_tombstone or node.swa_lock_ref or node.swa_entry is not None:
            return
        node.swa_entry = self._swa_key(node)
        self._swa_evictable.add(node.swa_entry)

    def _swa_detach(self, node: SWATreeNode) -> None:
        if node.swa_entry is not None:
            self._swa_evictable.remove(node.swa_entry)
            node.swa_entry = None


def check_swa_partition(
    allocator: SWASlotAllocator,
    cache: SWARadixCache,
    private: list[torch.Tensor],
    window: int | None = None,
) -> None:
    """Assert every slot of both pools is in exactly one place: the free list, one tree node,
    or one running request's private slots (``private``, one tensor of full slots per
    request). With ``window`` (after each request's ``release_behind``), also that each
    request holds at most ``window`` private SWA slots, and that those and the tree's window
    locks come to at most ``window`` per request."""
    check_slot_partition(allocator, cache, private)
    allocator.check_integrity()
    if window is None:
        return
    total = 0
    for slots in private:
        held = int((allocator.translate(slots) != 0).sum())
        assert held <= window, f"a request holds {held} SWA slots behind a window of {window}"
        total += held
    # a request's window lock covers only what its private slots do not: W per request in all
    assert cache.swa_protected_size + total <= window * len(private), (
        f"{cache.swa_protected_size} tokens window-locked and {total} private SWA slots for "
        f"{len(private)} requests"
    )
