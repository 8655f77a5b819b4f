"""The radix tree mapping token prefixes to KV slot indices.

Contract:
- Every node but the roots holds a non-empty ``key`` (token ids) and a
  ``value`` (int64 slot tensor of the same length). With page_size > 1 every
  key is a whole number of pages. The tree stores a key packed, as the
  native int64 bytes of its tokens (``node.key`` unpacks a fresh list):
  8 bytes a token rather than a list slot plus an int object, and freeing
  an evicted node is O(1) instead of freeing one int per token. Token ids
  must fit in int64. Values live on the CPU as int64 numpy arrays;
  ``node.value`` and ``MatchResult.kv_indices`` are CPU int64 tensors
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
  which never collides with the int/tuple token keys: ``node.head``, the
  first token, or with page_size > 1 the first page as a tuple). A
  namespace node is a root of its own: empty key and value, lock_ref fixed
  at 1, never evictable; lock/unlock/touch walks stop at it (every walk
  stops at the first empty key). It exists only while it has children:
  ``insert`` creates it, ``evict``
  drops it with its last child, and a match under an unknown salt returns
  ``root`` as ``last_node`` (a 0-token hit; locking it is a no-op). So
  requests with different salts never share a slot, and the same salt (or
  none) shares exactly as without salts. The eviction order is global
  (LRU/LFU across all namespaces).
- Events (``record_events=True``): every change to the tree's content or
  shape appends one ``radixrt.protocol`` KV event, in the order the changes
  happen: a new leaf or namespace node → ``KVStored`` (a namespace before its
  first leaf); a split (by ``match_prefix`` or ``insert``) → ``KVSplit``; each
  ``evict`` call that frees anything → one ``KVRemoved`` (leaves in removal
  order, a dropped namespace right after its last child); ``reset`` →
  ``KVCleared``. A lookup that changes no shape (a full hit, ``peek_prefix``)
  records nothing; access times and locks are not events. Replaying
  ``take_events()`` onto a ``MirrorTree`` (``radixrt.cache.mirror``) rebuilds
  this tree's content and shape with its node ids; ``snapshot_events()`` is
  the current tree as ``KVStored`` events, recording on or off.
- Observer: ``observer`` (a ``TreeObserver``, None by default) is told each change to the
  tree's token runs as it happens, with the nodes themselves: a new leaf, a split, a leaf
  ``evict`` is about to drop (still in the tree), a reset; namespace nodes are not reported.
  It must change nothing the tree owns. With none set, a change costs one ``is None`` test.

Keys are compared as runs, never token by token in Python: a lookup packs
the request's tokens once, in C (only as far as the edges it follows reach),
and compares packed runs with memcmp. Token ids may come as a list, tuple,
tensor or numpy array: packing an int64 array (or tensor) is a memcpy, a
list costs a conversion per token on every call, so the scheduler keeps a running
request's ids in a ``TokenBuffer`` (converted once). Slots stay in numpy
from insert to evict (torch is touched once per match, to hand out the
result): a torch call's dispatch costs more than the rest of a tree
operation.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch
from sortedcontainers import SortedList

from radixrt.cache.allocator import KVSlotAllocator
from radixrt.protocol import KVCleared, KVEvent, KVRemoved, KVSplit, KVStored

_EMPTY = torch.empty(0, dtype=torch.int64)
_TOKEN_BYTES = 8  # a packed key holds each token id as one native int64
_INT64 = np.dtype(np.int64)


class TreeNode:
    __slots__ = (
        "id",
        "_key",
        "head",
        "_np",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "hit_count",
        "entry",
    )

    def __init__(
        self,
        node_id: int,
        key: bytes,
        head: int | tuple[int, ...] | None,
        value: np.ndarray,
        parent: TreeNode | None,
    ) -> None:
        self.id = node_id
        self._key = key  # packed token ids (native int64); b"" for a root
        self.head = head  # the key of this node in parent.children
        self._np = value  # 1-D int64 numpy slot ids
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.entry: tuple | None = None  # its tuple in the evictable set, if there

    @property
    def key(self) -> list[int]:
        """The node's token ids (a fresh list, unpacked from the stored bytes)."""
        return np.frombuffer(self._key, dtype=np.int64).tolist()

    @property
    def num_tokens(self) -> int:
        return len(self._key) // _TOKEN_BYTES

    @property
    def value(self) -> torch.Tensor:
        """The node's slots: an int64 CPU tensor sharing the node's memory."""
        return torch.from_numpy(self._np)

    @value.setter
    def value(self, value: torch.Tensor | np.ndarray) -> None:
        self._np = _slots_np(value)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={self.num_tokens}, lock_ref={self.lock_ref})"


class NamespaceNode(TreeNode):
    """The root of one ``cache_salt``'s subtree (see the module docstring)."""

    __slots__ = ("salt",)

    def __init__(self, node_id: int, salt: str, parent: TreeNode) -> None:
        super().__init__(node_id, b"", salt, np.empty(0, dtype=np.int64), parent)
        self.salt = salt
        self.lock_ref = 1  # like the root: never evictable

    def __repr__(self) -> str:
        return f"NamespaceNode(id={self.id}, salt={self.salt!r}, children={len(self.children)})"


class TreeObserver(Protocol):
    """What ``RadixCache.observer`` is told, in the order the tree changes."""

    def on_stored(self, leaf: TreeNode) -> None:
        """A new leaf hangs under ``leaf.parent`` (a root, a namespace or a token node)."""

    def on_split(self, upper: TreeNode, child: TreeNode) -> None:
        """``child``'s edge was split: ``upper`` (new) holds its first tokens and is its parent."""

    def on_removed(self, leaf: TreeNode) -> None:
        """``evict`` is about to drop ``leaf``, still in the tree with its key and parent."""

    def on_cleared(self) -> None:
        """``reset`` emptied the tree."""


class MatchResult(NamedTuple):
    hit_len: int
    kv_indices: torch.Tensor  # int64 [hit_len]
    last_node: TreeNode


class InsertResult(NamedTuple):
    cached_len: int  # tokens the tree already held (the caller's slots for them are its to free)
    kv_indices: torch.Tensor  # int64 [inserted length]: the tree's slots for the whole inserted key
    last_node: TreeNode  # the node that ends exactly at the inserted key


class PeekResult(NamedTuple):
    hit_len: int
    last_node: TreeNode  # the node whose edge holds the hit's end (no split was made)


class TokenBuffer:
    """A request's token ids as a growable int64 array: the form the tree reads fastest.

    ``match_prefix``/``insert`` pack an int64 array with one memcpy, but a
    list of Python ints token by token, on every call. A request
    converts its ids once, when admitted (``TokenBuffer(prompt_ids)``), and
    ``extend``s it as it decodes; ``array`` is what it hands the tree.
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, token_ids: Sequence[int] = (), capacity: int = 0) -> None:
        """``capacity``: room for this many ids before the first reallocation."""
        self._buf = np.empty(max(16, capacity, len(token_ids)), dtype=np.int64)
        self._len = 0
        self.extend(token_ids)

    def __len__(self) -> int:
        return self._len

    @property
    def array(self) -> np.ndarray:
        """The token ids so far: a view into the buffer, which later ``extend``s may not reach."""
        return self._buf[: self._len]

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append token ids; raises ValueError (appending nothing) unless they fit in int64."""
        start, n = self._len, len(token_ids)
        if not n:
            return
        if start + n > self._buf.size:  # grow by doubling: O(1) amortized per token
            grown = np.empty(max(start + n, 2 * self._buf.size), dtype=np.int64)
            grown[:start] = self._buf[:start]
            self._buf = grown
        try:  # straight into the buffer; a failure leaves _len, so appends nothing
            _int64s(n).pack_into(self._buf, start * _TOKEN_BYTES, *token_ids)
        except struct.error as e:
            raise ValueError(f"token ids must be int64 integers: {e}") from None
        self._len = start + n


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two lists (or bytes), by slice comparisons in C."""
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

    window = 0  # the sliding window a hit's KV must cover (``SWARadixCache``); 0: none

    def __init__(
        self,
        allocator: KVSlotAllocator,
        page_size: int = 1,
        eviction_policy: str = "lru",
        record_events: bool = False,
        on_evict: Callable[[TreeNode], None] | None = None,
    ) -> None:
        """``record_events``: keep the KV events of every change for ``take_events``;
        ``on_evict(leaf)``: called with each leaf ``evict`` is about to drop, still in the tree
        with its slots (the hierarchical cache copies its KV down)."""
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"eviction_policy must be 'lru' or 'lfu', got {eviction_policy!r}")
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._head_struct = struct.Struct(f"{page_size}q")  # a node's first page
        self._events: list[KVEvent] | None = [] if record_events else None
        self.on_evict = on_evict
        self.observer: TreeObserver | None = None  # told every change (see the module docstring)
        self._init_tree()

    def _init_tree(self) -> None:
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node(b"", None, np.empty(0, dtype=np.int64), None)
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
        tokens = _as_tokens(token_ids)
        node = self.root if cache_salt is None else self._namespace(cache_salt, create=False)
        if node is None:
            return MatchResult(0, _EMPTY, self.root)  # nothing cached under this salt
        node, pos, values, _ = self._walk(node, tokens, self._aligned_len(tokens))
        self._touch_path(node, hit=True)
        return MatchResult(pos, _concat(values), node)

    def peek_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PeekResult:
        """The hit ``match_prefix`` would find, changing nothing: no split, no access time, no hit
        count. For ranking and admission probes; ``match_prefix`` is the lookup that takes a hit.

        ``last_node`` is the node whose edge holds the end of the hit (its whole edge when the hit
        ends on a node); on a miss, the namespace node (or ``root``).
        """
        tokens = _as_tokens(token_ids)
        node = self.root if cache_salt is None else self._namespace(cache_salt, create=False)
        if node is None:
            return PeekResult(0, self.root)
        node, pos, _, _ = self._walk(node, tokens, self._aligned_len(tokens), split=False)
        return PeekResult(pos, node)

    def insert(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, cache_salt: str | None = None
    ) -> int:
        """Add ``token_ids`` → ``kv_indices`` under ``cache_salt``; return how many were cached
        (``insert_prefix``'s ``cached_len``)."""
        return self.insert_prefix(token_ids, kv_indices, cache_salt).cached_len

    def insert_prefix(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, cache_salt: str | None = None
    ) -> InsertResult:
        """Add ``token_ids`` → ``kv_indices`` under ``cache_salt``; return how many tokens were
        cached already, the tree's slots for the whole key and the node ending at it.

        The tree keeps its own slots for the already-cached prefix; the
        caller's slots for those tokens stay the caller's to free. Only the
        page-aligned part of the key is inserted. Splits edges where the new
        path forks from an existing one, or where the key ends inside an edge.
        Only the salt's own namespace counts as cached (created here on its
        first non-empty insert). Refreshes the path's last access, not its hit
        count.
        """
        tokens = _as_tokens(token_ids)
        n = self._aligned_len(tokens)
        slots = _slots_np(kv_indices)  # the one torch call of an insert
        if slots.size < n:
            raise ValueError(f"insert: {n} tokens but only {slots.size} kv_indices")
        node = self.root if cache_salt is None else self._namespace(cache_salt, create=False)
        pos, packed, values = 0, b"", []
        if node is not None:
            node, pos, values, packed = self._walk(node, tokens, n)
        if pos == n:
            node = self._touch_path(node or self.root, hit=False)
            return InsertResult(pos, _concat(values), node)
        # The leaf's key: the packed rest of the request (bytes are immutable,
        # so the tree never shares state with the caller). Packing may reject
        # the tokens: up to here the tree gained at most a split, no content.
        done = len(packed) // _TOKEN_BYTES
        key = packed[pos * _TOKEN_BYTES :] if pos else packed
        if done < n:
            key += _pack(tokens, done, n)
        value = slots[pos:n].copy()
        if node is None:
            node = self._namespace(cache_salt)  # the salt's first key
        leaf = self._touch_path(node, hit=False, new_leaf=(key, self._unpack_head(key), value))
        return InsertResult(pos, _concat([*values, value]), leaf)

    def lock(self, node: TreeNode) -> None:
        """lock_ref += 1 on node and every ancestor below its root (root or namespace)."""
        while node._key:
            if node.lock_ref == 0:
                size = len(node._key) // _TOKEN_BYTES
                self.evictable_size -= size
                self.protected_size += size
                if node.entry is not None:
                    self._evictable.remove(node.entry)
                    node.entry = None
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """lock_ref -= 1 on node and every ancestor below its root; raises if a ref would go
        below 0."""
        if node._key and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} which is not locked")
        while node._key:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node._key) // _TOKEN_BYTES
                self.evictable_size += size
                self.protected_size -= size
                if not node.children:
                    self._add_evictable(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until num_tokens are freed.

        Returns the number of tokens freed (less than asked if nothing more is
        evictable). A parent left childless and unlocked becomes a candidate;
        a namespace left childless is dropped.
        """
        evictable, freed, slots = self._evictable, 0, []
        gone = None if self._events is None else []  # the removed ids, when recording
        while freed < num_tokens and evictable:
            node = evictable.pop(0)[-1]
            node.entry = None
            if self.on_evict is not None:
                self.on_evict(node)
            if self.observer is not None:
                self.observer.on_removed(node)
            slots.append(node._np)
            freed += len(node._key) // _TOKEN_BYTES
            parent = node.parent
            del parent.children[node.head]
            node.parent = None
            if gone is not None:
                gone.append(node.id)
            if not parent.children:
                if parent._key:
                    if parent.lock_ref == 0:
                        self._add_evictable(parent)
                elif parent is not self.root:
                    self._drop_namespace(parent)
                    if gone is not None:
                        gone.append(parent.id)
        if slots:
            self.evictable_size -= freed
            self.allocator.free(np.concatenate(slots) if len(slots) > 1 else slots[0])
            if gone is not None:
                self._events.append(KVRemoved(nodes=gone))
        return freed

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @property
    def num_evictable_leaves(self) -> int:
        return len(self._evictable)

    def reset(self) -> None:
        """Free every cached slot and empty the tree. Nothing may be locked."""
        if self.protected_size:
            raise RuntimeError(
                f"reset with {self.protected_size} tokens locked by running requests"
            )
        slots = [n._np for n in self._nodes() if n is not self.root]
        if slots:
            # In ascending order: the next allocations then get runs of consecutive slots.
            self.allocator.free(np.sort(np.concatenate(slots)))
        self._init_tree()
        if self._events is not None:
            self._events.append(KVCleared())
        if self.observer is not None:
            self.observer.on_cleared()

    def start_recording(self) -> None:
        """From now on, keep the KV events of every change (as ``record_events=True``); the
        tree so far is ``snapshot_events()``."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (always [] when not
        recording)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVStored]:
        """The tree as it is now as ``KVStored`` events, parents before children.

        It includes changes not yet taken by ``take_events``: to pair it with a published
        sequence number, take and publish the pending events first.
        """
        events, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            events.append(self._stored_event(node))
            stack.extend(node.children.values())
        return events

    def cached_sequences(self) -> set[tuple[str | None, tuple[int, ...]]]:
        """Every (cache_salt, token ids from its root to a leaf) the tree holds: its content in
        a canonical form, independent of where edges are split."""
        sequences = set()
        for node in self._nodes():
            if node.children or node is self.root:
                continue
            runs = []
            while node._key:
                runs.append(node._key)
                node = node.parent
            salt = node.salt if isinstance(node, NamespaceNode) else None
            tokens = np.frombuffer(b"".join(reversed(runs)), dtype=np.int64)
            sequences.add((salt, tuple(tokens.tolist())))
        return sequences

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
                assert node.parent is None and not node._key
                continue
            if not node._key:
                self._check_namespace(node)
                continue
            self._check_node(node)
            if node.lock_ref == 0:
                evictable += node.num_tokens
            else:
                protected += node.num_tokens
            if not node.children and node.lock_ref == 0:
                leaves.add(node.id)
            values.append(node._np)
        assert evictable == self.evictable_size, (
            f"evictable_size {self.evictable_size} != {evictable}"
        )
        assert protected == self.protected_size, (
            f"protected_size {self.protected_size} != {protected}"
        )
        in_set = {e[-1].id for e in self._evictable}
        assert len(in_set) == len(self._evictable), "a node is in the evictable set twice"
        assert in_set == leaves, (
            f"evictable set {sorted(in_set)} != unlocked leaves {sorted(leaves)}"
        )
        for e in self._evictable:
            assert e is e[-1].entry and e == self._entry(e[-1]), f"stale evictable entry {e[:-1]}"
        slots = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
        assert slots.size == np.unique(slots).size, "a slot is held by two tree nodes"
        if slots.size:
            assert int(slots.min()) >= self.page_size, "the tree holds a reserved slot"
            assert int(slots.max()) < self.allocator.num_slots, (
                "the tree holds an out-of-range slot"
            )
            assert not bool(self.allocator.is_free(torch.from_numpy(slots)).any()), (
                "a slot is both free and in the tree"
            )

    # ------------------------------------------------------------ internals

    def _check_node(self, node: TreeNode) -> None:
        p = self.page_size
        assert isinstance(node._key, bytes) and node._key, f"{node!r} has an empty key"
        assert len(node._key) % _TOKEN_BYTES == 0, f"{node!r}: key is not whole int64 tokens"
        assert (
            isinstance(node._np, np.ndarray) and node._np.dtype == np.int64 and node._np.ndim == 1
        ), f"{node!r}: value is not a 1-D int64 array"
        assert node.num_tokens == node._np.size, f"{node!r}: key/value lengths differ"
        assert node.num_tokens % p == 0, f"{node!r}: key is not page-aligned"
        assert node.head == self._child_key(node.key, 0), f"{node!r}: head is not its first page"
        assert node.parent.children.get(node.head) is node, f"{node!r}: bad parent link"
        child_refs = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_refs, (
            f"{node!r}: lock_ref below its children's sum {child_refs}"
        )
        assert node.lock_ref >= 0

    def _check_namespace(self, ns: TreeNode) -> None:
        assert isinstance(ns, NamespaceNode), f"{ns!r} has an empty key"
        assert ns.parent is self.root and self.root.children.get(ns.salt) is ns, (
            f"{ns!r}: bad parent link"
        )
        assert ns._np.size == 0 and ns.lock_ref == 1 and ns.entry is None and ns.head == ns.salt, (
            f"{ns!r}: not root-like"
        )
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
            if self._events is not None:
                self._events.append(self._stored_event(ns))
        return ns

    def _stored_event(self, node: TreeNode) -> KVStored:
        """The ``KVStored`` event that creates ``node`` (under its current parent)."""
        if isinstance(node, NamespaceNode):
            return KVStored(node=node.id, parent=self.root.id, token_ids=[], cache_salt=node.salt)
        return KVStored(node=node.id, parent=node.parent.id, token_ids=node.key)

    def _drop_namespace(self, ns: NamespaceNode) -> None:
        del self.root.children[ns.salt]
        ns.parent = None

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new_node(
        self,
        key: bytes,
        head: int | tuple[int, ...] | None,
        value: np.ndarray,
        parent: TreeNode | None,
    ) -> TreeNode:
        node = TreeNode(self._next_id, key, head, value, parent)
        self._next_id += 1
        return node

    def _child_key(self, tokens: list[int], pos: int) -> int | tuple[int, ...]:
        """The children-dict key of a run starting at ``tokens[pos]`` (a token, or a page as a
        tuple)."""
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])

    def _aligned_len(self, tokens: list[int] | np.ndarray) -> int:
        return len(tokens) // self.page_size * self.page_size

    def _walk(
        self, node: TreeNode, tokens: list[int] | np.ndarray, n: int, split: bool = True
    ) -> tuple[TreeNode, int, list[np.ndarray], bytes]:
        """Follow ``tokens[:n]`` down from ``node`` as far as the tree has it.

        Where the run leaves an edge part-way, that edge is split so the last
        node ends exactly at the hit (``split=False``: nothing changes, and the
        last node is the child whose edge holds the hit's end). Returns (last node, hit length in
        tokens, the slot arrays along the path, the packed prefix of tokens
        it compared: at least ``hit`` tokens, at most n).

        Tokens are packed lazily, as the edges followed need them, in
        doubling steps (so O(log n) packs and O(n) bytes copied, however many
        edges); once that reaches half of the run, the whole run is packed.
        ``tokens`` is a list or an int64 array (see ``_as_tokens``); an
        array's heads are numpy ints, which hash and compare like the
        Python ints (and tuples of them) that key ``children``.
        """
        packed, done = b"", 0  # packed == pack(tokens[:done])
        pos, values, page = 0, [], self.page_size
        while pos < n:
            child = node.children.get(tokens[pos] if page == 1 else tuple(tokens[pos : pos + page]))
            if child is None:
                break
            edge = child._key
            end = min(n, pos + len(edge) // _TOKEN_BYTES)
            if end > done:
                stop = max(end, 2 * done)
                stop = n if 2 * stop >= n else stop
                packed += _pack(tokens, done, stop)
                done = stop
            if packed.startswith(edge, pos * _TOKEN_BYTES):
                pos += len(edge) // _TOKEN_BYTES
                values.append(child._np)
                node = child
                continue
            off = pos * _TOKEN_BYTES
            hit = common_prefix_len(edge, packed[off : off + len(edge)]) // _TOKEN_BYTES
            hit -= hit % page  # > 0: the child's first page matched
            node = self._split(child, hit) if split else child
            values.append(node._np[:hit])
            pos += hit
            break  # the run parts from the tree inside this edge
        return node, pos, values, packed

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child's edge after n tokens; return the new upper node."""
        parent, cut = child.parent, n * _TOKEN_BYTES
        upper = self._new_node(child._key[:cut], child.head, child._np[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        parent.children[upper.head] = upper
        child._key = child._key[cut:]
        child.head = self._unpack_head(child._key)
        child._np = child._np[n:]
        child.parent = upper
        upper.children[child.head] = child
        if self._events is not None:
            self._events.append(KVSplit(node=child.id, upper=upper.id, at=n))
        if self.observer is not None:
            self.observer.on_split(upper, child)
        return upper

    def _unpack_head(self, key: bytes) -> int | tuple[int, ...]:
        """The children-dict key of a packed run (its first token, or first page as a tuple)."""
        head = self._head_struct.unpack_from(key)
        return head[0] if self.page_size == 1 else head

    def _touch_path(
        self,
        node: TreeNode,
        hit: bool,
        new_leaf: tuple[bytes, int | tuple[int, ...], np.ndarray] | None = None,
    ) -> TreeNode:
        """Refresh last_access (and hit_count) from node up to its root (root or namespace);
        returns the path's lowest node.

        With ``new_leaf`` = (packed key, head, value), first hang a new leaf
        under node and start the walk from it (so it enters the evictable set
        once, current).
        """
        self._clock += 1
        clock = self._clock
        if new_leaf is not None:
            key, head, value = new_leaf
            leaf = self._new_node(key, head, value, node)
            leaf.last_access = clock
            if not node.children:
                self._remove_evictable(node)  # no longer a leaf
            node.children[head] = leaf
            self.evictable_size += len(key) // _TOKEN_BYTES
            self._add_evictable(leaf)
            if self._events is not None:
                self._events.append(self._stored_event(leaf))
            if self.observer is not None:
                self.observer.on_stored(leaf)
        else:
            leaf = node
            if leaf.entry is not None:
                self._remove_evictable(leaf)
                leaf.last_access = clock
                leaf.hit_count += hit
                self._add_evictable(leaf)
                node = leaf.parent
        while node._key:
            node.last_access = clock
            node.hit_count += hit
            node = node.parent
        return leaf

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


def _concat(values: list[np.ndarray]) -> torch.Tensor:
    """The slot arrays along a path as one int64 tensor (empty for none)."""
    if not values:
        return _EMPTY
    return torch.from_numpy(np.concatenate(values) if len(values) > 1 else values[0])


def _slots_np(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """1-D int64 numpy array of slot ids (a view of CPU int64 tensors)."""
    if type(slots) is not np.ndarray:
        if not slots.is_cpu:
            slots = slots.cpu()
        slots = slots.numpy()
    if slots.dtype is not _INT64:
        slots = slots.astype(np.int64)
    return slots if slots.ndim == 1 else slots.reshape(-1)


@functools.lru_cache(maxsize=256)
def _int64s(n: int) -> struct.Struct:
    """A Struct of n native int64s (compiled once per length in use)."""
    return struct.Struct(f"{n}q")


def _pack(tokens: list[int] | np.ndarray, start: int, stop: int) -> bytes:
    """``tokens[start:stop]`` as native int64 bytes: a memcpy of an int64 array, a C loop over a
    list."""
    if type(tokens) is np.ndarray:
        return tokens[start:stop].tobytes()
    run = tokens if start == 0 and stop == len(tokens) else tokens[start:stop]
    try:
        return _int64s(stop - start).pack(*run)
    except struct.error as e:
        raise ValueError(f"token ids must be int64 integers: {e}") from None


def _as_tokens(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int] | np.ndarray:
    """Token ids as a list, or (numpy arrays and tensors of ints that fit) a 1-D int64 array.

    The tree packs an int64 array's runs with memcpy, a list's token by
    token. Arrays of any other dtype become lists, so they get the list's
    checks (and its ValueError for what is not an int64 integer).
    """
    if isinstance(token_ids, list):
        return token_ids
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, torch.Tensor):
        arr = token_ids.cpu().numpy()
    else:
        return list(token_ids)  # a tuple, range, ...
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype == _INT64:
        return arr
    if arr.dtype.kind == "i" or (arr.dtype.kind == "u" and arr.dtype.itemsize < 8):
        return arr.astype(np.int64)
    return arr.tolist()
