"""Huge pages for CPU memory (``radixrt.memory``): advice the kernel may refuse, checked where
it takes it (Linux with transparent huge pages in "madvise" or "always" mode)."""

from __future__ import annotations

import ctypes
import mmap
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from radixrt import memory
from radixrt.cache.kv_pool import KVPool
from radixrt.memory import (
    HUGE_PAGE,
    HeapCollapser,
    anonymous_regions,
    collapse,
    collapse_anonymous_memory,
    huge_page_zeros,
    subtract,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages here",
)
_KERNEL = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
collapse_only = pytest.mark.skipif(_KERNEL < (6, 1), reason="MADV_COLLAPSE needs Linux >= 6.1")


def _huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = lo < end and hi > start
        elif inside and fields[0] == "AnonHugePages:":
            total += int(fields[1]) << 10
    return total


def test_huge_page_zeros_is_a_zeroed_tensor() -> None:
    t = huge_page_zeros((3, 5 << 20), torch.bfloat16)
    assert t.shape == (3, 5 << 20) and t.dtype == torch.bfloat16 and not t.any()


@thp_only
def test_huge_page_zeros_is_backed_by_huge_pages() -> None:
    t = huge_page_zeros((16 << 20,), torch.float32)  # 64 MiB
    start = t.data_ptr()
    assert _huge_bytes(start, start + t.nbytes) >= 16 * HUGE_PAGE


def test_cpu_kv_pool_buffers_are_views_of_one_zeroed_allocation() -> None:
    pool = KVPool(64, 3, 2, 8, torch.float32, 4, 32)
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    base = pool.k_buffers[0].untyped_storage().data_ptr()
    assert all(b.untyped_storage().data_ptr() == base for b in pool.k_buffers + pool.v_buffers)
    assert all(
        b.shape == (64, 2, 8) and b.is_contiguous() and not b.any()
        for b in pool.k_buffers + pool.v_buffers
    )
    pool.k_buffers[1].fill_(1.0)  # layers and K/V do not overlap
    assert not pool.k_buffers[0].any() and not pool.v_buffers[1].any()
    assert int(pool.k_buffers[1].sum()) == 64 * 2 * 8


def _touched_anonymous_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.write(b"\x01" * nbytes)  # faulted in as 4 KiB pages ("madvise" mode, no advice)
    buf = (ctypes.c_char * nbytes).from_buffer(mm)
    return mm, ctypes.addressof(buf)


@thp_only
@collapse_only
def test_collapse_turns_touched_memory_into_huge_pages() -> None:
    nbytes = 16 * HUGE_PAGE
    mm, start = _touched_anonymous_mapping(nbytes)
    assert _huge_bytes(start, start + nbytes) == 0
    assert collapse(start, start + nbytes) >= 15 * HUGE_PAGE
    assert _huge_bytes(start, start + nbytes) >= 14 * HUGE_PAGE  # the whole 2 MiB pages inside
    assert mm[:4] == b"\x01" * 4 and mm[-4:] == b"\x01" * 4  # contents kept


def test_subtract_regions() -> None:
    assert subtract([(0, 100), (200, 300)], [(10, 20), (90, 210), (250, 260)]) == [
        (0, 10),
        (20, 90),
        (210, 250),
        (260, 300),
    ]
    assert subtract([(0, 100)], []) == [(0, 100)]
    assert subtract([(0, 100)], [(0, 100)]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_collapse_anonymous_memory_takes_the_heap_and_new_mappings_only(monkeypatch) -> None:
    nbytes = 16 * HUGE_PAGE
    old, old_start = _touched_anonymous_mapping(nbytes)  # the host process's memory
    since = anonymous_regions(heap=False)
    new, new_start = _touched_anonymous_mapping(nbytes)
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(
        memory, "collapse", lambda start, end: asked.append((start, end)) or end - start
    )
    collapse_anonymous_memory(since=since)
    assert any(start <= new_start and new_start + nbytes <= end for start, end in asked)
    assert not any(start < old_start + nbytes and old_start < end for start, end in asked)
    heap = [r for r in anonymous_regions() if r not in anonymous_regions(heap=False)]
    assert all(r in asked for r in heap)
    del old, new


@thp_only
@collapse_only
def test_heap_collapser_collapses_growth_past_its_step() -> None:
    from radixrt.model.runner import keep_freed_memory

    if not keep_freed_memory():
        pytest.skip("not glibc: large blocks do not come from the heap")
    heap = HeapCollapser(step=8 * HUGE_PAGE)
    assert heap.maybe_collapse() == 0  # no growth yet
    blocks = []  # 4 MiB blocks come from the heap; grow it past the step (reusing free space first)
    while heap._heap_end() - heap.end < 10 * HUGE_PAGE and len(blocks) < 256:
        blocks.append(np.ones(4 << 20, dtype=np.uint8))
    if heap._heap_end() - heap.end < 10 * HUGE_PAGE:
        pytest.skip("the heap did not grow here (glibc extended it with mappings of its own)")
    done = heap.maybe_collapse()
    if done == 0:
        probe, start = _touched_anonymous_mapping(4 * HUGE_PAGE)
        can_collapse = collapse(start, start + 4 * HUGE_PAGE) > 0
        del probe
        if not can_collapse:  # fragmented or busy host memory: no huge page to collapse into
            pytest.skip("the kernel collapses nothing into huge pages right now")
    assert done >= 8 * HUGE_PAGE and heap.collapsed == done
    assert _huge_bytes(heap.end - done, heap.end) >= done - HUGE_PAGE
    assert heap.maybe_collapse() == 0  # nothing new since
    del blocks


def test_a_test_sized_engine_skips_huge_pages(tiny_llama: str) -> None:
    from radixrt import Engine

    with Engine(model=tiny_llama, dtype="float32", max_total_tokens=256) as eng:
        assert not eng.runner.huge_pages and eng.runner.heap is None
