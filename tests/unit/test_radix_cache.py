"""RadixCache: seed scenarios, a stateful serving-trace test and a naive-trie reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixrt.cache import KVSlotAllocator, RadixCache, TokenBuffer, check_slot_partition

A, B, C, D, E, X, Y = 10, 11, 12, 13, 14, 20, 21


def make(num_slots: int = 256, page_size: int = 1, policy: str = "lru"):
    alloc = KVSlotAllocator(num_slots, page_size)
    return alloc, RadixCache(alloc, page_size, eviction_policy=policy)


def put(alloc: KVSlotAllocator, cache: RadixCache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """Serve ``tokens`` from scratch: fresh slots, insert, free what the tree did not take."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    cached = cache.insert(tokens, slots)
    aligned = len(tokens) // cache.page_size * cache.page_size
    alloc.free(torch.cat([slots[:cached], slots[aligned:]]))
    return cached, slots


def children(node) -> dict:
    return {tuple(c.key): c for c in node.children.values()}


def check(alloc, cache, private=()):
    cache.check_integrity()
    alloc.check_integrity()
    check_slot_partition(alloc, cache, list(private))


# ------------------------------------------------------------- seed scenarios


def test_empty_tree_match():
    alloc, cache = make()
    r = cache.match_prefix([1, 2, 3])
    assert r.hit_len == 0 and r.kv_indices.numel() == 0 and r.last_node is cache.root
    r = cache.match_prefix([])
    assert r.hit_len == 0 and r.last_node is cache.root
    check(alloc, cache)


def test_split_on_insert():
    alloc, cache = make()
    first = alloc.alloc(5)
    assert cache.insert([A, B, C, D, E], first) == 0
    second = alloc.alloc(5)
    assert cache.insert([A, B, C, X, Y], second) == 3
    alloc.free(second[:3])  # the caller's duplicate KV of [A B C]

    top = children(cache.root)
    assert list(top) == [(A, B, C)]
    abc = top[(A, B, C)]
    assert abc.value.tolist() == first[:3].tolist()
    kids = children(abc)
    assert set(kids) == {(D, E), (X, Y)}
    assert kids[(D, E)].value.tolist() == first[3:].tolist()
    assert kids[(X, Y)].value.tolist() == second[3:].tolist()
    # KV of [A B C] is held once: 3 + 2 + 2 tokens in the tree.
    assert cache.all_slots().numel() == 7
    assert cache.total_size() == cache.evictable_size == 7
    assert cache.num_evictable_leaves == 2
    check(alloc, cache)

    r = cache.match_prefix([A, B, C, X, Y, 99])
    assert r.hit_len == 5
    assert r.kv_indices.tolist() == first[:3].tolist() + second[3:].tolist()


def test_insert_existing_and_prefix_of_existing():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    assert put(alloc, cache, [1, 2, 3, 4])[0] == 4
    # A strict prefix of a cached key splits the edge and caches nothing new.
    assert put(alloc, cache, [1, 2])[0] == 2
    assert cache.total_size() == 4
    assert [tuple(n.key) for n in cache._nodes() if n is not cache.root] == [(1, 2), (3, 4)]
    check(alloc, cache)


def test_insert_needs_enough_kv_indices():
    alloc, cache = make()
    with pytest.raises(ValueError, match="kv_indices"):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_insert_keeps_its_own_copies():
    alloc, cache = make()
    tokens = [1, 2, 3, 4]
    slots = alloc.alloc(4)
    cache.insert(tokens, slots)
    tokens.append(5)  # the caller reuses its list ...
    tokens[0] = 9
    kept = slots.tolist()
    slots[:] = 0  # ... and its slot tensor
    r = cache.match_prefix([1, 2, 3, 4, 5])
    assert r.hit_len == 4 and r.kv_indices.tolist() == kept
    assert cache.match_prefix([9]).hit_len == 0
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_accepts_other_token_and_slot_types(page_size):
    p = page_size
    alloc, cache = make(64 * p, p)
    toks = list(range(100, 100 + 3 * p))
    s = alloc.alloc(3 * p)
    cache.insert(torch.tensor(toks), s.to(torch.int32))
    r = cache.match_prefix(tuple(toks))
    assert r.hit_len == 3 * p and r.kv_indices.dtype == torch.int64
    assert r.kv_indices.tolist() == s.tolist()
    s2 = alloc.alloc(2 * p)
    cache.insert(toks[:p] + [7] * p, torch.cat([s[:p], s2[:p]]).numpy())
    alloc.free(s2[p:])
    assert (
        cache.match_prefix(toks[:p] + [7] * p).kv_indices.tolist()
        == s[:p].tolist() + s2[:p].tolist()
    )
    for node in cache._nodes():
        if node is not cache.root:
            assert isinstance(node.value, torch.Tensor) and node.value.dtype == torch.int64
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 2])
def test_keys_are_packed_int64_and_unpack_to_lists(page_size):
    """Keys are stored as int64 bytes (O(1) to free); any int64 token id round-trips."""
    p = page_size
    alloc, cache = make(64, p)
    big = [2**62, -(2**40), 0, 7, 2**31, 5] * p
    put(alloc, cache, big)
    put(alloc, cache, big[: 3 * p] + [8] * p)  # splits after three pages
    r = cache.match_prefix(list(big))
    assert r.hit_len == len(big) and r.last_node.key == big[3 * p :]
    assert r.last_node.parent.key == big[: 3 * p]
    for node in cache._nodes():
        assert isinstance(node._key, bytes) and len(node._key) == 8 * len(node.key)
    check(alloc, cache)


def test_tokens_must_be_int64_integers():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    with pytest.raises(ValueError, match="int64"):
        cache.match_prefix([1, 2**63])
    slots = alloc.alloc(2)
    with pytest.raises(ValueError, match="int64"):
        cache.insert([1, 2.5], slots)
    with pytest.raises(ValueError, match="int64"):
        cache.insert([4, 2.5], slots, cache_salt="t")
    assert "t" not in cache.root.children  # a rejected insert changes nothing
    alloc.free(slots)
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_token_ids_as_numpy_arrays(page_size):
    """int numpy arrays (and tensors) are read as int64; the tree keeps no view of them."""
    p = page_size
    alloc, cache = make(64 * p, p)
    toks = np.arange(100, 100 + 3 * p, dtype=np.int64)
    s = alloc.alloc(3 * p)
    cache.insert(toks, s)
    assert cache.match_prefix(toks.tolist()).kv_indices.tolist() == s.tolist()
    for same in (
        toks.astype(np.int32),
        toks.astype(np.uint16),
        toks.astype(np.uint64),
        toks.astype(">i8"),
        toks.reshape(1, -1),
        torch.from_numpy(toks.astype(np.int32)),
    ):
        assert cache.match_prefix(same).hit_len == 3 * p
    toks[:] = 7  # the caller reuses its array
    assert cache.match_prefix(np.arange(100, 100 + 3 * p)).hit_len == 3 * p
    # A fork taken from an array: heads are Python ints, as from a list.
    fork = np.array(list(range(100, 100 + p)) + [9] * p + [5] * (p - 1), dtype=np.int64)
    s2 = alloc.alloc(2 * p)
    assert cache.insert(fork, torch.cat([s[:p], s2[:p]])) == p  # the unaligned tail is left out
    alloc.free(s2[p:])
    heads = [n.head if p > 1 else (n.head,) for n in cache._nodes() if n is not cache.root]
    assert all(type(t) is int for head in heads for t in head)
    assert cache.match_prefix(fork[: 2 * p]).kv_indices.tolist() == s[:p].tolist() + s2[:p].tolist()
    first = list(range(100, 100 + p))  # a cached page, so the walk packs what follows
    for bad in (np.array(first + [101.0] * p), np.array(first + [2**63] * p, dtype=np.uint64)):
        with pytest.raises(ValueError, match="int64"):
            cache.match_prefix(bad)
    check(alloc, cache)


def test_token_buffer_grows_and_rejects_non_int64():
    buf = TokenBuffer([1, 2, 3], capacity=4)
    assert len(buf) == 3 and buf.array.dtype == np.int64 and buf.array.tolist() == [1, 2, 3]
    buf.extend(range(4, 40))  # past the capacity: reallocates
    buf.extend([])
    assert buf.array.tolist() == list(range(1, 40))
    with pytest.raises(ValueError, match="int64"):
        buf.extend([40, 2.5])
    with pytest.raises(ValueError, match="int64"):
        buf.extend([2**63])
    assert len(buf) == 39  # a rejected extend appends nothing
    assert len(TokenBuffer()) == 0 and TokenBuffer().array.size == 0


def test_match_packs_only_what_it_compares():
    """A long request with a short hit does not pay for packing all of itself."""
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    r = cache.match_prefix([1, 2, 3] + ["not a token id"] * 100)  # never packed
    assert r.hit_len == 3
    check(alloc, cache)


def test_split_on_match_mid_edge():
    alloc, cache = make()
    _, slots = put(alloc, cache, [1, 2, 3, 4, 5])
    r = cache.match_prefix([1, 2, 3, 9])
    assert r.hit_len == 3
    assert r.kv_indices.tolist() == slots[:3].tolist()
    assert r.last_node.key == [1, 2, 3]
    assert r.last_node.value.tolist() == slots[:3].tolist()
    assert r.last_node.parent is cache.root
    assert list(children(r.last_node)) == [(4, 5)]
    assert cache.total_size() == 5
    check(alloc, cache)
    # Locking the split node protects exactly the hit.
    cache.lock(r.last_node)
    assert cache.protected_size == 3 and cache.evictable_size == 2
    check(alloc, cache)


def test_partial_prefix_hits():
    alloc, cache = make()
    _, s1 = put(alloc, cache, [1, 2, 3, 4, 5])
    _, s2 = put(alloc, cache, [1, 2, 7, 8])
    assert cache.match_prefix([1]).hit_len == 1
    r = cache.match_prefix([1, 2])
    assert r.hit_len == 2 and r.kv_indices.tolist() == s1[:2].tolist()
    r = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert r.hit_len == 5 and r.kv_indices.tolist() == s1.tolist()
    r = cache.match_prefix([1, 2, 7, 9])
    assert r.hit_len == 3 and r.kv_indices.tolist() == s1[:2].tolist() + s2[2:3].tolist()
    r = cache.match_prefix([9, 1, 2])
    assert r.hit_len == 0 and r.last_node is cache.root
    # Tensor input works the same.
    assert cache.match_prefix(torch.tensor([1, 2, 3, 4])).hit_len == 4
    check(alloc, cache)


def test_lock_protects_from_eviction():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [5, 6])
    r = cache.match_prefix([1, 2, 3])
    cache.lock(r.last_node)
    assert cache.protected_size == 3 and cache.evictable_size == 2
    assert cache.evict(100) == 2  # only [5 6] can go
    assert cache.evict(100) == 0
    assert cache.match_prefix([1, 2, 3]).hit_len == 3
    assert cache.match_prefix([5, 6]).hit_len == 0
    check(alloc, cache)
    cache.unlock(r.last_node)
    assert cache.evict(100) == 3
    assert alloc.available == alloc.capacity
    check(alloc, cache)


def test_lock_of_a_child_protects_ancestors():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    r = cache.match_prefix([1, 2, 4])
    cache.lock(r.last_node)
    assert cache.protected_size == 3  # [1 2] and [4]
    assert cache.evict(100) == 1  # only [3]
    assert cache.match_prefix([1, 2, 4]).hit_len == 3
    cache.unlock(r.last_node)
    check(alloc, cache)


def test_lru_order():
    alloc, cache = make()
    put(alloc, cache, [1, 1, 1])
    put(alloc, cache, [2, 2, 2])
    put(alloc, cache, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # [1 1 1] is now the most recent
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).hit_len == 0
    assert cache.evict(1) == 3
    assert cache.match_prefix([3, 3, 3]).hit_len == 0
    assert cache.match_prefix([1, 1, 1]).hit_len == 3
    check(alloc, cache)


def test_evict_at_least_requested():
    alloc, cache = make()
    put(alloc, cache, [1] * 4)
    put(alloc, cache, [2] * 4)
    put(alloc, cache, [3] * 4)
    assert cache.evict(5) == 8  # whole leaves: two of them
    assert cache.evict(0) == 0
    assert cache.total_size() == 4
    check(alloc, cache)


def test_parent_evicted_after_last_child():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    assert cache.num_evictable_leaves == 2
    assert cache.evict(1) == 1  # [3], the older leaf
    assert cache.match_prefix([1, 2, 3]).hit_len == 2
    assert cache.num_evictable_leaves == 1
    assert cache.evict(1) == 1  # [4]
    # [1 2] is now a leaf and a candidate.
    assert cache.num_evictable_leaves == 1
    check(alloc, cache)
    assert cache.evict(1) == 2
    assert cache.total_size() == 0 and cache.num_evictable_leaves == 0
    assert not cache.root.children
    assert alloc.available == alloc.capacity
    check(alloc, cache)


def test_parent_evicted_in_same_call():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    assert cache.evict(4) == 4
    assert cache.total_size() == 0
    check(alloc, cache)


def test_unlock_returns_tokens_to_evictable():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    r = cache.match_prefix([1, 2, 3, 4])
    cache.lock(r.last_node)
    cache.lock(r.last_node)  # two requests share it
    assert (cache.evictable_size, cache.protected_size) == (0, 4)
    assert cache.num_evictable_leaves == 0
    cache.unlock(r.last_node)
    assert (cache.evictable_size, cache.protected_size) == (0, 4)
    cache.unlock(r.last_node)
    assert (cache.evictable_size, cache.protected_size) == (4, 0)
    assert cache.num_evictable_leaves == 1
    check(alloc, cache)


def test_unlock_below_zero_raises():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)
    check(alloc, cache)


def test_lock_unlock_root_is_noop():
    alloc, cache = make()
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 1
    check(alloc, cache)


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_paged_hits_are_page_aligned(page_size):
    p = page_size
    alloc, cache = make(64 * p, p)
    base = list(range(100, 100 + 3 * p + p - 1))  # not a whole number of pages if p > 1
    cached, slots = put(alloc, cache, base)
    assert cached == 0
    assert cache.total_size() == 3 * p  # only whole pages are inserted
    for n in range(len(base) + 2):
        q = base[:n] + [7] * 3
        r = cache.match_prefix(q)
        want = min(n, 3 * p) // p * p
        assert r.hit_len == want, (n, r.hit_len)
        assert r.kv_indices.tolist() == slots[:want].tolist()
    # A fork in the middle of a page only shares the whole pages before it.
    fork = base[: p + p // 2] + [999] * (2 * p)
    cached, fslots = put(alloc, cache, fork)
    want = (p + p // 2) // p * p
    assert cached == want
    for node in cache._nodes():
        assert len(node.key) % p == 0
        if node is not cache.root:
            assert (int(node.value[0]) % p) == 0  # nodes hold whole pages
    r = cache.match_prefix(fork)
    assert r.hit_len == len(fork) // p * p
    assert r.kv_indices.tolist() == slots[:want].tolist() + fslots[want : r.hit_len].tolist()
    check(alloc, cache)
    cache.evict(10**6)
    assert alloc.available == alloc.capacity
    check(alloc, cache)


def test_page_size_mismatch_raises():
    alloc = KVSlotAllocator(64, 4)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(alloc, 2)
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(alloc, 4, eviction_policy="fifo")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_lfu_evicts_less_hit_leaf_first(policy):
    alloc, cache = make(policy=policy)
    put(alloc, cache, [1, 1])
    put(alloc, cache, [2, 2])
    for _ in range(3):
        cache.match_prefix([1, 1])
    cache.match_prefix([2, 2])  # [2 2]: fewer hits but the most recent
    assert cache.evict(1) == 2
    gone = [1, 1] if policy == "lru" else [2, 2]
    kept = [2, 2] if policy == "lru" else [1, 1]
    assert cache.match_prefix(gone).hit_len == 0
    assert cache.match_prefix(kept).hit_len == 2
    check(alloc, cache)


def test_lfu_ties_broken_by_recency():
    alloc, cache = make(policy="lfu")
    put(alloc, cache, [1])
    put(alloc, cache, [2])
    cache.match_prefix([2])
    cache.match_prefix([1])
    cache.evict(1)
    assert cache.match_prefix([2]).hit_len == 0


def test_reset():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 4])
    r = cache.match_prefix([1, 2, 3])
    cache.lock(r.last_node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(r.last_node)
    cache.reset()
    assert cache.total_size() == 0 and not cache.root.children
    assert cache.num_evictable_leaves == 0
    assert alloc.available == alloc.capacity
    check(alloc, cache)
    # Usable after a reset.
    put(alloc, cache, [1, 2])
    assert cache.match_prefix([1, 2]).hit_len == 2
    check(alloc, cache)


def test_reset_hands_the_slots_back_in_ascending_order():
    alloc, cache = make()
    for tokens in ([1, 2, 3, 4], [5, 6], [1, 2, 7, 8, 9], [5, 10]):  # four nodes, split ones
        put(alloc, cache, tokens)
    held = cache.total_size()
    cache.reset()
    slots = alloc.alloc(held).tolist()  # the tree's slots, from the top of the free list
    assert slots == sorted(slots)


# --------------------------------------------- check_integrity really checks


def _tree():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 5, 6])
    put(alloc, cache, [7, 8])
    check(alloc, cache)
    return alloc, cache


def test_integrity_catches_bad_evictable_size():
    alloc, cache = _tree()
    cache.evictable_size += 1
    with pytest.raises(AssertionError, match="evictable_size"):
        cache.check_integrity()


def test_integrity_catches_bad_protected_size():
    alloc, cache = _tree()
    cache.protected_size -= 1
    with pytest.raises(AssertionError, match="protected_size"):
        cache.check_integrity()


def test_integrity_catches_bad_lock_ref():
    alloc, cache = _tree()
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    node.lock_ref = 1  # locked without going through lock(): parent below child
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_integrity_catches_stale_evictable_set():
    alloc, cache = _tree()
    leaf = cache.match_prefix([7, 8]).last_node
    leaf.last_access += 100  # changed behind the sorted set's back
    with pytest.raises(AssertionError, match="stale"):
        cache.check_integrity()


def test_integrity_catches_missing_leaf():
    alloc, cache = _tree()
    leaf = cache.match_prefix([7, 8]).last_node
    cache._remove_evictable(leaf)
    with pytest.raises(AssertionError, match="evictable set"):
        cache.check_integrity()


def test_integrity_catches_key_value_mismatch():
    alloc, cache = _tree()
    leaf = cache.match_prefix([7, 8]).last_node
    leaf.value = leaf.value[:1]
    with pytest.raises(AssertionError, match="lengths differ"):
        cache.check_integrity()


def test_integrity_catches_slot_held_twice():
    alloc, cache = _tree()
    a = cache.match_prefix([7, 8]).last_node
    b = cache.match_prefix([1, 2, 3, 4]).last_node
    b.value = a.value.clone()
    with pytest.raises(AssertionError, match="two tree nodes"):
        cache.check_integrity()


def test_integrity_catches_slot_free_and_in_tree():
    alloc, cache = _tree()
    leaf = cache.match_prefix([7, 8]).last_node
    alloc.free(leaf.value)  # behind the tree's back
    with pytest.raises(AssertionError, match="both free and in the tree"):
        cache.check_integrity()


def test_integrity_catches_bad_parent_link():
    alloc, cache = _tree()
    leaf = cache.match_prefix([7, 8]).last_node
    leaf.parent = cache.match_prefix([1, 2]).last_node
    with pytest.raises(AssertionError, match="parent link"):
        cache.check_integrity()


def test_partition_catches_leak():
    alloc, cache = _tree()
    alloc.alloc(3)  # handed out and forgotten
    with pytest.raises(AssertionError, match="leaked"):
        check_slot_partition(alloc, cache, [])


# ------------------------------------------------- cache_salt namespaces


def put_salted(alloc, cache, tokens, salt):
    slots = alloc.alloc(len(tokens))
    cached = cache.insert(tokens, slots, cache_salt=salt)
    aligned = len(tokens) // cache.page_size * cache.page_size
    alloc.free(torch.cat([slots[:cached], slots[aligned:]]))
    return cached, slots


@pytest.mark.parametrize("page_size", [1, 4])
def test_salts_store_the_same_tokens_separately(page_size):
    p = page_size
    alloc, cache = make(256 * p, p)
    tokens = list(range(1, 1 + 4 * p))
    assert put(alloc, cache, tokens)[0] == 0
    assert put_salted(alloc, cache, tokens, "a")[0] == 0  # no sharing with the unsalted copy
    assert put_salted(alloc, cache, tokens, "b")[0] == 0
    assert put_salted(alloc, cache, tokens, "a")[0] == len(tokens)  # the same salt shares
    assert cache.total_size() == 3 * len(tokens)
    hits = {salt: cache.match_prefix(tokens, cache_salt=salt) for salt in (None, "a", "b")}
    assert all(h.hit_len == len(tokens) for h in hits.values())
    slot_sets = [set(h.kv_indices.tolist()) for h in hits.values()]
    assert not (
        slot_sets[0] & slot_sets[1] or slot_sets[0] & slot_sets[2] or slot_sets[1] & slot_sets[2]
    )
    assert cache.match_prefix(tokens, cache_salt="c").hit_len == 0
    check(alloc, cache)


def test_salted_match_never_returns_another_salts_slots():
    alloc, cache = make()
    _, a_slots = put_salted(alloc, cache, [1, 2, 3, 4], "a")
    _, b_slots = put_salted(alloc, cache, [1, 2, 5], "b")
    r = cache.match_prefix([1, 2, 5, 6], cache_salt="a")
    assert r.hit_len == 2 and r.kv_indices.tolist() == a_slots[:2].tolist()  # split inside a
    r = cache.match_prefix([1, 2, 3, 4], cache_salt="b")
    assert r.hit_len == 2 and r.kv_indices.tolist() == b_slots[:2].tolist()
    r = cache.match_prefix([1, 2, 3, 4])  # unsalted sees neither
    assert r.hit_len == 0 and r.last_node is cache.root
    r = cache.match_prefix([7], cache_salt="a")  # a miss in a namespace that exists
    assert r.hit_len == 0 and r.last_node.key == [] and r.last_node is not cache.root
    assert cache.match_prefix([1, 2], cache_salt="nobody").last_node is cache.root
    check(alloc, cache)


def test_salt_must_be_a_str():
    alloc, cache = make()
    put(alloc, cache, [5, 6])
    with pytest.raises(TypeError, match="cache_salt"):
        cache.match_prefix([5, 6], cache_salt=5)  # would otherwise find the token child 5
    with pytest.raises(TypeError, match="cache_salt"):
        cache.insert([5, 6], alloc.alloc(2), cache_salt=5)


def test_locks_stop_at_the_namespace_and_protect_only_their_path():
    alloc, cache = make()
    put_salted(alloc, cache, [1, 2, 3], "a")
    put_salted(alloc, cache, [1, 2, 3], "b")
    put(alloc, cache, [1, 2, 3])
    r = cache.match_prefix([1, 2, 3], cache_salt="a")
    ns = r.last_node.parent
    cache.lock(r.last_node)
    assert ns.lock_ref == 1 and cache.root.lock_ref == 1  # the walk stopped at the namespace
    assert (cache.protected_size, cache.evictable_size) == (3, 6)
    check(alloc, cache)
    assert cache.evict(100) == 6  # b's and the unsalted copy go, a's is locked
    assert cache.match_prefix([1, 2, 3], cache_salt="a").hit_len == 3
    assert cache.match_prefix([1, 2, 3], cache_salt="b").hit_len == 0
    assert set(cache.root.children) == {"a"}  # b's empty namespace was dropped
    check(alloc, cache)
    cache.lock(ns)  # locking a namespace node is a no-op, like the root
    cache.unlock(ns)
    cache.unlock(r.last_node)
    assert (cache.protected_size, cache.evictable_size) == (0, 3)
    assert cache.evict(100) == 3
    assert not cache.root.children and alloc.available == alloc.capacity
    check(alloc, cache)


def test_eviction_is_lru_across_namespaces():
    alloc, cache = make()
    put_salted(alloc, cache, [1, 1], "a")
    put_salted(alloc, cache, [1, 1], "b")
    put(alloc, cache, [1, 1])
    cache.match_prefix([1, 1], cache_salt="a")  # a's copy is now the most recent
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1], cache_salt="b").hit_len == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1]).hit_len == 0
    assert cache.match_prefix([1, 1], cache_salt="a").hit_len == 2
    check(alloc, cache)


def test_request_locked_at_a_dropped_namespace_carries_on():
    """A 0-hit request locked at a namespace node that eviction then drops."""
    alloc, cache = make()
    put_salted(alloc, cache, [1, 2], "a")
    miss = cache.match_prefix([9], cache_salt="a")
    cache.lock(miss.last_node)
    assert cache.evict(100) == 2 and not cache.root.children
    cached, _ = put_salted(alloc, cache, [9, 8], "a")  # a new namespace for "a"
    assert cached == 0
    r = cache.match_prefix([9, 8], cache_salt="a")
    cache.lock(r.last_node)
    cache.unlock(miss.last_node)
    cache.unlock(r.last_node)
    assert (cache.evictable_size, cache.protected_size) == (2, 0)
    check(alloc, cache)


def test_empty_insert_makes_no_namespace():
    alloc, cache = make(page_size=4)
    assert cache.insert([1, 2, 3], alloc.alloc(3), cache_salt="a") == 0  # less than a page
    assert not cache.root.children
    check(alloc, cache, [torch.arange(4, 8)])


def test_reset_and_all_slots_cover_namespaces():
    alloc, cache = make()
    put_salted(alloc, cache, [1, 2, 3], "a")
    put(alloc, cache, [1, 2, 3])
    assert cache.all_slots().numel() == 6 and cache.total_size() == 6
    r = cache.match_prefix([1, 2], cache_salt="a")
    cache.lock(r.last_node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(r.last_node)
    cache.reset()
    assert not cache.root.children and cache.total_size() == 0
    assert alloc.available == alloc.capacity
    assert cache.match_prefix([1, 2, 3], cache_salt="a").hit_len == 0
    check(alloc, cache)


def test_integrity_catches_broken_namespaces():
    alloc, cache = make()
    put_salted(alloc, cache, [1, 2], "a")
    ns = cache.root.children["a"]
    ns.lock_ref = 0
    with pytest.raises(AssertionError, match="root-like"):
        cache.check_integrity()
    ns.lock_ref = 1
    cache.root.children["b"] = cache.root.children.pop("a")
    with pytest.raises(AssertionError, match="bad parent link"):
        cache.check_integrity()
    cache.root.children["a"] = cache.root.children.pop("b")
    cache.check_integrity()
    ns.children.clear()
    with pytest.raises(AssertionError, match="empty"):
        cache.check_integrity()


def tree_state(cache: RadixCache) -> tuple:
    """Everything a lookup could change: the nodes (edges, parents, access times, hit counts,
    locks), the eviction order and the clock."""
    nodes = sorted(
        (
            n.id,
            n._key,
            n.parent.id if n.parent is not None else -1,
            n.last_access,
            n.hit_count,
            n.lock_ref,
        )
        for n in cache._nodes()
    )
    return (
        nodes,
        [e[:-1] for e in cache._evictable],
        cache._clock,
        cache.evictable_size,
        cache.protected_size,
    )


def test_peek_prefix_changes_nothing_and_finds_what_match_finds():
    alloc, cache = make(64)
    put(alloc, cache, [1, 2, 3, 4, 5, 6])
    put(alloc, cache, [1, 2, 3, 9, 9])
    before = tree_state(cache)
    for _ in range(100):  # a scheduler polling its queue
        assert cache.peek_prefix([1, 2, 3, 4, 7]).hit_len == 4  # ends inside an edge: no split
        assert cache.peek_prefix([1, 2, 3]).hit_len == 3
        assert cache.peek_prefix([8]).hit_len == 0
        assert cache.peek_prefix([1, 2, 3, 4], cache_salt="other") == (0, cache.root)
    assert tree_state(cache) == before
    node = cache.peek_prefix([1, 2, 3, 4, 7]).last_node
    assert node.key == [4, 5, 6]  # the edge that holds the hit's end
    assert (
        cache.match_prefix([1, 2, 3, 4, 7]).hit_len == 4 and tree_state(cache) != before
    )  # a hit: split
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_insert_prefix_returns_the_path_and_takes_no_hit(page_size: int):
    """insert_prefix hands back what a caller would otherwise re-match for: how much was cached,
    the tree's slots for the whole key and the node ending at it; hit counts stay as they were."""
    alloc, cache = make(64, page_size, policy="lfu")
    first = alloc.alloc(6)
    r = cache.insert_prefix([1, 2, 3, 4, 5, 6], first, cache_salt="s")
    assert (
        r.cached_len == 0
        and r.kv_indices.tolist() == first.tolist()
        and r.last_node.key == [1, 2, 3, 4, 5, 6]
    )
    second = alloc.alloc(8)
    r = cache.insert_prefix(
        [1, 2, 3, 4, 9, 9, 7, 7], second, cache_salt="s"
    )  # forks inside an edge
    assert r.cached_len == 4
    assert r.kv_indices.tolist() == first[:4].tolist() + second[4:].tolist()
    assert r.last_node.key == [9, 9, 7, 7] and r.last_node.parent.key == [1, 2, 3, 4]
    alloc.free(second[:4])
    dup = alloc.alloc(2)
    r = cache.insert_prefix([1, 2], dup, cache_salt="s")  # ends inside an edge: split there
    assert (
        r.cached_len == 2
        and r.kv_indices.tolist() == first[:2].tolist()
        and r.last_node.key == [1, 2]
    )
    alloc.free(dup)
    check(alloc, cache)
    assert all(n.hit_count == 0 for n in cache._nodes())
    match = cache.match_prefix([1, 2], cache_salt="s")
    assert match.last_node is r.last_node and match.kv_indices.tolist() == r.kv_indices.tolist()
    assert r.last_node.hit_count == 1  # a real hit counts


# ---------------------------------------------- stateful serving-trace test

ALPHABET = st.integers(0, 3)
SALTS = st.sampled_from([None, None, "a", "b"])


class Request:
    __slots__ = ("tokens", "ids", "prefix", "own", "node", "salt")

    def __init__(self, tokens, ids, prefix, own, node, salt):
        self.tokens = tokens  # list[int], prompt plus generated tokens
        self.ids = ids  # the same as a TokenBuffer, or None: what the tree is handed
        self.prefix = prefix  # slots of tokens[:len(prefix)], owned by the tree
        self.own = own  # slots of the rest, owned by the request
        self.node = node  # locked node whose path covers ``prefix``
        self.salt = salt  # cache_salt of every match and insert

    @property
    def key(self):
        return self.tokens if self.ids is None else self.ids.array


class ServingTrace(RuleBasedStateMachine):
    """Simulated scheduler life cycle against one small pool.

    ``meaning[slot]`` records which (cache_salt, token prefix) the KV in
    ``slot`` was computed for; every hit must hand back slots that mean the
    matched prefix under the same salt.
    """

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_slots=st.sampled_from([64, 96, 128]),
        policy=st.sampled_from(["lru", "lfu"]),
    )
    def setup(self, page_size, num_slots, policy):
        self.p = page_size
        self.alloc = KVSlotAllocator(num_slots, page_size)
        self.cache = RadixCache(self.alloc, page_size, eviction_policy=policy)
        self.live: list[Request] = []
        self.seen: list[list[int]] = []
        self.meaning: dict[int, tuple[int, ...]] = {}

    # -- helpers

    def _alloc(self, n: int, last_slot: int):
        """Allocate like a scheduler: evict if short, None if still short."""
        need = -(-n // self.p) * self.p if last_slot < 0 else n
        slots = self.alloc.alloc_extend(n, last_slot)
        if slots is None:
            self.cache.evict(need - self.alloc.available)
            slots = self.alloc.alloc_extend(n, last_slot)
        return slots

    def _check_hit(self, tokens, salt, hit_len, kv):
        assert hit_len % self.p == 0 and hit_len <= len(tokens)
        assert kv.numel() == hit_len
        for i, s in enumerate(kv.tolist()):
            assert self.meaning[s] == (salt, tuple(tokens[: i + 1])), (
                "hit returned KV of another prefix"
            )

    def _record(self, tokens, salt, start, slots):
        for i, s in enumerate(slots.tolist()):
            self.meaning[s] = (salt, tuple(tokens[: start + i + 1]))

    def _last_slot(self, req: Request) -> int:
        if req.own.numel():
            return int(req.own[-1])
        return int(req.prefix[-1]) if req.prefix.numel() else -1

    def _cache_into_tree(self, req: Request) -> int:
        """Insert the request's tokens; free its duplicate slots. Returns aligned length."""
        slots = torch.cat([req.prefix, req.own])
        h = req.prefix.numel()
        cached = self.cache.insert(req.key, slots, cache_salt=req.salt)
        aligned = len(req.tokens) // self.p * self.p
        assert h <= cached <= aligned, (h, cached, aligned)
        # [h, cached): already in the tree (another request inserted it): a
        # duplicate the request owns, whole pages because h and cached are aligned.
        if cached > h:
            self.alloc.free(slots[h:cached])
        return aligned

    # -- rules

    @rule(data=st.data())
    def start_request(self, data):
        if self.seen and data.draw(st.booleans(), label="share"):
            stem = data.draw(st.sampled_from(self.seen), label="stem")
            stem = stem[: data.draw(st.integers(0, len(stem)), label="cut")]
        else:
            stem = []
        suffix = data.draw(st.lists(ALPHABET, min_size=0 if stem else 1, max_size=20), label="sfx")
        tokens = stem + suffix
        if not tokens:
            return
        salt = data.draw(SALTS, label="salt")
        ids = TokenBuffer(tokens) if data.draw(st.booleans(), label="int64 ids") else None
        self.seen.append(tokens)
        r = self.cache.match_prefix(tokens if ids is None else ids.array, cache_salt=salt)
        self._check_hit(tokens, salt, r.hit_len, r.kv_indices)
        self.cache.lock(r.last_node)
        own = self._alloc(len(tokens) - r.hit_len, -1)
        if own is None:
            self.cache.unlock(r.last_node)  # drop the request
            return
        self._record(tokens, salt, r.hit_len, own)
        self.live.append(Request(list(tokens), ids, r.kv_indices, own, r.last_node, salt))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def decode(self, data, n):
        req = data.draw(st.sampled_from(self.live), label="req")
        new = data.draw(st.lists(ALPHABET, min_size=n, max_size=n), label="gen")
        # evict only moves tokens from the tree to the free list, and a failed
        # alloc takes nothing, so this sum does not move when alloc fails.
        before = self.alloc.available + self.cache.evictable_size
        slots = self._alloc(n, self._last_slot(req))
        if slots is None:
            assert self.alloc.available + self.cache.evictable_size == before
            return
        start = len(req.tokens)
        req.tokens.extend(new)
        if req.ids is not None:
            req.ids.extend(new)
        req.own = torch.cat([req.own, slots])
        self._record(req.tokens, req.salt, start, slots)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_unfinished(self, data):
        """Chunked-prefill style: put the request's tokens in the tree and keep running."""
        req = data.draw(st.sampled_from(self.live), label="req")
        h = req.prefix.numel()
        slots = torch.cat([req.prefix, req.own])
        aligned = self._cache_into_tree(req)
        r = self.cache.match_prefix(req.key, cache_salt=req.salt)
        assert r.hit_len == aligned
        self._check_hit(req.tokens, req.salt, r.hit_len, r.kv_indices)
        assert r.kv_indices[:h].tolist() == req.prefix.tolist()
        self.cache.lock(r.last_node)
        self.cache.unlock(req.node)
        req.prefix, req.own, req.node = r.kv_indices, slots[aligned:], r.last_node

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_request(self, data):
        i = data.draw(st.integers(0, len(self.live) - 1), label="idx")
        req = self.live.pop(i)
        self._finish(req)

    def _finish(self, req: Request):
        slots = torch.cat([req.prefix, req.own])
        aligned = self._cache_into_tree(req)
        if aligned < len(req.tokens):
            self.alloc.free(slots[aligned:])  # unaligned tail page
        self.cache.unlock(req.node)
        r = self.cache.match_prefix(req.tokens, cache_salt=req.salt)  # what it left is findable
        assert r.hit_len == aligned
        self._check_hit(req.tokens, req.salt, r.hit_len, r.kv_indices)

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        before = self.cache.evictable_size
        freed = self.cache.evict(n)
        assert freed <= before
        assert freed >= min(n, before) or self.cache.evictable_size == 0
        assert self.cache.evictable_size == before - freed

    @rule(data=st.data())
    def peek(self, data):
        if not self.seen:
            return
        tokens = data.draw(st.sampled_from(self.seen), label="peek")
        tokens = tokens[: data.draw(st.integers(1, len(tokens)), label="cut")]
        salt = data.draw(SALTS, label="salt")
        before = tree_state(self.cache)
        peeked = self.cache.peek_prefix(tokens, cache_salt=salt)
        assert tree_state(self.cache) == before, "peek_prefix changed the tree"
        r = self.cache.match_prefix(tokens, cache_salt=salt)
        self._check_hit(tokens, salt, r.hit_len, r.kv_indices)
        assert peeked.hit_len == r.hit_len
        # the hit ends on a node, or inside the edge that match_prefix just split above it
        assert peeked.last_node is r.last_node or peeked.last_node.parent is r.last_node

    # -- invariants

    @invariant()
    def consistent(self):
        self.alloc.check_integrity()
        check_slot_partition(self.alloc, self.cache, [r.own for r in self.live])
        assert (
            self.alloc.available
            + self.cache.total_size()
            + sum(-(-r.own.numel() // self.p) * self.p for r in self.live)
            == self.alloc.capacity
        )

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        while self.live:
            self._finish(self.live.pop())
        check_slot_partition(self.alloc, self.cache, [])
        assert self.cache.protected_size == 0
        assert self.alloc.available + self.cache.evictable_size == self.alloc.capacity
        if self.p == 1:
            assert self.alloc.capacity == self.alloc.num_slots - 1
        self.cache.evict(10**9)
        assert self.alloc.available == self.alloc.capacity


ServingTrace.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestServingTrace = ServingTrace.TestCase


# ------------------------------------------------------ naive reference check


def _page_key(seq, i, p):
    """The KV at position i is identified by its whole page's prefix and its offset."""
    return tuple(seq[: (i // p + 1) * p]), i % p


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_match_agrees_with_naive_reference(page_size, seed):
    rng = random.Random(seed * 10 + page_size)
    p = page_size
    alloc, cache = make(8192 * p, p, policy=rng.choice(["lru", "lfu"]))
    stored: list[list[int]] = []  # aligned keys inserted so far
    first_slot: dict[tuple, int] = {}  # _page_key -> slot first cached for it
    vocab = rng.choice([2, 3, 5])

    def random_seq():
        if stored and rng.random() < 0.7:
            base = rng.choice(stored)
            base = base[: rng.randint(0, len(base))]
        else:
            base = []
        return base + [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]

    for _ in range(300):
        seq = random_seq()
        want = max((_lcp(seq, s) for s in stored), default=0) // p * p
        key = np.array(seq, dtype=np.int64) if rng.random() < 0.5 else seq
        if rng.random() < 0.5:
            r = cache.match_prefix(key)
            assert r.hit_len == want, (seq, r.hit_len, want)
            assert r.kv_indices.tolist() == [first_slot[_page_key(seq, i, p)] for i in range(want)]
        else:
            slots = alloc.alloc(len(seq))
            cached = cache.insert(key, slots)
            assert cached == min(want, len(seq) // p * p)
            aligned = len(seq) // p * p
            for i in range(cached, aligned):
                first_slot[_page_key(seq, i, p)] = int(slots[i])
            alloc.free(torch.cat([slots[:cached], slots[aligned:]]))
            stored.append(seq[:aligned])
    # One tree token per distinct (page prefix, offset) of the stored keys.
    assert cache.evictable_size == len({_page_key(s, i, p) for s in stored for i in range(len(s))})
    assert cache.evictable_size == len(first_slot)
    check(alloc, cache)
