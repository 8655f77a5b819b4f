"""Where a CPU model's memory lives (Linux): glibc's malloc thresholds and transparent huge pages.

``keep_freed_memory`` has glibc keep freed activation memory for the next forward.

A CPU forward streams the weights and activations through 4 KiB pages by
default: a TLB entry per page, and the hardware prefetchers stop at each page
boundary; 2 MiB pages take both costs away (THP in "madvise" mode, the common
default, grants them on request).

- ``huge_page_zeros`` allocates a large zeroed tensor advised for huge pages
  before anything touches it, so it is faulted in as 2 MiB pages (the KV pool).
- ``collapse_anonymous_memory(since)`` collapses (MADV_COLLAPSE, Linux >=
  6.1) the heap and the private anonymous memory mapped since an
  ``anonymous_regions()`` snapshot into huge pages: the weights (oneDNN's
  packed tensors do not expose their addresses) and the heap the activations
  will reuse, but not the large arrays the rest of a host process may hold.
  It copies the memory once; memory already in huge pages costs next to
  nothing.
- ``HeapCollapser`` collapses the heap's growth (where glibc puts activations
  under ``keep_freed_memory``) each time it has grown by a step: a few times
  while the first large batches arrive, then never.
All of it is advice: where the kernel refuses (no THP, an old kernel, not
Linux) nothing changes, and results never depend on it.
"""

from __future__ import annotations

import ctypes
import errno
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman.h

Region = tuple[int, int]  # [start, end) addresses


def _libc_fn(name: str, argtypes: list, restype=ctypes.c_int):
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_MADVISE = _libc_fn("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_SBRK = _libc_fn("sbrk", [ctypes.c_ssize_t], ctypes.c_void_p)
_MALLOPT = _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int])

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest
MALLOC_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc keep the memory of freed CPU activations for the next forward.

    By default glibc serves large blocks with fresh mmaps, and hands the top of
    the heap back to the OS, under thresholds it adapts as blocks are freed.
    Depending on a process's allocation history, every large activation of
    every forward can end up mapped, faulted in page by page and unmapped again,
    in some processes and not others. Fixed thresholds (blocks up to 32
    MiB from the heap; the heap trimmed only past 1 GiB free) keep that memory
    after the first forward. Process-wide; returns False (a no-op) off glibc.
    """
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(
        _MALLOPT(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


def _madvise(start: int, end: int, advice: int, tries: int = 2) -> int:
    """madvise the whole 2 MiB pages inside [start, end); the bytes it applied to. EAGAIN (a
    page briefly busy, seen with MADV_COLLAPSE) is retried."""
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if _MADVISE is None or hi <= lo:
        return 0
    for _ in range(tries):
        if _MADVISE(lo, hi - lo, advice) == 0:
            return hi - lo
        if ctypes.get_errno() != errno.EAGAIN:
            break
    return 0


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose whole 2 MiB pages are huge pages where the kernel allows.

    A ``torch.empty`` of 32 MiB or more is a fresh mapping nothing has touched yet, so the
    advice holds for every page as ``zero_`` faults it in; a smaller one is left as it is.
    """
    t = torch.empty(shape, dtype=dtype)
    if t.nbytes >= MALLOC_MMAP_THRESHOLD:  # glibc maps it apart; a smaller one lies in the heap,
        # and advice there would split the heap's mapping (a collapse across the split fails)
        _madvise(t.data_ptr(), t.data_ptr() + t.nbytes, MADV_HUGEPAGE)
    return t.zero_()


def _mappings() -> list[tuple[int, int, bool]]:
    """(start, end, is the heap) of each private, writable, anonymous mapping, in address order."""
    if not sys.platform.startswith("linux"):
        return []
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1] == "rw-p" and (len(fields) == 5 or fields[5] == "[heap]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, len(fields) > 5))
    return found


def anonymous_regions(heap: bool = True) -> list[Region]:
    """Each private, writable, anonymous mapping (and the heap, if ``heap``), in address order."""
    return [(start, end) for start, end, is_heap in _mappings() if heap or not is_heap]


def subtract(regions: list[Region], taken: list[Region]) -> list[Region]:
    """The parts of ``regions`` outside every region of ``taken`` (both in address order)."""
    out = []
    for start, end in regions:
        for t_start, t_end in taken:
            if t_end <= start or t_start >= end:
                continue
            if t_start > start:
                out.append((start, t_start))
            start = max(start, t_end)
        if start < end:
            out.append((start, end))
    return out


def collapse(start: int, end: int) -> int:
    """Collapse the whole 2 MiB pages of [start, end) into huge pages; the bytes collapsed."""
    return _madvise(start, end, MADV_COLLAPSE)


def collapse_anonymous_memory(since: list[Region] | None = None) -> int:
    """Collapse the heap and the anonymous memory mapped since ``since`` (an
    ``anonymous_regions(heap=False)`` snapshot; None: all of it) into huge pages; the bytes
    collapsed."""
    found = _mappings()
    mapped = [(start, end) for start, end, is_heap in found if not is_heap]
    if since is not None:
        mapped = subtract(mapped, since)
    heap = [(start, end) for start, end, is_heap in found if is_heap]
    return sum(collapse(start, end) for start, end in heap + mapped)


class HeapCollapser:
    """Collapses the heap's growth into huge pages, ``step`` bytes or more at a time."""

    def __init__(self, step: int = 64 << 20) -> None:
        self.step = step
        self.end = self._heap_end()  # the heap up to here is collapsed (or was not ours)
        self.collapsed = 0

    @staticmethod
    def _heap_end() -> int:
        return (_SBRK(0) or 0) if _SBRK is not None else 0

    def maybe_collapse(self) -> int:
        """Collapse [last end, heap end) if the heap grew by >= step since; the bytes collapsed."""
        end = self._heap_end()
        if not self.end or end - self.end < self.step:
            return 0
        # Mapping by mapping (the heap may be several): one collapse across two of them fails.
        done = sum(
            collapse(max(start, self.end), min(stop, end))
            for start, stop, is_heap in _mappings()
            if is_heap and start < end and stop > self.end
        )
        self.end, self.collapsed = end, self.collapsed + done
        return done
