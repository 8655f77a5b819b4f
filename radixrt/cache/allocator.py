"""Free list of KV slot indices.

Contract:
- Slot ids live in ``[0, num_slots)``. The first page (slot 0 when
  ``page_size == 1``) is reserved: padding writes go there and it is never
  handed out. ``capacity == num_slots - page_size`` slots can be handed out.
- ``alloc(n)`` hands out whole pages. It returns the first ``n`` slots of
  ``ceil(n / page_size)`` fresh pages, in order. The unused slots of the last
  page are the request's *tail page*: they stay with the request, and
  ``alloc_extend(n, last_slot)`` fills them first (slots of a request fill its
  pages in order) before taking fresh pages.
- ``free(slots)`` returns the pages that hold ``slots``. A page is owned by
  exactly one party (the free list, one radix-tree node or one request), so
  freeing any slot of a page frees all of it.
- ``available`` counts free *slots* (free pages × page_size).
- Freeing a slot that is free, reserved, out of range or never handed out
  raises ``ValueError``. That check is always on (one vectorized lookup);
  ``debug=True`` also checks duplicates and the free list's consistency.
"""

from __future__ import annotations

import torch


class KVSlotAllocator:
    """Hands out KV slots in whole pages; page 0 is reserved for padding."""

    def __init__(self, num_slots: int, page_size: int = 1, *, debug: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots % page_size != 0:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size ({page_size})")
        if num_slots < 2 * page_size:
            raise ValueError(f"num_slots ({num_slots}) must hold at least 2 pages of {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.debug = debug
        self.clear()

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out (all but the reserved page)."""
        return self.num_slots - self.page_size

    @property
    def available(self) -> int:
        return self._top * self.page_size

    def clear(self) -> None:
        """Return every page to the free list (forgets all owners)."""
        # The free list is a stack: _stack[:_top] are the free page ids, so
        # alloc and free cost O(pages moved), whatever the pool size.
        self._stack = torch.arange(self.num_pages - 1, 0, -1, dtype=torch.int64)
        self._top = self.num_pages - 1
        self._page_is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._page_is_free[0] = False

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots in fresh pages, or None (and nothing taken) if too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        pages = self._take_pages(-(-n // self.page_size))
        if pages is None:
            return None
        return self._page_slots(pages)[:n]

    def alloc_extend(self, n: int, last_slot: int) -> torch.Tensor | None:
        """n slots that continue a request whose last slot is ``last_slot``.

        The rest of last_slot's page is used first, then fresh pages. With
        page_size 1 (or last_slot < 0, meaning "no slots yet") this is alloc(n).
        """
        p = self.page_size
        if p == 1 or last_slot < 0:
            return self.alloc(n)
        in_tail = min(n, p - 1 - last_slot % p)
        tail = torch.arange(last_slot + 1, last_slot + 1 + in_tail, dtype=torch.int64)
        if in_tail == n:
            return tail
        fresh = self.alloc(n - in_tail)
        return None if fresh is None else torch.cat([tail, fresh])

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages holding ``slots`` to the free list."""
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(torch.int64)
        if int(slots.min()) < self.page_size or int(slots.max()) >= self.num_slots:
            raise ValueError(f"free: slot ids must be in [{self.page_size}, {self.num_slots}); "
                             f"got min {int(slots.min())}, max {int(slots.max())}")
        pages = slots if self.page_size == 1 else torch.unique(slots // self.page_size)
        if self.debug and pages.numel() != torch.unique(pages).numel():
            raise ValueError("free: the same slot was passed twice")
        already = self._page_is_free[pages]
        if bool(already.any()):
            bad = pages[already][:8] * self.page_size
            raise ValueError(f"free: slots {bad.tolist()} are already free (double free, "
                             "or never handed out)")
        self._page_is_free[pages] = True
        self._stack[self._top:self._top + pages.numel()] = pages
        self._top += pages.numel()
        if self.debug:
            self.check_integrity()

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each slot's page is on the free list."""
        return self._page_is_free[slots.to(torch.int64) // self.page_size]

    def free_slots(self) -> torch.Tensor:
        """Every free slot id (for integrity checks)."""
        return self._page_slots(self._stack[:self._top])

    def check_integrity(self) -> None:
        pages = self._stack[:self._top]
        assert pages.numel() == torch.unique(pages).numel(), "free list holds a page twice"
        assert int(self._page_is_free.sum()) == pages.numel(), "free flags disagree with free list"
        assert bool(self._page_is_free[pages].all()), "free list holds a page not flagged free"
        assert not bool(self._page_is_free[0]), "reserved page is on the free list"

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self._top:
            return None
        self._top -= num_pages
        pages = self._stack[self._top:self._top + num_pages].flip(0)
        self._page_is_free[pages] = False
        return pages

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages.clone()
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)
