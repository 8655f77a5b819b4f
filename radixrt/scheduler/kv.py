"""KV bookkeeping for requests: prefix match, slot allocation, insert, release.

The only place where a request's slots change owner. Every transition keeps
the invariant of ``radixrt.cache.check_slot_partition``: a slot is free, in
one tree node, or private to one request (see ``Req`` for the row layout).
With the radix cache disabled, nothing is matched and everything a request
held is freed when it leaves. Every match and insert is made in the
namespace of the request's ``params.cache_salt``, so requests with different
salts never share KV. A running request's token ids are handed to the tree
from an int64 ``TokenBuffer`` (converted once at admission, extended with
the decoded tokens as they are cached), not as lists: the tree packs a
list token by token on every call, an array with one memcpy.

With a hierarchical cache (``radixrt.cache.hicache``), admission continues the device hit
from the tiers below: the loaded run goes into new slots and into the tree (locked like any
hit) before the request's prefill; a request leaving writes its blocks down
(``write_through``), and the tree's evictions do (``write_back``).
"""

from __future__ import annotations

import numpy as np
import torch

from radixrt.cache import KVPool, KVSlotAllocator, RadixCache, TokenBuffer, check_slot_partition
from radixrt.cache.hicache import HierarchicalCache
from radixrt.scheduler.req import Req


class KVManager:
    def __init__(
        self,
        pool: KVPool,
        page_size: int,
        disable_radix_cache: bool,
        eviction_policy: str = "lru",
        hicache: HierarchicalCache | None = None,
    ) -> None:
        self.pool = pool
        self.hicache = None if disable_radix_cache else hicache
        self.allocator, self.tree = self._make_cache(page_size, eviction_policy)
        self.disabled = disable_radix_cache
        self.running: dict[str, Req] = {}  # requests holding a row
        self.token_ids: dict[str, TokenBuffer] = {}  # rid -> ids of a running request (cache on)
        self.evicted_tokens = 0

    def _make_cache(self, page_size: int, eviction_policy: str) -> tuple:
        """(the slot allocator, the radix tree) over the pool's slots."""
        allocator = KVSlotAllocator(self.pool.num_slots, page_size)
        on_evict = None if self.hicache is None else self.hicache.evicted
        return allocator, RadixCache(allocator, page_size, eviction_policy, on_evict=on_evict)

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def free_for_new(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.allocator.available + self.tree.evictable_size

    def prefix_len_hint(self, req: Req) -> int:
        """Cached prefix length for ``req`` (for ordering and probes: changes nothing in the
        tree)."""
        if self.disabled:
            return 0
        return self.tree.peek_prefix(req.fill_ids[: req.match_limit], req.params.cache_salt).hit_len

    def prefetch(self, req: Req) -> None:
        """Have the storage tier read ahead the blocks req will look for below the device."""
        if self.hicache is None or self.hicache.storage is None:
            return
        ids = np.asarray(req.fill_ids, dtype=np.int64)
        hit = self.tree.peek_prefix(ids[: req.match_limit], req.params.cache_salt).hit_len
        self.hicache.prefetch(ids, hit, req.params.cache_salt)

    def admit(self, req: Req) -> bool:
        """Give ``req`` a row and lock its cached prefix. False if no row is free."""
        row = self.pool.alloc_row()
        if row is None:
            return False
        req.row = row
        match = None
        if not self.disabled:
            room = min(req.fill_len + req.remaining_new_tokens, self.pool.max_context)
            ids = self.token_ids[req.rid] = TokenBuffer(req.prompt_ids, capacity=room)
            ids.extend(req.output_ids)  # a retracted request resumes with its output
            match = self.tree.match_prefix(ids.array[: req.match_limit], req.params.cache_salt)
        req.last_node = self.tree.root if match is None else match.last_node
        req.prefix_len = req.kv_len = 0 if match is None else match.hit_len
        self.tree.lock(req.last_node)
        if req.prefix_len:
            self.pool.req_to_token[row, : req.prefix_len] = match.kv_indices
        req.loaded_tokens = (0, 0)
        if self.hicache is not None and req.prefix_len < req.match_limit:
            self._load_below(req, ids.array)
        self.running[req.rid] = req
        return True

    def _load_below(self, req: Req, ids: np.ndarray) -> None:
        """Continue req's device hit with what the lower tiers hold: load it into new slots,
        insert it into the tree and lock it there instead of the device hit."""
        start, salt = req.prefix_len, req.params.cache_salt
        # The slots come as any extend's (req.kv_len == start; the device hit is locked, so
        # the eviction that may make room never takes it).
        loaded = self.hicache.load_prefix(
            ids, start, req.match_limit, salt, lambda n: self.alloc(req, n)
        )
        if loaded is None:
            return
        table = self.pool.req_to_token[req.row]
        inserted = self.tree.insert_prefix(ids[: loaded.end], table[: loaded.end], salt)
        assert inserted.cached_len == start, "the tree changed under a load"
        self.tree.lock(inserted.last_node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = inserted.last_node, loaded.end
        req.kv_len = loaded.end
        req.loaded_tokens = (loaded.host_tokens, loaded.storage_tokens)

    def alloc(self, req: Req, n: int) -> torch.Tensor | None:
        """n new slots continuing req's KV (evicting as needed); writes them into its row."""
        last = int(self.pool.req_to_token[req.row, req.kv_len - 1]) if req.kv_len else -1
        slots = self.allocator.alloc_extend(n, last)
        if slots is None:
            self.evict(n + self.page_size)
            slots = self.allocator.alloc_extend(n, last)
        if slots is not None:
            self.pool.req_to_token[req.row, req.kv_len : req.kv_len + n] = slots
        return slots

    def free_uncomputed(self, req: Req, n: int) -> None:
        """Free the n slots ``alloc`` gave req past its computed KV (a failed forward: garbage).

        With page_size > 1 the first of them may fill req's partly used tail
        page, which stays req's (``release`` frees it with the tail).
        """
        slots = self.pool.req_to_token[req.row, req.kv_len : req.kv_len + n]
        p = self.page_size
        if p > 1 and req.kv_len % p:
            slots = slots[p - req.kv_len % p :]
        self.allocator.free(slots.clone())

    def evict(self, num_tokens: int) -> int:
        freed = self.tree.evict(max(0, num_tokens - self.allocator.available))
        self.evicted_tokens += freed
        return freed

    def cache_computed(self, req: Req) -> None:
        """Insert req's computed KV into the tree and re-lock at its new end.

        Called after each prefill (chunk), so other requests can hit it. The
        request keeps only its unaligned tail private.
        """
        if self.disabled or req.kv_len == 0:
            return
        table = self.pool.req_to_token[req.row]
        ids, slots, salt = self._ids(req, req.kv_len), table[: req.kv_len], req.params.cache_salt
        inserted = self.tree.insert_prefix(ids, slots, salt)
        self.allocator.free(slots[req.prefix_len : inserted.cached_len].clone())
        table[: inserted.kv_indices.numel()] = inserted.kv_indices
        self._relock(req, inserted.last_node, inserted.kv_indices.numel())

    def _relock(self, req: Req, node, prefix_len: int) -> None:
        """Lock req's KV in the tree at ``node`` (``prefix_len`` tokens) instead of before."""
        self.tree.lock(node)
        self._unlock(req)
        req.last_node, req.prefix_len = node, prefix_len

    def _unlock(self, req: Req) -> None:
        """Drop the lock req holds on the tree."""
        self.tree.unlock(req.last_node)

    def advanced(self, req: Req) -> None:
        """Req's KV grew by a forward (``kv_len`` updated, the prefill cached): nothing to do
        here (``SWAKVManager`` gives back what its window left behind)."""

    def _ids(self, req: Req, n: int) -> np.ndarray:
        """``req.fill_ids[:n]`` from req's buffer, first extended with the tokens decoded since."""
        ids = self.token_ids[req.rid]
        if len(ids) < n:
            ids.extend(req.ids_slice(len(ids), n))
        return ids.array[:n]

    def release(self, req: Req) -> None:
        """Req leaves the running set (finish, abort or retraction): its KV goes to the tree
        (and, with ``write_through``, its full blocks to the tiers below)."""
        self.cache_computed(req)
        if self.hicache is not None and req.prefix_len:
            ids = self.token_ids[req.rid].array[: req.prefix_len]
            self.hicache.write_through(
                ids, self.pool.req_to_token[req.row, : req.prefix_len], req.params.cache_salt
            )
        tail = self.pool.req_to_token[req.row, req.prefix_len : req.kv_len].clone()
        self.allocator.free(tail)
        self._unlock(req)
        self.pool.free_row(req.row)
        del self.running[req.rid]
        self.token_ids.pop(req.rid, None)
        req.reset_kv()

    def stats(self) -> dict[str, int]:
        """Pool counters beyond the scheduler's own (``SWAKVManager``: both pools)."""
        return {}

    def private_slots(self) -> list[torch.Tensor]:
        table = self.pool.req_to_token
        return [table[r.row, r.prefix_len : r.kv_len] for r in self.running.values()]

    def check(self, idle: bool) -> None:
        """Assert the slot partition and each lower tier's bookkeeping (and, at idle, that
        nothing is protected or pinned)."""
        check_slot_partition(self.allocator, self.tree, self.private_slots())
        if self.hicache is not None:
            self.hicache.check(idle)
        assert self.token_ids.keys() <= self.running.keys(), (
            "token ids kept for a request that left"
        )
        if idle:
            assert not self.running, f"{len(self.running)} requests still hold KV at idle"
            assert self.tree.protected_size == 0, (
                f"protected_size {self.tree.protected_size} at idle"
            )
            total = self.allocator.available + self.tree.evictable_size
            assert total == self.allocator.capacity, (
                f"available + evictable = {total} != capacity {self.allocator.capacity}"
            )

    def flush(self) -> None:
        """Drop the device tree and the host tier (storage keeps its files: it is the tier
        that outlives the process)."""
        if self.running:
            raise RuntimeError(f"flush_cache with {len(self.running)} running requests")
        self.tree.reset()
        if self.hicache is not None:
            self.hicache.clear_host()
