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
  freeing any slot of a page frees all of it. The pages of the latest free
  are the next handed out, in the order they were freed: a run of consecutive
  slots freed in order comes back as the same run (attention reads a prefix
  in consecutive slots in place).
- ``available`` counts free *slots* (free pages × page_size).
- Freeing a slot that is free, reserved, out of range or never handed out
  raises ``ValueError`` and frees nothing. That check is always on (one
  vectorized lookup). With page_size 1, a slot passed twice in one call
  raises too (always for frees of up to 16 slots, else with ``debug=True``);
  ``debug=True`` also checks the free list's consistency after each free.
- Slots come back as int64 CPU tensors; ``free``/``is_free`` also accept int
  tensors on any device (read on the CPU) and int numpy arrays.

The free list (a numpy stack of page ids) and one state byte per page (a
bytearray with a numpy view) are built for the scheduler's hot path: small
frees run in plain Python, large ones in a few numpy calls; no torch call
but the one that wraps a result.
"""

from __future__ import annotations

import numpy as np
import torch

# Per-page state. "In use" is 0 so that one any() over the states of the
# pages being freed finds every bad one (free, reserved or out of range).
_USED, _FREE, _RESERVED = 0, 1, 2
# Frees of at most this many slots take the plain-Python path.
_SMALL = 16
_INT64 = np.dtype(np.int64)


def _as_numpy(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """1-D int64 numpy array (a view where possible) of slot ids on any device."""
    if isinstance(slots, torch.Tensor):
        if not slots.is_cpu:
            slots = slots.cpu()
        slots = slots.numpy()
    if slots.ndim != 1:
        slots = slots.reshape(-1)
    if slots.dtype is not _INT64:
        slots = slots.astype(np.int64)
    return slots


class KVSlotAllocator:
    """Hands out KV slots in whole pages; page 0 is reserved for padding."""

    def __init__(self, num_slots: int, page_size: int = 1, *, debug: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots % page_size != 0:
            raise ValueError(
                f"num_slots ({num_slots}) must be a multiple of page_size ({page_size})"
            )
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
        # One state byte per page, plus a sentinel page past the end: the
        # vectorized check gathers with mode="clip", so ids below 0 land on
        # page 0 and ids past the end on the sentinel, both _RESERVED.
        self._state = bytearray([_FREE]) * (self.num_pages + 1)
        self._state[0] = self._state[self.num_pages] = _RESERVED
        self._state_np = np.frombuffer(self._state, dtype=np.uint8)
        # Page-size > 1 frees dedupe pages through this (see _free_vectorized).
        self._scratch = np.zeros(self.num_pages if self.page_size > 1 else 0, dtype=np.int64)

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
        fresh = self._page_slots(pages)[: n - in_tail]
        return torch.from_numpy(np.concatenate([tail, fresh]))

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return the pages holding ``slots`` to the free list."""
        if type(slots) is not np.ndarray:
            if not slots.is_cpu:
                slots = slots.cpu()
            slots = slots.numpy()
        n = slots.size
        if n > _SMALL:
            self._free_vectorized(
                slots if slots.dtype is _INT64 and slots.ndim == 1 else _as_numpy(slots)
            )
        elif n and slots.dtype.kind in "iu":
            self._free_small(slots.reshape(-1).tolist())
        elif n:
            self._free_vectorized(_as_numpy(slots))
        if self.debug:
            self.check_integrity()

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each slot's page is on the free list."""
        pages = _as_numpy(slots) // self.page_size
        return torch.from_numpy(self._state_np[pages] == _FREE).reshape(tuple(slots.shape))

    def free_slots(self) -> torch.Tensor:
        """Every free slot id (for integrity checks)."""
        return torch.from_numpy(self._page_slots(self._stack[: self._top]))

    def check_integrity(self) -> None:
        pages = self._stack[: self._top]
        states = self._state_np[: self.num_pages]
        assert pages.size == np.unique(pages).size, "free list holds a page twice"
        assert int((states == _FREE).sum()) == pages.size, "free flags disagree with free list"
        assert bool((states[pages] == _FREE).all()), "free list holds a page not flagged free"
        assert states[0] == _RESERVED, "reserved page is on the free list"
        assert int((states == _RESERVED).sum()) == 1, "a page other than page 0 is reserved"
        assert self._state[self.num_pages] == _RESERVED, "sentinel page changed"

    # ------------------------------------------------------------ internals

    def _free_small(self, slots: list[int]) -> None:
        p, state, num_pages = self.page_size, self._state, self.num_pages
        if p == 1:
            pages = slots
            if len(pages) > 1 and len(set(pages)) != len(pages):
                raise ValueError("free: the same slot was passed twice")
        else:
            pages = sorted({s // p for s in slots})
        for page in pages:
            if not 0 < page < num_pages or state[page] != _USED:
                self._raise_bad_free(
                    np.array(slots, dtype=np.int64), np.array(pages, dtype=np.int64)
                )
        for page in pages:
            state[page] = _FREE
        top = self._top
        self._stack[top : top + len(pages)] = pages[::-1]
        self._top = top + len(pages)

    def _free_vectorized(self, slots: np.ndarray) -> None:
        p = self.page_size
        if self.debug:
            self._check_range(slots)
            if p == 1 and np.unique(slots).size != slots.size:
                raise ValueError("free: the same slot was passed twice")
        pages = slots if p == 1 else slots // p
        state = self._state_np
        # One gather checks every page: any state but _USED (0) is a bad free.
        # (Its max through C-level methods: np.count_nonzero's Python wrapper
        # costs more than the whole scan at these sizes.)
        gathered = state.take(pages, mode="clip")
        if gathered.item(gathered.argmax()):
            self._raise_bad_free(slots, pages)
        if p > 1:
            # Each page once (the slots of a page usually come together):
            # scatter positions into a scratch array, keep the position that
            # stuck for each page. O(n), unlike a sort.
            order = np.arange(pages.size)
            self._scratch[pages] = order
            pages = pages[self._scratch[pages] == order]
        state[pages] = _FREE
        top = self._top
        self._stack[top : top + pages.size] = pages[::-1]
        self._top = top + pages.size

    def _check_range(self, slots: np.ndarray) -> None:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < self.page_size or hi >= self.num_slots:
            raise ValueError(
                f"free: slot ids must be in [{self.page_size}, {self.num_slots}); "
                f"got min {lo}, max {hi}"
            )

    def _raise_bad_free(self, slots: np.ndarray, pages: np.ndarray) -> None:
        self._check_range(slots)
        bad = np.unique(pages[self._state_np[pages] != _USED])[:8] * self.page_size
        raise ValueError(
            f"free: slots {bad.tolist()} are already free (double free, or never handed out)"
        )

    def _take_pages(self, num_pages: int) -> np.ndarray | None:
        """Pop num_pages page ids (a fresh array), or None and take nothing."""
        if num_pages > self._top:
            return None
        self._top -= num_pages
        pages = self._stack[self._top : self._top + num_pages][::-1].copy()
        self._state_np[pages] = _USED
        return pages

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        """Slot ids of ``pages``, page by page (always a fresh array)."""
        if self.page_size == 1:
            return pages.copy()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)
