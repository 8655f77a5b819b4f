"""The sliding-window KV cache: SWASlotAllocator, SWAKVPool, SWARadixCache, and a
hypothesis state machine that runs the scheduler's protocol against them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixrt.cache import MirrorTree
from radixrt.cache.swa_allocator import SWASlotAllocator
from radixrt.cache.swa_cache import SWARadixCache, check_swa_partition
from radixrt.cache.swa_pool import SWAKVPool


def make(window: int, num_slots: int = 128, num_swa: int = 64, **kw):
    alloc = SWASlotAllocator(num_slots, num_swa)
    return alloc, SWARadixCache(alloc, window, **kw)


def run(alloc, cache, tokens, salt=None):
    """A request's whole life at once: match, lock, compute the rest, give back what is behind
    its window, insert, unlock. Returns the slots the tree holds for ``tokens``."""
    m = cache.match_prefix(tokens, salt)
    cache.lock(m.last_node)
    row = torch.cat([m.kv_indices, alloc.alloc(len(tokens) - m.hit_len)])
    released = cache.release_behind(
        m.last_node, m.hit_len, row, cache.window_start(m.hit_len), len(tokens)
    )
    ins = cache.insert_prefix(tokens, row, salt)
    alloc.free(row[m.hit_len : ins.cached_len])
    cache.lock(ins.last_node)
    cache.unlock(m.last_node, window=released < m.hit_len, released=released)
    cache.unlock(ins.last_node)
    return ins.kv_indices.clone()


def nodes(cache):
    return [n for n in cache._nodes() if n._key]


def shape(cache):
    """(begin, end, tombstone) of every node, sorted."""
    return sorted((n.depth - n.num_tokens, n.depth, n.swa_tombstone) for n in nodes(cache))


# ------------------------------------------------------------------ allocator


def test_alloc_pairs_full_and_swa_slots():
    a = SWASlotAllocator(16, 8)
    full = a.alloc(5)
    swa = a.translate(full)
    assert (swa > 0).all() and swa.unique().numel() == 5
    assert a.available == 10 and a.swa_available == 2
    a.check_integrity()
    a.free_swa(full[:2])
    assert a.translate(full[:2]).tolist() == [0, 0] and a.swa_available == 4
    a.free(full)  # frees the three SWA slots still held
    assert a.available == a.capacity and a.swa_available == a.swa_capacity
    assert not a.full_to_swa.any()
    a.check_integrity()


def test_alloc_takes_nothing_when_either_pool_is_short():
    a = SWASlotAllocator(16, 4)
    assert a.alloc(4) is None and a.available == 15 and a.swa_available == 3
    a = SWASlotAllocator(4, 16)
    assert a.alloc(4) is None and a.available == 3 and a.swa_available == 15
    assert a.alloc(0).numel() == 0
    a.check_integrity()


def test_bad_frees_raise_and_change_nothing():
    a = SWASlotAllocator(16, 8)
    full = a.alloc(3)
    a.free_swa(full[:1])
    with pytest.raises(ValueError, match="hold no SWA slot"):
        a.free_swa(full)  # the first was released already
    assert a.translate(full)[1:].gt(0).all()
    a.free(full)
    with pytest.raises(ValueError, match="already free"):
        a.free(full)
    assert a.available == a.capacity and a.swa_available == a.swa_capacity
    a.check_integrity()


def test_adopt_moves_the_swa_slot():
    a = SWASlotAllocator(16, 8)
    dst, src = a.alloc(2), a.alloc(2)
    a.free_swa(dst)
    swa = a.translate(src)
    a.adopt_swa(dst, src)
    assert torch.equal(a.translate(dst), swa) and not a.translate(src).any()
    with pytest.raises(ValueError):
        a.adopt_swa(dst, src)  # the sources hold none now
    a.free(src)
    a.check_integrity()
    assert a.swa_available == a.swa_capacity - 2


def test_integrity_catches_a_leaked_or_dangling_translation():
    a = SWASlotAllocator(16, 8)
    full = a.alloc(2)
    a._map[int(full[0])] = 0  # its SWA slot is in use but named by no full slot
    with pytest.raises(AssertionError, match="leaked"):
        a.check_integrity()
    a = SWASlotAllocator(16, 8)
    a._map[5] = 3  # a free full slot names an SWA slot
    with pytest.raises(AssertionError, match="free full slot"):
        a.check_integrity()


def test_only_page_size_one():
    with pytest.raises(ValueError, match="page_size 1 only"):
        SWASlotAllocator(16, 8, page_size=2)


# ----------------------------------------------------------------------- pool


def test_pool_sizes_each_layer_by_its_kind():
    sliding = [True, False, True, True]
    pool = SWAKVPool(32, 8, sliding, 2, 4, torch.float32, 3, 16)
    assert [b.shape[0] for b in pool.k_buffers] == [8, 32, 8, 8]
    assert [b.shape[0] for b in pool.v_buffers] == [8, 32, 8, 8]
    assert pool.req_to_token.shape == (3, 16)
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.store_kv(2, torch.tensor([3, 7]), k, v)
    assert torch.equal(pool.k_buffers[2][[3, 7]], k) and torch.equal(pool.v_buffers[2][[3, 7]], v)
    assert not pool.k_buffers[0].any() and not pool.k_buffers[3].any()
    per = 2 * 2 * 4 * 4
    assert pool.kv_bytes() == per * (32 * 1 + 8 * 3)
    rows = [pool.alloc_row() for _ in range(3)]
    assert pool.alloc_row() is None and pool.free_rows == 0
    pool.free_row(rows[0])
    assert pool.free_rows == 1


def test_pool_with_every_layer_sliding_and_with_none():
    pool = SWAKVPool(32, 8, [True, True], 1, 4, torch.float32, 2, 8)
    assert [b.shape[0] for b in pool.k_buffers] == [8, 8]
    assert pool.kv_bytes() == 2 * 2 * 4 * 4 * 8
    with pytest.raises(ValueError, match="no layer has a sliding window"):
        SWAKVPool(32, 8, [False], 1, 4, torch.float32, 2, 8)


# ---------------------------------------------------------------------- cache


def test_constructor_refusals():
    with pytest.raises(TypeError):
        SWARadixCache(object(), 4)
    with pytest.raises(ValueError, match="window"):
        SWARadixCache(SWASlotAllocator(16, 8), 0)


def test_finished_request_leaves_its_window_live_and_the_rest_tombstoned():
    alloc, cache = make(window=4)
    run(alloc, cache, list(range(10)))
    assert shape(cache) == [(0, 6, True), (6, 10, False)]
    assert cache.swa_evictable_size == 4 and cache.evictable_size == 10
    check_swa_partition(alloc, cache, [])
    assert cache.match_prefix(list(range(10)) + [99]).hit_len == 10
    # a prefix ending in the tombstone, or fewer than W tokens after it, is no hit
    for n in (3, 6, 8, 9):
        assert cache.match_prefix(list(range(n))).hit_len == 0
    assert alloc.swa_available == alloc.swa_capacity - 4


def test_short_prefixes_need_only_what_they_have():
    alloc, cache = make(window=8)
    run(alloc, cache, list(range(5)))
    assert shape(cache) == [(0, 5, False)]
    m = cache.match_prefix([0, 1, 2, 9])
    assert m.hit_len == 3 and m.last_node.depth == 3  # split at the hit
    assert cache.peek_prefix([0, 1, 2, 3, 4, 5]).hit_len == 5


def test_match_cuts_back_past_a_tombstone():
    alloc, cache = make(window=3)
    toks = list(range(14))
    row = alloc.alloc(14)
    alloc.free_swa(row[4:8])
    assert cache.insert_prefix(toks, row).cached_len == 0
    assert shape(cache) == [(0, 4, False), (4, 8, True), (8, 14, False)]
    for n, hit in [(14, 14), (13, 13), (11, 11), (10, 4), (8, 4), (6, 4), (3, 3)]:
        assert cache.peek_prefix(toks[:n]).hit_len == hit, n
        m = cache.match_prefix(toks[:n])
        assert m.hit_len == hit and torch.equal(m.kv_indices, row[:hit]), n
        assert m.last_node.depth == hit
    check_swa_partition(alloc, cache, [])


def test_match_agrees_with_a_naive_window_rule():
    rng = random.Random(0)
    for window in (1, 2, 3, 5):
        alloc, cache = make(window, num_slots=4096, num_swa=4096)
        seqs = []
        for _ in range(60):
            base = rng.choice(seqs)[: rng.randint(0, 12)] if seqs and rng.random() < 0.7 else []
            seq = base + [rng.randrange(3) for _ in range(rng.randint(1, 10))]
            if rng.random() < 0.5:
                run(alloc, cache, seq)
                seqs.append(seq)
            elif rng.random() < 0.5:
                cache.evict_swa(rng.randint(0, 6))
            want = naive_hit(cache, seq, None)
            assert cache.peek_prefix(seq).hit_len == want
            m = cache.match_prefix(seq)
            assert m.hit_len == want and m.kv_indices.numel() == want
            check_swa_partition(alloc, cache, [])


def test_lock_splits_at_the_window_start_and_unlock_walks_the_same_tokens():
    alloc, cache = make(window=4)
    toks = list(range(12))
    run(alloc, cache, toks)
    assert shape(cache) == [(0, 8, True), (8, 12, False)]
    m = cache.match_prefix(toks + [99])
    cache.lock(m.last_node)
    assert cache.swa_protected_size == 4
    run(alloc, cache, toks[:10] + [77])  # its insert splits the locked window at 10
    pieces = [n for n in nodes(cache) if n.swa_lock_ref]
    assert sorted((n.depth - n.num_tokens, n.depth) for n in pieces) == [(8, 10), (10, 12)]
    cache.unlock(m.last_node)
    assert cache.swa_protected_size == 0 and cache.protected_size == 0
    cache.check_integrity()
    m = cache.match_prefix(toks[:11])
    assert m.hit_len == 11
    cache.lock(m.last_node)  # the window [7, 11) starts inside a node: split there
    assert (7, 8) in [(b, e) for b, e, _ in shape(cache)]
    cache.unlock(m.last_node)
    check_swa_partition(alloc, cache, [])


def test_lock_refuses_a_window_with_a_tombstone():
    alloc, cache = make(window=4)
    run(alloc, cache, list(range(10)))
    leaf = max(nodes(cache), key=lambda n: n.depth)
    cache.evict_swa(4)
    assert leaf.swa_tombstone
    with pytest.raises(RuntimeError, match="tombstone"):
        cache.lock(leaf)
    assert cache.protected_size == 0 and cache.swa_protected_size == 0
    cache.check_integrity()


def test_unlock_window_then_unlock_full():
    alloc, cache = make(window=2)
    run(alloc, cache, list(range(6)))
    m = cache.match_prefix(list(range(6)) + [9])
    cache.lock(m.last_node)
    cache.unlock_window(m.last_node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock_window(m.last_node)
    assert cache.swa_protected_size == 0 and cache.protected_size == 6
    assert cache.evict_swa(10) == 2  # the window is SWA-evictable, the path still locked
    assert cache.evict(100) == 0
    cache.unlock(m.last_node, window=False)
    assert cache.evict(100) == 6
    check_swa_partition(alloc, cache, [])


def test_release_behind_frees_the_private_tail_and_then_the_window_lock():
    alloc, cache = make(window=3)
    run(alloc, cache, list(range(5)))
    m = cache.match_prefix(list(range(5)) + [7])
    cache.lock(m.last_node)
    released = cache.window_start(m.hit_len)
    assert released == 2
    row = m.kv_indices.clone()
    for kv_len in range(6, 14):
        row = torch.cat([row, alloc.alloc(1)])
        released = cache.release_behind(m.last_node, 5, row, released, kv_len)
        assert released == max(2, kv_len - 3)
        held = (alloc.translate(row) != 0).tolist()
        assert held[kv_len - 3 :] == [True] * 3  # the next token's window
        assert sum(held[5:]) <= 3
        assert cache.swa_protected_size == max(0, 5 - max(2, kv_len - 3))  # it slides
        check_swa_partition(alloc, cache, [row[5:]], window=3)
    alloc.free(row[5:])
    cache.unlock(m.last_node, window=released < 5, released=released)
    check_swa_partition(alloc, cache, [])


def test_insert_revives_tombstones_with_the_callers_swa_slots():
    alloc, cache = make(window=3)
    toks = list(range(8))
    run(alloc, cache, toks)
    cache.evict_swa(100)
    assert all(t for _, _, t in shape(cache))
    assert cache.match_prefix(toks).hit_len == 0
    # a request computes the same tokens again (nothing usable was cached)
    row = alloc.alloc(8)
    released = cache.release_behind(cache.root, 0, row, 0, 8)
    mine = alloc.translate(row[5:])
    ins = cache.insert_prefix(toks, row)
    assert ins.cached_len == 8
    alloc.free(row[: ins.cached_len])  # its duplicates (their SWA slots now the tree's)
    assert torch.equal(alloc.translate(ins.kv_indices[5:]), mine)
    assert shape(cache) == [(0, 5, True), (5, 8, False)]
    cache.lock(ins.last_node)
    assert released == 5 and cache.match_prefix(toks).hit_len == 8
    cache.unlock(ins.last_node)
    check_swa_partition(alloc, cache, [])


def test_evict_swa_takes_the_least_recent_and_ancestors_first():
    alloc, cache = make(window=2)
    run(alloc, cache, [1, 2])
    run(alloc, cache, [1, 2, 3, 4])  # touches [1, 2] again, later
    run(alloc, cache, [7, 8])
    before = shape(cache)
    assert (0, 2, False) in before and (2, 4, False) in before
    freed = cache.evict_swa(1)
    assert freed == 2
    dead = [n for n in nodes(cache) if n.swa_tombstone]
    assert [n.key for n in dead] == [[1, 2]]  # oldest touch, and above [3, 4] on the tie
    cache.check_integrity()


def test_full_eviction_takes_tombstoned_leaves_first():
    alloc, cache = make(window=2)
    run(alloc, cache, [1, 2, 3])
    slots = run(alloc, cache, [5, 6, 7])
    cache.match_prefix([1, 2, 3])  # now the more recent
    assert cache.evict_swa(2) == 2  # tombstones the least recent live node: [6, 7]
    cache.insert_prefix([5, 6, 7], slots)  # touches [5, 6, 7]: the most recent, tombstoned
    assert cache.evict(1) == 2
    assert cache.cached_sequences() == {(None, (1, 2, 3)), (None, (5,))}
    check_swa_partition(alloc, cache, [])


def test_integrity_catches_broken_swa_state():
    def fresh():
        alloc, cache = make(window=2)
        run(alloc, cache, [1, 2, 3, 4])
        return alloc, cache, max(nodes(cache), key=lambda n: n.depth)

    alloc, cache, leaf = fresh()
    leaf.swa_tombstone = True  # its tokens still hold SWA slots
    with pytest.raises(AssertionError):
        cache.check_integrity()
    alloc, cache, leaf = fresh()
    alloc.free_swa(leaf._np[:1])  # a live node loses one token's SWA
    with pytest.raises(AssertionError, match="without SWA slots"):
        cache.check_integrity()
    alloc, cache, leaf = fresh()
    cache.swa_evictable_size += 1
    with pytest.raises(AssertionError, match="swa_evictable_size"):
        cache.check_integrity()
    alloc, cache, leaf = fresh()
    leaf.swa_lock_ref = 1  # a window lock without the full lock
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_pool_stats_and_reset():
    alloc, cache = make(window=3, num_slots=64, num_swa=32)
    run(alloc, cache, list(range(10)))
    m = cache.match_prefix(list(range(10)))
    cache.lock(m.last_node)
    private = alloc.alloc(2)
    s = cache.pool_stats()
    assert s == {
        "full_slots": 63,
        "full_free": 63 - 12,
        "full_tree": 10,
        "full_evictable": 0,
        "full_requests": 2,
        "swa_slots": 31,
        "swa_free": 31 - 5,
        "swa_tree": 3,
        "swa_evictable": 0,
        "swa_requests": 2,
    }
    cache.unlock(m.last_node)
    alloc.free(private)
    cache.reset()
    assert alloc.available == alloc.capacity and alloc.swa_available == alloc.swa_capacity
    check_swa_partition(alloc, cache, [])


def test_salted_namespaces_count_depth_from_their_root():
    alloc, cache = make(window=2)
    run(alloc, cache, [1, 2, 3], salt="a")
    run(alloc, cache, [1, 2, 3])
    assert cache.match_prefix([1, 2, 3], "a").hit_len == 3
    assert cache.match_prefix([1, 2, 3], "b").hit_len == 0
    assert sorted(n.depth for n in nodes(cache)) == [1, 1, 3, 3]
    check_swa_partition(alloc, cache, [])


def test_events_replay_onto_a_mirror():
    alloc, cache = make(window=2, record_events=True)
    for seq in ([1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]):
        run(alloc, cache, seq)
    cache.evict_swa(3)
    cache.evict(2)
    mirror = MirrorTree()
    mirror.apply_all(cache.take_events())
    assert mirror.cached_sequences() == cache.cached_sequences()


# ------------------------------------------------------------ state machine


def naive_hit(cache, tokens, salt):
    """The longest prefix of ``tokens`` whose last min(W, L) tokens are live, read from the
    tree by plain dict walking, token by token."""
    node = cache.root if salt is None else cache.root.children.get(salt)
    live, i = [], 0
    while node is not None and i < len(tokens):
        child = node.children.get(tokens[i])
        if child is None:
            break
        key, k = child.key, 0
        while k < len(key) and i + k < len(tokens) and key[k] == tokens[i + k]:
            k += 1
        live += [not child.swa_tombstone] * k
        i += k
        node = child if k == len(key) else None
    w = cache.window
    return max(n for n in range(len(live) + 1) if all(live[max(0, n - w) : n]))


ALPHABET = st.integers(0, 3)
SALTS = st.sampled_from([None, None, "a"])


class Request:
    """What the scheduler keeps for a running request (``Req`` and its row)."""

    __slots__ = ("tokens", "salt", "row", "prefix_len", "node", "released")

    def __init__(self, tokens, salt, row, prefix_len, node, released):
        self.tokens = tokens  # computed tokens: row[i] holds the KV of tokens[i]
        self.salt = salt
        self.row = row  # full slots; [:prefix_len] the tree's, the rest private
        self.prefix_len = prefix_len
        self.node = node  # the locked node
        self.released = released  # release_behind's state; window lock held iff < prefix_len


class SWAServingTrace(RuleBasedStateMachine):
    """The scheduler's calls on a small pair of pools: admit (match, lock, allocate, compute),
    decode, cache a chunk, finish, abort, evict either pool, revisit prefixes.

    ``meaning[full]`` and ``swa_meaning[swa]`` record which (salt, token prefix) the KV in a
    slot was computed for. Every hit must hand back full slots of the matched prefix whose
    last min(W, L) tokens hold SWA slots of the same prefixes, and it must be the longest
    such; every running request's next window must hold its own SWA KV.
    """

    @initialize(
        window=st.sampled_from([1, 2, 3, 5, 8]),
        num_slots=st.sampled_from([48, 96]),
        num_swa=st.sampled_from([24, 40, 96]),
        policy=st.sampled_from(["lru", "lfu"]),
    )
    def setup(self, window, num_slots, num_swa, policy):
        self.w = window
        self.alloc = SWASlotAllocator(num_slots, num_swa)
        self.cache = SWARadixCache(self.alloc, window, eviction_policy=policy, record_events=True)
        self.mirror = MirrorTree(window=window)  # what a DP router sees, from the events
        self.live: list[Request] = []
        self.seen: list[list[int]] = []
        self.meaning: dict[int, tuple] = {}
        self.swa_meaning: dict[int, tuple] = {}

    # -- the scheduler's side

    def _alloc(self, n: int):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.cache.evict(max(0, n - self.alloc.available))
            self.cache.evict_swa(max(0, n - self.alloc.swa_available))
            slots = self.alloc.alloc(n)
        return slots

    def _compute(self, req: Request, new: list[int]) -> bool:
        """Allocate, 'run the forward' (record what each new slot holds), give back what is
        behind the window. False (nothing changed) if the pools are out of room."""
        slots = self._alloc(len(new))
        if slots is None:
            return False
        start = len(req.tokens)
        req.tokens = req.tokens + new
        for i, (f, s) in enumerate(zip(slots.tolist(), self.alloc.translate(slots).tolist())):
            self.meaning[f] = self.swa_meaning[s] = (req.salt, tuple(req.tokens[: start + i + 1]))
        req.row = torch.cat([req.row, slots])
        req.released = self.cache.release_behind(
            req.node, req.prefix_len, req.row, req.released, len(req.tokens)
        )
        return True

    def _cache_computed(self, req: Request) -> None:
        """Insert the request's KV, free its duplicates, re-lock at the new end."""
        ins = self.cache.insert_prefix(req.tokens, req.row, req.salt)
        n = ins.kv_indices.numel()
        assert req.prefix_len <= ins.cached_len <= n == len(req.tokens)
        self.alloc.free(req.row[req.prefix_len : ins.cached_len])
        req.row = ins.kv_indices.clone()
        self.cache.lock(ins.last_node)
        self.cache.unlock(req.node, window=req.released < req.prefix_len, released=req.released)
        req.node, req.prefix_len = ins.last_node, n
        req.released = self.cache.window_start(n)

    def _check_hit(self, tokens, salt, hit_len, kv):
        assert kv.numel() == hit_len <= len(tokens)
        assert hit_len == naive_hit(self.cache, tokens, salt), "not the longest usable prefix"
        for i, f in enumerate(kv.tolist()):
            assert self.meaning[f] == (salt, tuple(tokens[: i + 1])), "KV of another prefix"
        self._check_window(kv, hit_len)

    def _check_window(self, row, length):
        """The window of the token after ``length`` holds SWA KV of the same tokens."""
        window = row[max(0, length - self.w) : length]
        for f, s in zip(window.tolist(), self.alloc.translate(window).tolist()):
            assert s != 0, "a window token holds no SWA slot"
            assert self.swa_meaning[s] == self.meaning[f], "SWA KV of another prefix"

    # -- rules

    @rule(data=st.data())
    def admit(self, data):
        stem = []
        if self.seen and data.draw(st.booleans(), label="share"):
            stem = data.draw(st.sampled_from(self.seen), label="stem")
            stem = stem[: data.draw(st.integers(0, len(stem)), label="cut")]
        tokens = stem + data.draw(st.lists(ALPHABET, min_size=1, max_size=14), label="sfx")
        salt = data.draw(SALTS, label="salt")
        self.seen.append(tokens)
        m = self.cache.match_prefix(tokens[:-1], salt)  # one token always computed
        self._check_hit(tokens[:-1], salt, m.hit_len, m.kv_indices)
        self.cache.lock(m.last_node)
        prefix = tokens[: m.hit_len]
        req = Request(prefix, salt, m.kv_indices.clone(), m.hit_len, m.last_node, 0)
        req.released = self.cache.window_start(m.hit_len)
        if self._compute(req, tokens[m.hit_len :]):
            self.live.append(req)
        else:
            self.cache.unlock(m.last_node)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def decode(self, data, n):
        req = data.draw(st.sampled_from(self.live), label="req")
        self._compute(req, data.draw(st.lists(ALPHABET, min_size=n, max_size=n), label="gen"))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_chunk(self, data):
        req = data.draw(st.sampled_from(self.live), label="req")
        self._cache_computed(req)
        m = self.cache.match_prefix(req.tokens, req.salt)
        assert m.hit_len == len(req.tokens) and torch.equal(m.kv_indices, req.row)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1), label="idx"))
        self._cache_computed(req)
        self.cache.unlock(req.node)
        self._check_hit(req.tokens, req.salt, *self.cache.match_prefix(req.tokens, req.salt)[:2])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        """Leave without caching: every private slot (and what SWA it still holds) is freed."""
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1), label="idx"))
        self.alloc.free(req.row[req.prefix_len :])
        self.cache.unlock(req.node, window=req.released < req.prefix_len, released=req.released)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        before, swa_before = self.cache.evictable_size, self.alloc.swa_available
        freed = self.cache.evict(n)
        assert freed >= min(n, before) or self.cache.evictable_size == 0
        assert self.cache.evictable_size == before - freed
        assert self.alloc.swa_available >= swa_before

    @rule(n=st.integers(0, 30))
    def evict_swa(self, n):
        before, full = self.cache.swa_evictable_size, self.alloc.available
        freed = self.cache.evict_swa(n)
        assert freed >= min(n, before) or self.cache.swa_evictable_size == 0
        assert self.cache.swa_evictable_size == before - freed
        assert self.alloc.available == full, "SWA eviction freed full slots"

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def revisit(self, data):
        tokens = data.draw(st.sampled_from(self.seen), label="seq")
        tokens = tokens[: data.draw(st.integers(1, len(tokens)), label="cut")]
        salt = data.draw(SALTS, label="salt")
        peeked = self.cache.peek_prefix(tokens, salt)
        m = self.cache.match_prefix(tokens, salt)
        assert peeked.hit_len == m.hit_len
        self._check_hit(tokens, salt, m.hit_len, m.kv_indices)

    # -- invariants

    @invariant()
    def consistent(self):
        private = [r.row[r.prefix_len :] for r in self.live]
        check_swa_partition(self.alloc, self.cache, private, window=self.w)
        for r in self.live:
            self._check_window(r.row, len(r.tokens))
        held = self.cache.total_size() + sum(p.numel() for p in private)
        assert self.alloc.available + held == self.alloc.capacity

    @invariant()
    def mirrored(self):
        """The events' and the snapshot's mirrors match every seen prefix as the cache does."""
        self.mirror.apply_all(self.cache.take_events())
        snapshot = MirrorTree(window=self.w)
        snapshot.apply_all(self.cache.snapshot_events())
        assert self.mirror.cached_sequences() == self.cache.cached_sequences()
        for tokens in self.seen[-8:]:
            for salt in (None, "a"):
                for cut in {1, len(tokens) // 2, len(tokens)}:
                    hit = self.cache.peek_prefix(tokens[:cut], salt).hit_len
                    assert self.mirror.match(tokens[:cut], salt) == hit
                    assert snapshot.match(tokens[:cut], salt) == hit

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        while self.live:
            req = self.live.pop()
            self._cache_computed(req)
            self.cache.unlock(req.node)
        check_swa_partition(self.alloc, self.cache, [])
        assert self.cache.protected_size == 0 and self.cache.swa_protected_size == 0
        assert self.alloc.available + self.cache.evictable_size == self.alloc.capacity
        swa_idle = self.alloc.swa_available + self.cache.swa_evictable_size
        assert swa_idle == self.alloc.swa_capacity
        self.cache.evict(10**9)
        assert self.alloc.available == self.alloc.capacity
        assert self.alloc.swa_available == self.alloc.swa_capacity


SWAServingTrace.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSWAServingTrace = SWAServingTrace.TestCase


def test_numpy_and_tensor_token_ids_match_alike():
    alloc, cache = make(window=3)
    run(alloc, cache, [4, 5, 6, 7])
    for ids in ([4, 5, 6, 7], np.array([4, 5, 6, 7]), torch.tensor([4, 5, 6, 7])):
        assert cache.match_prefix(ids).hit_len == 4
