"""The radix tree mapping token prefixes to KV slot indices.

Contract (see shared DESIGN.md, "The KV cache"):
- Every node but the root holds a non-empty ``key`` (token ids) and a
  ``value`` (int64 slot tensor of the same length). With page_size > 1 every
  key is a whole number of pages.
- ``lock_ref`` of a node counts the locks taken on it or on any descendant;
  a node with lock_ref > 0 is never evicted. Tokens of nodes with lock_ref == 0
  are counted in ``evictable_size``, the others in ``protected_size``.
- Evictable leaves (no children, lock_ref == 0, not the root) sit in a
  ``SortedList`` keyed by (last_access, id) for LRU, or (hit_count,
  last_access, id) for LFU; every mutation keeps it current, so ``evict``
  costs O(k log n) for k leaves.
- A slot is held by at most one node, and never by a node and the free list.
- ``last_access`` is a logical clock (one tick per touch), so LRU order is
  exact and reproducible.

Keys are compared as runs (list slices compare in C), never token by token
in Python.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
from sortedcontainers import SortedList

from radixrt.cache.allocator import KVSlotAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("id", "key", "_value", "_np", "parent", "children", "lock_ref",
                 "last_access", "hit_count", "entry")

    def __init__(self, node_id: int, key: list[int], value: torch.Tensor,
                 parent: TreeNode | None) -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.entry: tuple | None = None  # its tuple in the evictable set, if there

    @property
    def value(self) -> torch.Tensor:
        return self._value

    @value.setter
    def value(self, value: torch.Tensor) -> None:
        # A CPU numpy view (a copy for device tensors) kept next to the
        # tensor, so evict can hand slots to the allocator without a torch
        # round trip per node.
        self._value = value
        self._np = value.numpy() if value.device.type == "cpu" else value.cpu().numpy()

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    hit_len: int
    kv_indices: torch.Tensor  # int64 [hit_len]
    last_node: TreeNode


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two lists, by slice comparisons in C."""
    n = min(len(a), len(b))
    if len(a) != n:
        a = a[:n]
    if len(b) != n:
        b = b[:n]
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    """Prefix tree over token ids; values are KV slot indices."""

    def __init__(self, allocator: KVSlotAllocator, page_size: int = 1,
                 eviction_policy: str = "lru") -> None:
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"eviction_policy must be 'lru' or 'lfu', got {eviction_policy!r}")
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._init_tree()

    def _init_tree(self) -> None:
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evictable
        self.evictable_size = 0
        self.protected_size = 0
        self._evictable = SortedList()

    # ------------------------------------------------------------------ API

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (page-aligned).

        If the hit ends inside an edge, that edge is split so ``last_node``
        covers exactly the hit. Refreshes last access (and, for LFU, the hit
        count) of every node on the path.
        """
        key = self._page_align(_as_list(token_ids))
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            split = n < len(child.key)
            if split:
                child = self._split(child, n)
            values.append(child.value)
            pos += n
            node = child
            if split:
                break
        self._touch_path(node, hit=True)
        kv = torch.cat(values) if len(values) > 1 else (values[0] if values else _EMPTY)
        return MatchResult(pos, kv, node)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor) -> int:
        """Add ``token_ids`` → ``kv_indices``; return how many leading tokens were cached.

        The tree keeps its own slots for the already-cached prefix; the
        caller's slots for those tokens stay the caller's to free. Only the
        page-aligned part of the key is inserted. Splits edges where the new
        path forks from an existing one.
        """
        key = self._page_align(_as_list(token_ids))
        if kv_indices.numel() < len(key):
            raise ValueError(f"insert: {len(key)} tokens but only {kv_indices.numel()} kv_indices")
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        if pos < len(key):
            value = kv_indices[pos:len(key)]
            if value.dtype != torch.int64:
                value = value.to(torch.int64)
            node = self._add_leaf(node, key[pos:], value.clone())
        self._touch_path(node, hit=False)
        return pos

    def lock(self, node: TreeNode) -> None:
        """lock_ref += 1 on node and every ancestor (the root excepted)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                self._remove_evictable(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """lock_ref -= 1 on node and every ancestor; raises if a ref would go below 0."""
        if node is not self.root and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} which is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                if not node.children:
                    self._add_evictable(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until num_tokens are freed.

        Returns the number of tokens freed (less than asked if nothing more is
        evictable). A parent left childless and unlocked becomes a candidate.
        """
        freed, slots = 0, []
        while freed < num_tokens and self._evictable:
            node = self._evictable.pop(0)[-1]
            node.entry = None
            slots.append(node._np)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._add_evictable(parent)
        if slots:
            self.allocator.free(np.concatenate(slots) if len(slots) > 1 else slots[0])
        return freed

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @property
    def num_evictable_leaves(self) -> int:
        return len(self._evictable)

    def reset(self) -> None:
        """Free every cached slot and empty the tree. Nothing may be locked."""
        if self.protected_size:
            raise RuntimeError(f"reset with {self.protected_size} tokens locked by running requests")
        slots = [n.value for n in self._nodes() if n is not self.root]
        if slots:
            self.allocator.free(torch.cat(slots))
        self._init_tree()

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for memory checks)."""
        vals = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(vals) if vals else _EMPTY

    def check_integrity(self) -> None:
        """Walk the whole tree and assert every invariant; raises AssertionError."""
        evictable = protected = 0
        leaves = set()
        values = []
        for node in self._nodes():
            if node is self.root:
                assert node.parent is None and not node.key
                continue
            self._check_node(node)
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
            if not node.children and node.lock_ref == 0:
                leaves.add(node.id)
            values.append(node.value)
        assert evictable == self.evictable_size, f"evictable_size {self.evictable_size} != {evictable}"
        assert protected == self.protected_size, f"protected_size {self.protected_size} != {protected}"
        in_set = {e[-1].id for e in self._evictable}
        assert len(in_set) == len(self._evictable), "a node is in the evictable set twice"
        assert in_set == leaves, f"evictable set {sorted(in_set)} != unlocked leaves {sorted(leaves)}"
        for e in self._evictable:
            assert e is e[-1].entry and e == self._entry(e[-1]), f"stale evictable entry {e[:-1]}"
        slots = torch.cat(values) if values else _EMPTY
        assert slots.numel() == torch.unique(slots).numel(), "a slot is held by two tree nodes"
        if slots.numel():
            assert int(slots.min()) >= self.page_size, "the tree holds a reserved slot"
            assert not bool(self.allocator.is_free(slots).any()), "a slot is both free and in the tree"

    # ------------------------------------------------------------ internals

    def _check_node(self, node: TreeNode) -> None:
        p = self.page_size
        assert node.key, f"{node!r} has an empty key"
        assert len(node.key) == node.value.numel(), f"{node!r}: key/value lengths differ"
        assert np.array_equal(node._np, node.value.cpu().numpy()), f"{node!r}: stale numpy view"
        assert len(node.key) % p == 0, f"{node!r}: key is not page-aligned"
        assert node.parent.children.get(self._child_key(node.key, 0)) is node, f"{node!r}: bad parent link"
        child_refs = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_refs, f"{node!r}: lock_ref below its children's sum {child_refs}"
        assert node.lock_ref >= 0

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new_node(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent)
        self._next_id += 1
        return node

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _page_align(self, key: list[int]) -> list[int]:
        p = self.page_size
        return key if p == 1 else key[:len(key) // p * p]

    def _match_len(self, edge: list[int], key: list[int], pos: int) -> int:
        """Tokens of ``edge`` that match ``key[pos:]``, rounded down to whole pages."""
        n = common_prefix_len(edge, key[pos:pos + len(edge)])
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child's edge after n tokens; return the new upper node."""
        parent = child.parent
        upper = self._new_node(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        parent.children[self._child_key(upper.key, 0)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        leaf = self._new_node(key, value, parent)
        if not parent.children:
            self._remove_evictable(parent)
        parent.children[self._child_key(key, 0)] = leaf
        self.evictable_size += len(key)
        self._add_evictable(leaf)
        return leaf

    def _touch_path(self, node: TreeNode, hit: bool) -> None:
        """Refresh last_access (and hit_count) from node up to the root."""
        self._clock += 1
        leaf = node
        reinsert = leaf.entry is not None
        if reinsert:
            self._remove_evictable(leaf)
        while node is not self.root:
            node.last_access = self._clock
            node.hit_count += hit
            node = node.parent
        if reinsert:
            self._add_evictable(leaf)

    def _entry(self, node: TreeNode) -> tuple:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access, node.id, node)
        return (node.last_access, node.id, node)

    def _add_evictable(self, node: TreeNode) -> None:
        node.entry = self._entry(node)
        self._evictable.add(node.entry)

    def _remove_evictable(self, node: TreeNode) -> None:
        if node.entry is not None:
            self._evictable.remove(node.entry)
            node.entry = None


def _as_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, list):
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)
