"""The radix tree mapping token prefixes to KV slot indices.

Contract (see shared DESIGN.md, "The KV cache"):
- Every node but the roots holds a non-empty ``key`` (token ids) and a
  ``value`` (int64 slot tensor of the same length). With page_size > 1 every
  key is a whole number of pages. Values live on the CPU as int64 numpy
  arrays; ``node.value`` and ``MatchResult.kv_indices`` are CPU int64 tensors
  sharing that memory (treat them as read-only). ``insert`` takes slot
  tensors on any device.
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
- Namespaces (tenant isolation): ``match_prefix``/``insert`` take an optional
  ``cache_salt``. Keys without a salt live under ``root``; keys with salt ``s``
  live under a ``NamespaceNode`` stored as ``root.children[s]`` (a str key,
  which never collides with the int/tuple token keys). A namespace node is a
  root of its own: empty key and value, lock_ref fixed at 1, never evictable;
  lock/unlock/touch walks stop at it (every walk stops at the first empty
  key). It exists only while it has children: ``insert`` creates it, ``evict``
  drops it with its last child, and a match under an unknown salt returns
  ``root`` as ``last_node`` (a 0-token hit; locking it is a no-op). So
  requests with different salts never share a slot, and the same salt (or
  none) shares exactly as without salts. The eviction order is global
  (LRU/LFU across all namespaces).

Keys are compared as runs (list slices compare in C), never token by token
in Python. Slots stay in numpy from insert to evict (torch is touched once
per match, to hand out the result): on the scheduler's path each torch call
costs several µs, more than the rest of a tree operation.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
from sortedcontainers import SortedList

from radixrt.cache.allocator import KVSlotAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("id", "key", "_np", "parent", "children", "lock_ref",
                 "last_access", "hit_count", "entry")

    def __init__(self, node_id: int, key: list[int], value: np.ndarray | torch.Tensor,
                 parent: TreeNode | None) -> None:
        self.id = node_id
        self.key = key
        self._np = _slots_np(value)  # int64 slot ids, on the CPU
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.entry: tuple | None = None  # its tuple in the evictable set, if there

    @property
    def value(self) -> torch.Tensor:
        """The node's slots: an int64 CPU tensor sharing the node's memory."""
        return torch.from_numpy(self._np)

    @value.setter
    def value(self, value: torch.Tensor | np.ndarray) -> None:
        self._np = _slots_np(value)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class NamespaceNode(TreeNode):
    """The root of one ``cache_salt``'s subtree (see the module docstring)."""

    __slots__ = ("salt",)

    def __init__(self, node_id: int, salt: str, parent: TreeNode) -> None:
        super().__init__(node_id, [], np.empty(0, dtype=np.int64), parent)
        self.salt = salt
        self.lock_ref = 1  # like the root: never evictable

    def __repr__(self) -> str:
        return f"NamespaceNode(id={self.id}, salt={self.salt!r}, children={len(self.children)})"


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
        self.root = self._new_node([], np.empty(0, dtype=np.int64), None)
        self.root.lock_ref = 1  # the root is never evictable
        self.evictable_size = 0
        self.protected_size = 0
        self._evictable = SortedList()

    # ------------------------------------------------------------------ API

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (page-aligned) in ``cache_salt``'s namespace.

        If the hit ends inside an edge, that edge is split so ``last_node``
        covers exactly the hit. Refreshes last access (and, for LFU, the hit
        count) of every node on the path. A miss returns the namespace node
        (or ``root`` when the salt has nothing cached) as ``last_node``.
        """
        key = self._page_align(_as_list(token_ids))
        node = self.root if cache_salt is None else self._namespace(cache_salt, create=False)
        if node is None:
            return MatchResult(0, _EMPTY, self.root)  # nothing cached under this salt
        pos, values = 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            split = n < len(child.key)
            if split:
                child = self._split(child, n)
            values.append(child._np)
            pos += n
            node = child
            if split:
                break
        self._touch_path(node, hit=True)
        if not values:
            return MatchResult(0, _EMPTY, node)
        kv = np.concatenate(values) if len(values) > 1 else values[0]
        return MatchResult(pos, torch.from_numpy(kv), node)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor,
               cache_salt: str | None = None) -> int:
        """Add ``token_ids`` → ``kv_indices`` under ``cache_salt``; return how many were cached.

        The tree keeps its own slots for the already-cached prefix; the
        caller's slots for those tokens stay the caller's to free. Only the
        page-aligned part of the key is inserted. Splits edges where the new
        path forks from an existing one. Only the salt's own namespace counts
        as cached (created here on its first non-empty insert).
        """
        key = self._page_align(_as_list(token_ids))
        num_kv = kv_indices.size if isinstance(kv_indices, np.ndarray) else kv_indices.numel()
        if num_kv < len(key):
            raise ValueError(f"insert: {len(key)} tokens but only {num_kv} kv_indices")
        node = self.root if cache_salt is None or not key else self._namespace(cache_salt)
        pos = 0
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
            # The tree owns copies of its keys and values. _as_list hands
            # back the caller's own list, but _page_align (page_size > 1)
            # and any conversion make a fresh one.
            private = pos or self.page_size > 1 or not isinstance(token_ids, list)
            leaf_key = key[pos:] if pos else (key if private else key[:])
            value = _slots_np(kv_indices)[pos:len(key)].copy()
            self._touch_path(node, hit=False, new_leaf=(leaf_key, value))
        else:
            self._touch_path(node, hit=False)
        return pos

    def lock(self, node: TreeNode) -> None:
        """lock_ref += 1 on node and every ancestor below its root (root or namespace)."""
        while node.key:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                if node.entry is not None:
                    self._evictable.remove(node.entry)
                    node.entry = None
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """lock_ref -= 1 on node and every ancestor below its root; raises if a ref would go below 0."""
        if node.key and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} which is not locked")
        while node.key:
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
        evictable). A parent left childless and unlocked becomes a candidate;
        a namespace left childless is dropped.
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
            if not parent.children:
                if parent.key:
                    if parent.lock_ref == 0:
                        self._add_evictable(parent)
                elif parent is not self.root:
                    self._drop_namespace(parent)
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
        slots = [n._np for n in self._nodes() if n is not self.root]
        if slots:
            self.allocator.free(np.concatenate(slots))
        self._init_tree()

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for memory checks)."""
        vals = [n._np for n in self._nodes() if n is not self.root]
        return torch.from_numpy(np.concatenate(vals)) if vals else _EMPTY

    def check_integrity(self) -> None:
        """Walk the whole tree and assert every invariant; raises AssertionError."""
        evictable = protected = 0
        leaves = set()
        values = []
        for node in self._nodes():
            if node is self.root:
                assert node.parent is None and not node.key
                continue
            if not node.key:
                self._check_namespace(node)
                continue
            self._check_node(node)
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
            if not node.children and node.lock_ref == 0:
                leaves.add(node.id)
            values.append(node._np)
        assert evictable == self.evictable_size, f"evictable_size {self.evictable_size} != {evictable}"
        assert protected == self.protected_size, f"protected_size {self.protected_size} != {protected}"
        in_set = {e[-1].id for e in self._evictable}
        assert len(in_set) == len(self._evictable), "a node is in the evictable set twice"
        assert in_set == leaves, f"evictable set {sorted(in_set)} != unlocked leaves {sorted(leaves)}"
        for e in self._evictable:
            assert e is e[-1].entry and e == self._entry(e[-1]), f"stale evictable entry {e[:-1]}"
        slots = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
        assert slots.size == np.unique(slots).size, "a slot is held by two tree nodes"
        if slots.size:
            assert int(slots.min()) >= self.page_size, "the tree holds a reserved slot"
            assert int(slots.max()) < self.allocator.num_slots, "the tree holds an out-of-range slot"
            assert not bool(self.allocator.is_free(torch.from_numpy(slots)).any()), \
                "a slot is both free and in the tree"

    # ------------------------------------------------------------ internals

    def _check_node(self, node: TreeNode) -> None:
        p = self.page_size
        assert node.key, f"{node!r} has an empty key"
        assert isinstance(node._np, np.ndarray) and node._np.dtype == np.int64 \
            and node._np.ndim == 1, f"{node!r}: value is not a 1-D int64 array"
        assert len(node.key) == node._np.size, f"{node!r}: key/value lengths differ"
        assert len(node.key) % p == 0, f"{node!r}: key is not page-aligned"
        assert node.parent.children.get(self._child_key(node.key, 0)) is node, f"{node!r}: bad parent link"
        child_refs = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_refs, f"{node!r}: lock_ref below its children's sum {child_refs}"
        assert node.lock_ref >= 0

    def _check_namespace(self, ns: TreeNode) -> None:
        assert isinstance(ns, NamespaceNode), f"{ns!r} has an empty key"
        assert ns.parent is self.root and self.root.children.get(ns.salt) is ns, f"{ns!r}: bad parent link"
        assert ns._np.size == 0 and ns.lock_ref == 1 and ns.entry is None, f"{ns!r}: not root-like"
        assert ns.children, f"{ns!r} is empty but still in the tree"

    def _namespace(self, salt: str, create: bool = True) -> NamespaceNode | None:
        """The namespace node of ``salt``; if missing, a new one (or None when not ``create``)."""
        if type(salt) is not str:  # an int would find a token child of the root
            raise TypeError(f"cache_salt must be a str or None, got {salt!r}")
        ns = self.root.children.get(salt)
        if ns is None:
            if not create:
                return None
            ns = NamespaceNode(self._next_id, salt, self.root)
            self._next_id += 1
            self.root.children[salt] = ns
        return ns

    def _drop_namespace(self, ns: NamespaceNode) -> None:
        del self.root.children[ns.salt]
        ns.parent = None

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new_node(self, key: list[int], value: np.ndarray, parent: TreeNode | None) -> TreeNode:
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
        upper = self._new_node(child.key[:n], child._np[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        parent.children[self._child_key(upper.key, 0)] = upper
        child.key = child.key[n:]
        child._np = child._np[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _touch_path(self, node: TreeNode, hit: bool,
                    new_leaf: tuple[list[int], np.ndarray] | None = None) -> None:
        """Refresh last_access (and hit_count) from node up to its root (root or namespace).

        With ``new_leaf`` = (key, value), first hang a new leaf under node and
        start the walk from it (so it enters the evictable set once, current).
        """
        self._clock += 1
        clock = self._clock
        if new_leaf is not None:
            key, value = new_leaf
            leaf = self._new_node(key, value, node)
            leaf.last_access = clock
            if not node.children:
                self._remove_evictable(node)  # no longer a leaf
            node.children[self._child_key(key, 0)] = leaf
            self.evictable_size += len(key)
            self._add_evictable(leaf)
        else:
            leaf = node
            if leaf.entry is not None:
                self._remove_evictable(leaf)
                leaf.last_access = clock
                leaf.hit_count += hit
                self._add_evictable(leaf)
                node = leaf.parent
        while node.key:
            node.last_access = clock
            node.hit_count += hit
            node = node.parent

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


def _slots_np(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """1-D int64 numpy array of slot ids (a view of CPU int64 tensors)."""
    if isinstance(slots, torch.Tensor):
        if not slots.is_cpu:
            slots = slots.cpu()
        slots = slots.numpy()
    if slots.dtype != np.int64:
        slots = slots.astype(np.int64)
    return slots if slots.ndim == 1 else slots.reshape(-1)


def _as_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, list):
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)
