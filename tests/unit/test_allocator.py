"""KVSlotAllocator: reserved page, all-or-nothing alloc, free checks, pages, tail pages."""

from __future__ import annotations

import pytest
import torch

from radixrt.cache import KVSlotAllocator


def _drain(alloc: KVSlotAllocator, chunk: int) -> list[torch.Tensor]:
    """Allocate in chunks of ``chunk`` until the allocator refuses."""
    got = []
    while True:
        s = alloc.alloc(chunk)
        if s is None:
            return got
        got.append(s)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_capacity_and_reserved_page(page_size):
    num_slots = 8 * page_size
    alloc = KVSlotAllocator(num_slots, page_size)
    assert alloc.capacity == num_slots - page_size
    assert alloc.available == alloc.capacity
    got = torch.cat(_drain(alloc, page_size))
    # Every usable slot exactly once, never a slot of the reserved first page.
    assert sorted(got.tolist()) == list(range(page_size, num_slots))
    assert int(got.min()) >= page_size
    assert alloc.available == 0
    assert alloc.alloc(1) is None
    alloc.check_integrity()


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_alloc_never_returns_slot_zero(chunk):
    alloc = KVSlotAllocator(64, 1)
    got = _drain(alloc, chunk)
    flat = torch.cat(got)
    assert 0 not in flat.tolist()
    assert flat.numel() == torch.unique(flat).numel()
    assert flat.numel() == (alloc.capacity // chunk) * chunk
    assert flat.dtype == torch.int64


def test_alloc_zero_returns_empty():
    alloc = KVSlotAllocator(16, 4)
    s = alloc.alloc(0)
    assert s is not None and s.numel() == 0
    assert alloc.available == alloc.capacity


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_too_many_returns_none_and_takes_nothing(page_size):
    alloc = KVSlotAllocator(32, page_size)
    first = alloc.alloc(10)
    before = alloc.available
    free_before = sorted(alloc.free_slots().tolist())
    assert alloc.alloc(before + 1) is None
    assert alloc.available == before
    assert sorted(alloc.free_slots().tolist()) == free_before
    # Exactly what is left still fits.
    rest = alloc.alloc(before)
    assert rest is not None and rest.numel() == before
    assert alloc.available == 0
    assert not set(rest.tolist()) & set(first.tolist())
    alloc.check_integrity()


def test_alloc_negative_raises():
    with pytest.raises(ValueError):
        KVSlotAllocator(16).alloc(-1)


def test_constructor_validation():
    with pytest.raises(ValueError, match="page_size"):
        KVSlotAllocator(16, 0)
    with pytest.raises(ValueError, match="multiple"):
        KVSlotAllocator(18, 4)
    with pytest.raises(ValueError, match="2 pages"):
        KVSlotAllocator(4, 4)


def test_double_free_raises_and_changes_nothing():
    alloc = KVSlotAllocator(32, 1)
    s = alloc.alloc(4)
    alloc.free(s[:2])
    avail = alloc.available
    with pytest.raises(ValueError, match="already free"):
        alloc.free(s[:1])
    # A batch with one bad slot is rejected as a whole.
    with pytest.raises(ValueError, match="already free"):
        alloc.free(s[1:3])
    assert alloc.available == avail
    alloc.check_integrity()
    alloc.free(s[2:])
    assert alloc.available == alloc.capacity


def test_free_never_allocated_raises():
    alloc = KVSlotAllocator(32, 1)
    alloc.alloc(3)
    # A slot that was never handed out is still on the free list.
    never = int(alloc.free_slots()[0])
    with pytest.raises(ValueError, match="never handed out"):
        alloc.free(torch.tensor([never]))


@pytest.mark.parametrize("bad", [0, -1, 32, 1000])
def test_free_out_of_range_or_reserved_raises(bad):
    alloc = KVSlotAllocator(32, 1)
    alloc.alloc(4)
    with pytest.raises(ValueError, match=r"slot ids must be in \[1, 32\)"):
        alloc.free(torch.tensor([bad]))


def test_free_reserved_page_raises_paged():
    alloc = KVSlotAllocator(32, 4)
    alloc.alloc(8)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="must be in"):
            alloc.free(torch.tensor([bad]))


def test_free_empty_is_noop():
    alloc = KVSlotAllocator(16)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available == alloc.capacity


def test_debug_catches_duplicate_in_one_call():
    alloc = KVSlotAllocator(16, 1, debug=True)
    s = alloc.alloc(3)
    with pytest.raises(ValueError, match="twice"):
        alloc.free(torch.tensor([int(s[0]), int(s[0])]))


def test_free_then_realloc_reuses_slots():
    alloc = KVSlotAllocator(16, 1)
    a = alloc.alloc(alloc.capacity)
    alloc.free(a[3:8])
    b = alloc.alloc(5)
    assert sorted(b.tolist()) == sorted(a[3:8].tolist())
    assert alloc.alloc(1) is None


@pytest.mark.parametrize("n", [5, 40])  # the plain-Python and the vectorized free
def test_a_run_freed_in_order_comes_back_as_the_same_run(n):
    alloc = KVSlotAllocator(128, 1)
    a = alloc.alloc(100)
    alloc.free(a[10 : 10 + n])
    assert alloc.alloc(n).tolist() == a[10 : 10 + n].tolist()


@pytest.mark.parametrize("page_size", [2, 4, 16])
def test_paged_alloc_hands_whole_pages(page_size):
    p = page_size
    alloc = KVSlotAllocator(8 * p, p)
    n = p + 1
    s = alloc.alloc(n)
    assert s.numel() == n
    # Two whole pages are taken although only p + 1 slots are returned.
    assert alloc.available == alloc.capacity - 2 * p
    # Slots fill pages in order: the first page entirely, then page start.
    assert int(s[0]) % p == 0
    assert s[:p].tolist() == list(range(int(s[0]), int(s[0]) + p))
    assert int(s[p]) % p == 0
    pages = set((s // p).tolist())
    assert len(pages) == 2 and 0 not in pages
    # Freeing one slot returns its whole page.
    alloc.free(s[:1])
    assert alloc.available == alloc.capacity - p
    assert bool(alloc.is_free(s[:p]).all())
    assert not bool(alloc.is_free(s[p:]).any())
    # Freeing the lone slot of the tail page returns that page too.
    alloc.free(s[p:])
    assert alloc.available == alloc.capacity
    alloc.check_integrity()


def test_paged_double_free_via_other_slot_of_page_raises():
    alloc = KVSlotAllocator(16, 4)
    s = alloc.alloc(4)
    alloc.free(s[:1])
    with pytest.raises(ValueError, match="already free"):
        alloc.free(s[2:3])


def test_alloc_extend_fills_tail_page_first():
    p = 4
    alloc = KVSlotAllocator(16 * p, p)
    s = alloc.alloc(5)  # page A full, page B holds 1
    avail = alloc.available
    e = alloc.alloc_extend(2, int(s[-1]))  # fits in page B's tail
    assert e.tolist() == [int(s[-1]) + 1, int(s[-1]) + 2]
    assert alloc.available == avail  # nothing new taken
    e2 = alloc.alloc_extend(3, int(e[-1]))  # 1 left in page B, then a fresh page
    assert int(e2[0]) == int(e[-1]) + 1
    assert int(e2[0]) % p == p - 1
    assert int(e2[1]) % p == 0 and e2[1:].tolist() == [int(e2[1]), int(e2[1]) + 1]
    assert alloc.available == avail - p
    # Every slot of the request is distinct and the request's pages are whole.
    allslots = torch.cat([s, e, e2])
    assert allslots.numel() == torch.unique(allslots).numel()
    alloc.free(allslots)
    assert alloc.available == alloc.capacity
    alloc.check_integrity()


def test_alloc_extend_at_page_boundary_takes_fresh_pages():
    p = 4
    alloc = KVSlotAllocator(8 * p, p)
    s = alloc.alloc(p)  # exactly one page, no tail room
    avail = alloc.available
    e = alloc.alloc_extend(1, int(s[-1]))
    assert int(e[0]) % p == 0 and int(e[0]) // p != int(s[0]) // p
    assert alloc.available == avail - p


def test_alloc_extend_no_slots_yet_is_alloc():
    alloc = KVSlotAllocator(32, 4)
    e = alloc.alloc_extend(3, -1)
    assert e.numel() == 3 and int(e[0]) % 4 == 0
    assert alloc.available == alloc.capacity - 4


def test_alloc_extend_page_size_one():
    alloc = KVSlotAllocator(32, 1)
    s = alloc.alloc(3)
    e = alloc.alloc_extend(2, int(s[-1]))
    assert e.numel() == 2
    assert alloc.available == alloc.capacity - 5


def test_alloc_extend_failure_takes_nothing():
    p = 4
    alloc = KVSlotAllocator(4 * p, p)  # 3 usable pages
    s = alloc.alloc(2 * p + 1)  # all 3 pages; 3 tail slots left
    assert alloc.available == 0
    e = alloc.alloc_extend(3, int(s[-1]))  # fits in the tail: ok
    assert e is not None and e.numel() == 3
    assert alloc.alloc_extend(1, int(e[-1])) is None
    assert alloc.available == 0
    alloc.free(torch.cat([s, e]))
    assert alloc.available == alloc.capacity


def test_clear_returns_everything():
    alloc = KVSlotAllocator(32, 2)
    alloc.alloc(11)
    alloc.clear()
    assert alloc.available == alloc.capacity
    alloc.check_integrity()


# Frees of up to 16 slots run in plain Python, larger ones vectorized: check both.
SIZES = [1, 5, 40]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_bad_free_rejected_whole_on_both_paths(n, page_size):
    alloc = KVSlotAllocator(64 * page_size, page_size)
    s = alloc.alloc(n * page_size)
    alloc.free(s[:page_size])  # first page now free
    avail = alloc.available
    for bad in (s, torch.cat([s[page_size:], s[:1]])):
        with pytest.raises(ValueError, match="already free"):
            alloc.free(bad)
        assert alloc.available == avail  # nothing of the batch was freed
    for bad_id in (0, -1, -page_size - 3, alloc.num_slots, 10**9):
        bad = torch.cat([s[page_size:], torch.tensor([bad_id])])
        with pytest.raises(ValueError, match="must be in"):
            alloc.free(bad)
        assert alloc.available == avail
    alloc.check_integrity()
    alloc.free(s[page_size:])
    assert alloc.available == alloc.capacity
    alloc.check_integrity()


@pytest.mark.parametrize("n", SIZES)
def test_free_accepts_numpy_and_int32(n):
    alloc = KVSlotAllocator(128, 1)
    s = alloc.alloc(2 * n)
    alloc.free(s[:n].numpy().copy())
    alloc.free(s[n:].to(torch.int32))
    assert alloc.available == alloc.capacity
    alloc.check_integrity()


@pytest.mark.parametrize("n", SIZES)
def test_duplicate_slot_in_one_call(n):
    alloc = KVSlotAllocator(128, 1, debug=True)
    s = alloc.alloc(n)
    with pytest.raises(ValueError, match="twice"):
        alloc.free(torch.cat([s, s[:1]]))
    assert alloc.available == alloc.capacity - n


def test_small_free_rejects_duplicates_without_debug():
    alloc = KVSlotAllocator(32, 1)
    s = alloc.alloc(3)
    with pytest.raises(ValueError, match="twice"):
        alloc.free(torch.tensor([int(s[0]), int(s[0])]))
    alloc.free(s)
    alloc.check_integrity()


def test_is_free_shape_and_values():
    alloc = KVSlotAllocator(32, 4)
    s = alloc.alloc(8)
    alloc.free(s[:1])
    flags = alloc.is_free(s.reshape(2, 4))
    assert flags.shape == (2, 4) and flags.dtype == torch.bool
    assert flags[0].all() and not flags[1].any()


def test_alloc_results_are_private_int64_tensors():
    alloc = KVSlotAllocator(64, 4)
    a = alloc.alloc(6)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    before = alloc.free_slots().clone()
    a[:] = 0  # the caller may scribble on what it got
    assert torch.equal(alloc.free_slots(), before)
    alloc.check_integrity()


@pytest.mark.parametrize("n_pages", [2, 9])
def test_paged_free_dedupes_pages_in_any_order(n_pages):
    p = 4
    alloc = KVSlotAllocator(64 * p, p)
    s = alloc.alloc(n_pages * p)
    mixed = torch.cat([s[p:], s[:p], s[p + 1 : p + 2], s[:1]])  # pages repeat, not adjacent
    alloc.free(mixed)
    assert alloc.available == alloc.capacity
    alloc.check_integrity()
    assert sorted(alloc.alloc(alloc.capacity).tolist()) == list(range(p, 64 * p))


def test_paged_double_free_message_lists_each_page_once():
    p = 4
    alloc = KVSlotAllocator(64 * p, p)
    s = alloc.alloc(8 * p)
    alloc.free(s[:p])
    with pytest.raises(ValueError, match=rf"slots \[{int(s[0])}\] are already free"):
        alloc.free(s)
