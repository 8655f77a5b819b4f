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
- Slots come back as int64 CPU tensors; ``free``/``is_free`` also accept int
  tensors on any device (read on the CPU) and int numpy arrays.

The free list and a per-page state byte live in numpy arrays: each call moves
a handful of pages, and a few numpy calls cost far less than the equivalent
torch calls (this sits on the scheduler's critical path).
"""

from __future__ import annotations

import numpy as np
import torch

# Per-page state. "In use" is 0 so that one any() over the states of the
# pages being freed finds every bad one (free, or the reserved page).
_USED, _FREE, _RESERVED = 0, 1, 2


def _as_numpy(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """1-D int64 numpy array (a view where possible) of slot ids on any device."""
    if isinstance(slots, np.ndarray):
        arr = slots
    else:
        if slots.device.type != "cpu":
            slots = slots.cpu()
        arr = slots.numpy()
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    return arr


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
        self._offsets = np.arange(page_size, dtype=np.int64)
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
        self._stack = np.arange(self.num_pages - 1, 0, -1, dtype=np.int64)
        self._top = self.num_pages - 1
        self._state = np.full(self.num_pages, _FREE, dtype=np.uint8)
        self._state[0] = _RESERVED

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots in fresh pages, or None (and nothing taken) if too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        pages = self._take_pages(-(-n // self.page_size))
        if pages is None:
            return None
        return torch.from_numpy(pages if self.page_size == 1 else self._page_slots(pages)[:n])

    def alloc_extend(self, n: int, last_slot: int) -> torch.Tensor | None:
        """n slots that continue a request whose last slot is ``last_slot``.

        The rest of last_slot's page is used first, then fresh pages. With
        page_size 1 (or last_slot < 0, meaning "no slots yet") this is alloc(n).
        """
        p = self.page_size
        if p == 1 or last_slot < 0:
            return self.alloc(n)
        in_tail = min(n, p - 1 - last_slot % p)
        tail = np.arange(last_slot + 1, last_slot + 1 + in_tail, dtype=np.int64)
        if in_tail == n:
            return torch.from_numpy(tail)
        pages = self._take_pages(-(-(n - in_tail) // p))
        if pages is None:
            return None
        fresh = self._page_slots(pages)[:n - in_tail]
        return torch.from_numpy(np.concatenate([tail, fresh]))

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return the pages holding ``slots`` to the free list."""
        if slots.size == 0 if isinstance(slots, np.ndarray) else slots.numel() == 0:
            return
        slots = _as_numpy(slots)
        p = self.page_size
        if self.debug:
            self._check_range(slots)
            pages = np.unique(slots // p)
            if p == 1 and pages.size != slots.size:
                raise ValueError("free: the same slot was passed twice")
        else:
            pages = slots if p == 1 else np.unique(slots // p)
        # One gather checks everything: a page is freeable iff its state is
        # _USED (0); out-of-range ids raise IndexError, negative ones are
        # caught by the range check on the error path or by min() below.
        try:
            if int(pages.min()) < 1:
                raise IndexError
            bad = self._state[pages].any()
        except IndexError:
            bad = True
        if bad:
            self._raise_bad_free(slots, pages)
        self._state[pages] = _FREE
        self._stack[self._top:self._top + pages.size] = pages
        self._top += pages.size
        if self.debug:
            self.check_integrity()

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each slot's page is on the free list."""
        pages = _as_numpy(slots) // self.page_size
        return torch.from_numpy(self._state[pages] == _FREE).reshape(slots.shape)

    def free_slots(self) -> torch.Tensor:
        """Every free slot id (for integrity checks)."""
        return torch.from_numpy(self._page_slots(self._stack[:self._top]))

    def check_integrity(self) -> None:
        pages = self._stack[:self._top]
        assert pages.size == np.unique(pages).size, "free list holds a page twice"
        assert int((self._state == _FREE).sum()) == pages.size, "free flags disagree with free list"
        assert bool((self._state[pages] == _FREE).all()), "free list holds a page not flagged free"
        assert self._state[0] == _RESERVED, "reserved page is on the free list"
        assert int((self._state == _RESERVED).sum()) == 1, "a page other than page 0 is reserved"

    # ------------------------------------------------------------ internals

    def _check_range(self, slots: np.ndarray) -> None:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < self.page_size or hi >= self.num_slots:
            raise ValueError(f"free: slot ids must be in [{self.page_size}, {self.num_slots}); "
                             f"got min {lo}, max {hi}")

    def _raise_bad_free(self, slots: np.ndarray, pages: np.ndarray) -> None:
        self._check_range(slots)
        bad = pages[self._state[pages] != _USED][:8] * self.page_size
        raise ValueError(f"free: slots {bad.tolist()} are already free (double free, "
                         "or never handed out)")

    def _take_pages(self, num_pages: int) -> np.ndarray | None:
        """Pop num_pages page ids (a fresh array), or None and take nothing."""
        if num_pages > self._top:
            return None
        self._top -= num_pages
        pages = self._stack[self._top:self._top + num_pages][::-1].copy()
        self._state[pages] = _USED
        return pages

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        """Slot ids of ``pages``, page by page (always a fresh array)."""
        if self.page_size == 1:
            return pages.copy()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)
