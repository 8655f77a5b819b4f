"""N-gram drafting: the index a radix tree keeps (NgramIndex) and the proposer (NgramProposer),
seed scenarios and a hypothesis state machine against a brute-force search of the cached
sequences, with a twin cache showing the index changes nothing the tree does."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixrt.cache import KVSlotAllocator, RadixCache
from radixrt.cache.swa_allocator import SWASlotAllocator
from radixrt.cache.swa_cache import SWARadixCache
from radixrt.spec.draft import DraftTree
from radixrt.spec.ngram import NgramProposer, own_matches
from radixrt.spec.ngram_index import NgramIndex, gram_hashes, suffix_keys


def make(num_slots: int = 512, page_size: int = 1, **kw) -> tuple[KVSlotAllocator, RadixCache]:
    alloc = KVSlotAllocator(num_slots, page_size)
    return alloc, RadixCache(alloc, page_size, **kw)


def put(alloc, cache, tokens, salt=None) -> None:
    """Cache ``tokens`` as a finished request would: fresh slots, insert, free the duplicates."""
    slots = alloc.alloc(len(tokens))
    if slots is None:
        cache.evict(len(tokens) - alloc.available)
        slots = alloc.alloc(len(tokens))
        if slots is None:
            return  # locked out: dropped
    cached = cache.insert(tokens, slots, cache_salt=salt)
    aligned = len(tokens) // cache.page_size * cache.page_size
    alloc.free(torch.cat([slots[:cached], slots[aligned:]]))


def paths(draft: DraftTree) -> list[list[int]]:
    return [[draft.tokens[i] for i in branch] for branch in draft.branches()]


# ------------------------------------------------------------------ hashing and own matches


def test_gram_hashes_name_their_grams():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 4, 40).astype(np.int64)
    seq[5] = -(2**63)  # any int64 id
    seq[6] = 2**63 - 1
    by_gram: dict[tuple, int] = {}
    for first in (0, 3, 11):
        for k, lo, hashes in gram_hashes(seq, first, 2, 6):
            for j, h in enumerate(hashes.tolist()):
                end = first + lo + j
                gram = tuple(seq[end - k + 1 : end + 1].tolist())
                assert end - k + 1 >= 0
                assert by_gram.setdefault((k, gram), h) == h  # the same gram, the same hash
            assert first + lo - k + 1 == max(0, first - k + 1)  # every whole gram, no partial one
    for k in range(2, 7):  # no collision among these few grams of one window
        hashes = [h for (w, _), h in by_gram.items() if w == k]
        assert len(set(hashes)) == len(hashes)
    keys = suffix_keys(seq, 2, 6)
    for k, key in keys.items():
        assert key == by_gram[(k, tuple(seq[-k:].tolist()))]


def test_own_matches_agree_with_a_scan():
    rng = random.Random(1)
    for _ in range(200):
        tokens = np.array([rng.randrange(3) for _ in range(rng.randint(1, 30))], dtype=np.int64)
        lo, hi = rng.randint(1, 3), rng.randint(3, 6)
        want: dict[int, list[int]] = {}
        for p in range(len(tokens) - 2, -1, -1):
            n = 0
            while n < min(hi, p + 1) and tokens[p - n] == tokens[len(tokens) - 1 - n]:
                n += 1
            if n >= lo:
                want.setdefault(n, []).append(p)
        got = {n: v.tolist() for n, v in own_matches(tokens, lo, hi).items()}
        assert got == want


# ------------------------------------------------------------------ seed scenarios


def test_repeated_text_in_the_request_itself():
    proposer = NgramProposer(None, num_draft_tokens=4, min_match_window=2, max_match_window=4)
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    draft = proposer.propose(text)
    assert paths(draft)[0] == [8, 9, 1, 2]
    assert proposer.propose([1, 2, 3, 4]) == DraftTree()  # nothing repeats
    assert proposer.propose([]) == DraftTree()
    assert proposer.propose(torch.tensor(text)) == draft
    assert proposer.propose(np.array(text, dtype=np.int32)) == draft


def test_continuation_from_another_cached_sequence():
    alloc, cache = make()
    question, answer = [3, 1, 4, 1, 5, 9, 2, 6], [30, 31, 32, 33, 34, 35]
    put(alloc, cache, question + answer)  # the first user's request, finished
    proposer = NgramProposer(cache, num_draft_tokens=5, min_match_window=2, max_match_window=8)
    assert paths(proposer.propose(question)) == [answer[:5]]  # the second user asks the same
    # a quote of the answer in another context continues from where it is in the tree
    assert paths(proposer.propose([7, 7, 31, 32]))[0] == [33, 34, 35]


def test_never_across_salts():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4, 5, 6], salt="alice")
    put(alloc, cache, [1, 2, 3, 7, 8, 9], salt="bob")
    proposer = NgramProposer(cache, num_draft_tokens=3, min_match_window=1, max_match_window=3)
    assert paths(proposer.propose([9, 2, 3], "alice")) == [[4, 5, 6]]
    assert paths(proposer.propose([9, 2, 3], "bob")) == [[7, 8, 9]]
    assert proposer.propose([9, 2, 3]) == DraftTree()  # no salt: its own namespace, empty
    assert proposer.propose([9, 2, 3], "carol") == DraftTree()
    proposer.index.check_integrity()


def test_evicted_sequences_are_never_proposed():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4, 5])
    put(alloc, cache, [9, 2, 3, 7, 8])
    proposer = NgramProposer(cache, 4, min_match_window=2, max_match_window=2, min_bfs_breadth=2)
    assert sorted(paths(proposer.propose([0, 2, 3]))) == [[4, 5], [7, 8]]
    cache.match_prefix([9, 2, 3, 7, 8])  # the second is now the most recent
    assert cache.evict(1) == 5  # the first goes, whole
    proposer.index.check_integrity()
    assert paths(proposer.propose([0, 2, 3])) == [[7, 8]]
    cache.evict(100)
    proposer.index.check_integrity()
    assert proposer.propose([0, 2, 3]) == DraftTree()
    assert proposer.index.num_entries == 0


def test_splits_keep_the_index_right():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    proposer = NgramProposer(cache, 6, min_match_window=2, max_match_window=3, min_bfs_breadth=2)
    cache.match_prefix([1, 2, 3, 9])  # splits the edge after 3 tokens
    cache.match_prefix([1, 2, 3, 4, 5, 6, 0])  # and again after 6
    put(alloc, cache, [1, 2, 3, 4, 10, 11])  # a fork inside the second piece
    proposer.index.check_integrity()
    assert len([n for n in cache._nodes() if n._key]) == 5
    assert paths(proposer.propose([0, 3, 4, 5])) == [[6, 7, 8]]
    assert sorted(paths(proposer.propose([0, 2, 3, 4]))) == [[5, 6, 7, 8], [10, 11]]
    cache.evict(2)  # the least recently used leaf: 7 8
    proposer.index.check_integrity()
    assert paths(proposer.propose([0, 2, 3, 4])) == [[10, 11], [5, 6]]  # the most recent first


def test_ranking_by_frequency_then_recency():
    alloc, cache = make()
    for stem in ([40], [41]):
        put(alloc, cache, stem + [1, 2, 3, 7, 7])  # two sequences continue "1 2 3" with 7 7
    put(alloc, cache, [42, 1, 2, 3, 8, 8])  # one with 8 8, the most recent
    proposer = NgramProposer(cache, 6, 3, 3, min_bfs_breadth=3, max_bfs_breadth=3)
    assert paths(proposer.propose([0, 1, 2, 3])) == [[7, 7], [8, 8]]
    put(alloc, cache, [43, 1, 2, 3, 9, 9])  # one each for 8 and 9: recency orders them
    assert paths(proposer.propose([0, 1, 2, 3])) == [[7, 7], [9, 9], [8, 8]]
    cache.match_prefix([42, 1, 2, 3, 8, 8])  # 8 8 used again: now it comes before 9 9
    assert paths(proposer.propose([0, 1, 2, 3])) == [[7, 7], [8, 8], [9, 9]]


def test_longer_windows_come_first():
    alloc, cache = make()
    put(alloc, cache, [5, 1, 2, 3, 4, 4])
    for stem in ([40], [41], [42]):
        put(alloc, cache, stem + [2, 3, 9, 9])  # more frequent, but a shorter match
    proposer = NgramProposer(cache, 2, min_match_window=1, max_match_window=3, max_bfs_breadth=4)
    assert paths(proposer.propose([1, 2, 3]))[0] == [4, 4]


def test_the_draft_keeps_its_budget_and_breadth():
    alloc, cache = make()
    for tail in range(10, 18):
        put(alloc, cache, [tail, 1, 2, tail, tail + 1, tail + 2])
    index = NgramIndex(cache, 2, 2)
    for budget, breadth in ((3, 1), (6, 2), (12, 5)):
        proposer = NgramProposer(
            index, budget, 2, 2, min_bfs_breadth=breadth, max_bfs_breadth=breadth
        )
        draft = proposer.propose([0, 1, 2])
        assert len(draft) == min(budget, 3 * breadth)
        roots = [t for t, p in zip(draft.tokens, draft.parents) if p == -1]
        assert len(roots) == min(breadth, -(-budget // 3)) and len(set(roots)) == len(roots)
        assert roots == sorted(roots, reverse=True)  # the most recent first


def test_breadth_follows_the_match_window():
    proposer = NgramProposer(None, 8, 1, 4, min_bfs_breadth=1, max_bfs_breadth=9)
    assert proposer.breadth(4, 0) == 1  # the longest match: the narrowest
    assert proposer.breadth(1, 0) == 7  # the shortest: the widest
    assert proposer.breadth(1, 3) == 1  # narrower deeper, never below min_bfs_breadth


def test_own_and_cached_matches_merge():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 50, 51])
    proposer = NgramProposer(cache, 7, 3, 3, min_bfs_breadth=2, max_bfs_breadth=2)
    draft = proposer.propose([1, 2, 3, 60, 61, 1, 2, 3])
    # the request's own tokens rank as the most recent
    assert paths(draft) == [[60, 61, 1, 2, 3], [50, 51]]


def test_index_of_a_tree_built_before_it():
    alloc, cache = make(page_size=2)
    put(alloc, cache, [1, 2, 3, 4, 5, 6])
    put(alloc, cache, [1, 2, 3, 4, 7, 8], salt="s")
    put(alloc, cache, [1, 2, 9, 9])
    index = NgramIndex(cache, 1, 4)
    index.check_integrity()
    with pytest.raises(ValueError, match="already has an observer"):
        NgramIndex(cache)
    with pytest.raises(ValueError, match="windows 1..4"):
        NgramProposer(index, 4, min_match_window=1, max_match_window=5)
    proposer = NgramProposer(index, 4, min_match_window=2, max_match_window=3)
    assert paths(proposer.propose([0, 3, 4], "s")) == [[7, 8]]
    index.detach()
    assert cache.observer is None and index.num_entries == 0
    NgramIndex(cache).check_integrity()


def test_reset_empties_the_index():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    proposer = NgramProposer(cache, 2, min_match_window=1, max_match_window=2)
    cache.reset()
    assert proposer.index.num_entries == 0 and proposer.propose([2, 3]) == DraftTree()
    put(alloc, cache, [1, 2, 3, 5])
    proposer.index.check_integrity()
    assert paths(proposer.propose([2, 3])) == [[5]]


def test_evict_hooks_and_observer_both_run():
    """The hierarchical cache's ``on_evict`` and the index see the same leaves, in the tree."""
    seen = []
    alloc = KVSlotAllocator(64)
    cache = RadixCache(alloc, on_evict=lambda leaf: seen.append((leaf.key, leaf.parent.key)))
    index = NgramIndex(cache, 1, 3)
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4, 5])
    assert cache.evict(1) == 1
    assert seen == [([3], [1, 2])]
    index.check_integrity()
    cache.evict(10)
    index.check_integrity()
    assert index.num_entries == 0


def test_sliding_window_cache():
    alloc = SWASlotAllocator(128, 64)
    cache = SWARadixCache(alloc, window=2)
    proposer = NgramProposer(cache, 4, 2, 3, min_bfs_breadth=2, max_bfs_breadth=2)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 3, 4, 5, 0]):
        m = cache.match_prefix(tokens)
        row = torch.cat([m.kv_indices, alloc.alloc(len(tokens) - m.hit_len)])
        ins = cache.insert_prefix(tokens, row)
        alloc.free(row[m.hit_len : ins.cached_len])
    cache.evict_swa(6)  # tombstones keep their tokens: drafts may still read them
    proposer.index.check_integrity()
    assert sorted(paths(proposer.propose([0, 3, 4]))) == [[5, 0], [5, 6]]
    cache.evict(100)
    proposer.index.check_integrity()
    assert proposer.index.num_entries == 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_draft_tokens": 0}, "speculative_num_draft_tokens"),
        ({"min_match_window": 0}, "match_window_size"),
        ({"min_match_window": 5, "max_match_window": 4}, "match_window_size"),
        ({"min_bfs_breadth": 3, "max_bfs_breadth": 2}, "bfs_breadth"),
        ({"max_matches": 0}, "max_matches"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, name):
    args = {"num_draft_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        NgramProposer(None, **args)


def test_bad_tokens_are_refused():
    with pytest.raises(ValueError, match="integers"):
        NgramProposer(None, 4).propose([1.5, 2.0])


# ------------------------------------------------------------------ stateful test

ALPHABET = st.integers(0, 3)
SALTS = st.sampled_from([None, None, "a", "b"])
MIN_W, MAX_W, BUDGET = 1, 4, 5


def occurs(needle: tuple, hay: tuple) -> bool:
    n = len(needle)
    return any(hay[i : i + n] == needle for i in range(len(hay) - n + 1))


class DraftTrace(RuleBasedStateMachine):
    """Inserts, matches (splits), locks, evictions and resets on a cache with an index and on a
    twin without one; every proposal is checked against a brute-force search of the cached
    sequences, and the two trees must stay the same, event for event."""

    @initialize(page_size=st.sampled_from([1, 2]), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page_size, policy):
        self.p = page_size
        self.pairs = [make(64, page_size, eviction_policy=policy, record_events=True) for _ in "ab"]
        self.proposer = NgramProposer(
            self.pairs[0][1], BUDGET, MIN_W, MAX_W, max_bfs_breadth=3, max_matches=10**6
        )
        self.seen: list[list[int]] = []
        self.locked: list[tuple] = []

    def _both(self, op):
        results = [op(alloc, cache) for alloc, cache in self.pairs]
        assert results[0] == results[1]
        events = [cache.take_events() for _, cache in self.pairs]
        assert events[0] == events[1], "the index changed what the tree records"
        return results[0]

    def _draw_tokens(self, data, label):
        stem = []
        if self.seen and data.draw(st.booleans(), label=f"{label} shares"):
            stem = data.draw(st.sampled_from(self.seen), label=f"{label} stem")
            stem = stem[data.draw(st.integers(0, len(stem)), label=f"{label} from") :]
        return stem + data.draw(st.lists(ALPHABET, max_size=8), label=f"{label} tail")

    @rule(data=st.data(), salt=SALTS)
    def insert(self, data, salt):
        tokens = self._draw_tokens(data, "insert")
        if not tokens or len(tokens) > 24:
            return
        self.seen.append(tokens)
        self._both(lambda alloc, cache: put(alloc, cache, tokens, salt))

    @rule(data=st.data(), salt=SALTS, lock=st.booleans())
    def match(self, data, salt, lock):
        tokens = self._draw_tokens(data, "match")

        def op(alloc, cache):
            m = cache.match_prefix(tokens, salt)
            if lock:
                cache.lock(m.last_node)
            return m.hit_len, m.kv_indices.tolist(), m.last_node

        results = [op(*pair) for pair in self.pairs]
        assert results[0][:2] == results[1][:2]
        nodes = [r[2] for r in results]
        assert nodes[0].id == nodes[1].id
        self._both(lambda alloc, cache: None)  # compare the events
        if lock:
            self.locked.append(tuple(nodes))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        nodes = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1), label="unlock"))
        for (_, cache), node in zip(self.pairs, nodes):
            cache.unlock(node)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        self._both(lambda alloc, cache: cache.evict(n))

    @precondition(lambda self: not self.locked)
    @rule(roll=st.integers(0, 7))
    def reset(self, roll):
        if roll == 0:  # rarely: a reset empties what the other rules build
            self._both(lambda alloc, cache: cache.reset())

    @rule(data=st.data(), salt=SALTS)
    def propose(self, data, salt):
        self._propose(self._draw_tokens(data, "query"), salt)

    def _propose(self, tokens, salt):
        cache = self.pairs[0][1]
        before = cache_state(cache)
        draft = self.proposer.propose(tokens, salt)
        assert cache_state(cache) == before, "propose changed the tree"
        self._both(lambda alloc, cache: None)
        check_draft(draft, tokens, [s for t, s in cache.cached_sequences() if t == salt])

    @invariant()
    def consistent(self):
        if not hasattr(self, "pairs"):
            return
        self.proposer.index.check_integrity()
        a, b = (cache for _, cache in self.pairs)
        a.check_integrity()
        assert a.cached_sequences() == b.cached_sequences()
        assert (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)
        for tokens in self.seen[-2:]:  # and a lookup at every step: the latest sequences' ends
            self._propose(tokens[len(tokens) // 2 :], None)


def cache_state(cache: RadixCache) -> list[tuple]:
    return sorted(
        (n.id, n.key, n.lock_ref, n.last_access, n.hit_count) for n in cache._nodes() if n._key
    )


def check_draft(draft: DraftTree, tokens: list[int], cached: list[tuple[int, ...]]) -> None:
    """Every branch continues a suffix of ``tokens`` (of a window) in a cached sequence of the
    salt or in ``tokens``; the draft is empty exactly when nothing continues; the first branch
    starts from the longest window that has a continuation; siblings differ; budget kept."""
    assert len(draft) <= BUDGET
    siblings = [(p, t) for t, p in zip(draft.tokens, draft.parents)]
    assert len(set(siblings)) == len(siblings), "two siblings hold the same token"
    own = tuple(tokens)
    windows = range(MIN_W, min(MAX_W, len(tokens)) + 1)

    def continues(n: int, follow: tuple) -> bool:
        needle = own[len(own) - n :] + follow
        return any(occurs(needle, s) for s in cached) or occurs(needle, own)

    vocab = set(own).union(*cached)
    longest = max((n for n in windows for t in vocab if continues(n, (t,))), default=0)
    assert (longest == 0) == (len(draft) == 0), (longest, draft)
    for i, branch in enumerate(paths(draft)):
        assert any(continues(n, tuple(branch)) for n in windows), (tokens, branch)
        if i == 0:
            assert continues(longest, tuple(branch[:1])), "the first branch is not the longest"


DraftTrace.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDraftTrace = DraftTrace.TestCase


@pytest.mark.parametrize("min_window", [1, 2, 3])
def test_the_quick_miss_answers_as_the_full_search(min_window, monkeypatch):
    """``propose`` answers a miss before searching: the same draft as with the search alone."""
    rng = random.Random(min_window)
    alloc, cache = make(4096)
    for salt in (None, "a"):
        for _ in range(6):
            put(alloc, cache, [rng.randrange(5) for _ in range(rng.randrange(1, 12))], salt)
    proposer = NgramProposer(cache, 6, min_window, 5, max_bfs_breadth=3)
    queries = [[rng.randrange(6) for _ in range(rng.randrange(0, 10))] for _ in range(400)]
    salts = [rng.choice([None, "a", "b"]) for _ in queries]
    quick = [proposer.propose(q, s) for q, s in zip(queries, salts)]
    monkeypatch.setattr(NgramProposer, "_may_match", lambda self, arr, salt: arr.size > 0)
    full = [proposer.propose(q, s) for q, s in zip(queries, salts)]
    assert quick == full
    empty = sum(d == DraftTree() for d in full)
    assert 0 < empty < len(queries)  # both answers occur
