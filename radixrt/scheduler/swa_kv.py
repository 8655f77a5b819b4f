"""KV bookkeeping for a model with sliding-window layers (``SWAKVPool``).

``SWAKVManager`` is ``KVManager`` over two slot pools (``SWASlotAllocator``: the full
layers' slots, indexed by ``req_to_token``, and the sliding layers' slots, reached through
the allocator's translation) and an ``SWARadixCache`` of window W. Beyond ``KVManager``'s
transitions:
- a lock on the tree is also a window lock on its last W tokens (``SWARadixCache.lock``);
  ``req.swa_released`` says how far behind its window req has given back SWA KV, and
  whether it still holds the window lock (``released < prefix_len``);
- after every forward (``advanced``) a request gives back the SWA slots of the positions its
  next token's window no longer reads, so what it holds in the sliding layers stays O(W);
- slots are made by evicting from whichever pool is short (``evict``, ``evict_swa``).
Page size 1 only; no hierarchical tiers.
"""

from __future__ import annotations

from radixrt.cache.hicache import HierarchicalCache
from radixrt.cache.swa_allocator import SWASlotAllocator
from radixrt.cache.swa_cache import SWARadixCache, check_swa_partition
from radixrt.cache.swa_pool import SWAKVPool
from radixrt.scheduler.kv import KVManager
from radixrt.scheduler.req import Req


class SWAKVManager(KVManager):
    def __init__(
        self,
        pool: SWAKVPool,
        page_size: int,
        disable_radix_cache: bool,
        window: int,
        eviction_policy: str = "lru",
    ) -> None:
        if page_size != 1:
            raise ValueError(
                f"page_size {page_size}: a model with sliding-window layers runs with page_size 1"
            )
        self.window = window
        super().__init__(pool, page_size, disable_radix_cache, eviction_policy, None)
        pool.full_to_swa = self.allocator.full_to_swa  # how sliding layers find their rows

    def _make_cache(self, page_size: int, eviction_policy: str) -> tuple:
        allocator = SWASlotAllocator(self.pool.num_slots, self.pool.num_swa_slots)
        return allocator, SWARadixCache(allocator, self.window, page_size, eviction_policy)

    def free_for_new(self) -> int:
        a, t = self.allocator, self.tree
        return min(a.available + t.evictable_size, a.swa_available + t.swa_evictable_size)

    def admit(self, req: Req) -> bool:
        if not super().admit(req):
            return False
        req.swa_released = self.tree.window_start(req.prefix_len)
        return True

    def evict(self, num_tokens: int) -> int:
        freed = super().evict(num_tokens)
        self.tree.evict_swa(max(0, num_tokens - self.allocator.swa_available))
        return freed

    def _relock(self, req: Req, node, prefix_len: int) -> None:
        super()._relock(req, node, prefix_len)
        req.swa_released = self.tree.window_start(prefix_len)

    def _unlock(self, req: Req) -> None:
        window = req.swa_released < req.prefix_len
        self.tree.unlock(req.last_node, window=window, released=req.swa_released)

    def advanced(self, req: Req) -> None:
        row = self.pool.req_to_token[req.row].cpu()
        req.swa_released = self.tree.release_behind(
            req.last_node, req.prefix_len, row, req.swa_released, req.kv_len
        )

    def check(self, idle: bool) -> None:
        check_swa_partition(self.allocator, self.tree, self.private_slots(), window=self.window)
        super().check(idle)
        if idle:
            a, t = self.allocator, self.tree
            assert t.swa_protected_size == 0, f"swa_protected_size {t.swa_protected_size} at idle"
            total = a.swa_available + t.swa_evictable_size
            assert total == a.swa_capacity, (
                f"SWA available + evictable = {total} != capacity {a.swa_capacity}"
            )

    def stats(self) -> dict[str, int]:
        """Both pools' slots (``SWARadixCache.pool_stats``)."""
        return self.tree.pool_stats()


def kv_manager(pool, config, hicache: HierarchicalCache | None = None) -> KVManager:
    """The KV bookkeeping for ``pool``: ``SWAKVManager`` for a pool with sliding-window
    layers (``SWAKVPool``, which takes no hierarchical cache), else ``KVManager``."""
    if not isinstance(pool, SWAKVPool):
        return KVManager(
            pool, config.page_size, config.disable_radix_cache, config.eviction_policy, hicache
        )
    if hicache is not None:
        raise ValueError(
            "enable_hierarchical_cache: a model with sliding-window layers keeps only its "
            "window's KV in those layers, which the host and storage tiers do not hold; "
            "serve it without the hierarchical cache"
        )
    return SWAKVManager(
        pool, config.page_size, config.disable_radix_cache, pool.window, config.eviction_policy
    )
