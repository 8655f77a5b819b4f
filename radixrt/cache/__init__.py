"""KV memory: the slot allocator, the K/V pool, the radix tree and its event-built mirror."""

from __future__ import annotations

import torch

from radixrt.cache.allocator import KVSlotAllocator
from radixrt.cache.kv_pool import KVPool
from radixrt.cache.mirror import MirrorError, MirrorTree, ReplicaMirror
from radixrt.cache.radix_cache import (
    MatchResult,
    NamespaceNode,
    PeekResult,
    RadixCache,
    TokenBuffer,
    TreeNode,
)

__all__ = [
    "KVSlotAllocator",
    "KVPool",
    "MatchResult",
    "MirrorError",
    "MirrorTree",
    "NamespaceNode",
    "PeekResult",
    "RadixCache",
    "ReplicaMirror",
    "TokenBuffer",
    "TreeNode",
    "check_slot_partition",
]


def check_slot_partition(
    allocator: KVSlotAllocator, cache: RadixCache | None, private: list[torch.Tensor]
) -> None:
    """Assert every usable slot is in exactly one place.

    The places are: the free list, one tree node, or one running request's
    private slots (``private``, one tensor per request; with page_size > 1 a
    request owns the whole pages its slots fall in).
    """
    p = allocator.page_size
    parts = [allocator.free_slots()]
    if cache is not None:
        cache.check_integrity()
        parts.append(cache.all_slots())
    for slots in private:
        if slots.numel():
            pages = torch.unique(slots.to("cpu", torch.int64) // p)  # the pool may be on a GPU
            parts.append((pages[:, None] * p + torch.arange(p)).reshape(-1))
    owned = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    counts = torch.bincount(owned, minlength=allocator.num_slots)
    twice = torch.nonzero(counts > 1).flatten()
    assert twice.numel() == 0, f"slots held twice: {twice[:8].tolist()}"
    lost = torch.nonzero(counts[p:] == 0).flatten() + p
    assert lost.numel() == 0, f"slots leaked (held by nobody): {lost[:8].tolist()}"
    assert int(counts[:p].sum()) == 0, "the reserved page is held by someone"
