"""KV events: what RadixCache records, the MirrorTree built from them, ReplicaMirror's resyncs."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixrt.cache import KVSlotAllocator, MirrorError, MirrorTree, RadixCache, ReplicaMirror
from radixrt.cache.swa_allocator import SWASlotAllocator
from radixrt.cache.swa_cache import SWARadixCache
from radixrt.protocol import (
    KVCleared,
    KVEventBatch,
    KVRemoved,
    KVSnapshot,
    KVSplit,
    KVStored,
    KVWindow,
    decode,
    encode,
)


def make(page_size: int = 1, num_slots: int = 256, record: bool = True):
    alloc = KVSlotAllocator(num_slots, page_size)
    return alloc, RadixCache(alloc, page_size, record_events=record)


def put(alloc, cache, tokens, salt=None) -> bool:
    """Serve ``tokens`` from scratch (evicting if short); False if the pool cannot hold them."""
    slots = alloc.alloc(len(tokens))
    if slots is None:
        cache.evict(len(tokens) + cache.page_size - alloc.available)
        slots = alloc.alloc(len(tokens))
        if slots is None:
            return False
    cached = cache.insert(tokens, slots, cache_salt=salt)
    aligned = len(tokens) // cache.page_size * cache.page_size
    alloc.free(torch.cat([slots[:cached], slots[aligned:]]))
    return True


class Publisher:
    """The scheduler side: one KVEventBatch per step with events, through the wire form."""

    def __init__(self, cache: RadixCache, replica: int = 0) -> None:
        self.cache, self.replica, self.seq = cache, replica, 0

    def batch(self) -> KVEventBatch | None:
        events = self.cache.take_events()
        if not events:
            return None
        self.seq += 1
        msg = KVEventBatch(
            replica=self.replica, seq=self.seq, events=events, page_size=self.cache.page_size
        )
        return decode(encode(msg))

    def snapshot(self) -> KVSnapshot:
        assert not self.cache.take_events(), "publish pending events before a snapshot"
        snap = KVSnapshot(
            replica=self.replica,
            seq=self.seq,
            events=self.cache.snapshot_events(),
            page_size=self.cache.page_size,
        )
        return decode(encode(snap))


def structure(tree_or_cache) -> set[tuple]:
    """(id, parent id, tokens, salt) of every node but the root."""
    if isinstance(tree_or_cache, RadixCache):
        return {
            (e.node, e.parent, tuple(e.token_ids), e.cache_salt)
            for e in tree_or_cache.snapshot_events()
        }
    return {
        (
            n.id,
            n.parent.id,
            tuple(np.frombuffer(n.key, dtype=np.int64).tolist()),
            n.head if not n.key else None,
        )
        for n in tree_or_cache._nodes.values()
        if n is not tree_or_cache.root
    }


def assert_mirrors(tree: MirrorTree, cache: RadixCache) -> None:
    assert tree.cached_sequences() == cache.cached_sequences()
    assert structure(tree) == structure(cache)
    assert tree.num_tokens == cache.total_size()


# ------------------------------------------------------------ what is recorded


def test_events_of_each_change():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    assert cache.take_events() == [KVStored(node=1, parent=0, token_ids=[1, 2, 3, 4])]
    put(alloc, cache, [1, 2, 9])  # forks inside the edge: split, then the new leaf
    assert cache.take_events() == [
        KVSplit(node=1, upper=2, at=2),
        KVStored(node=3, parent=2, token_ids=[9]),
    ]
    cache.match_prefix([1, 2, 3, 4])  # a full hit changes no shape
    cache.peek_prefix([1, 2, 3])
    put(alloc, cache, [1, 2, 3, 4])
    assert cache.take_events() == []
    cache.match_prefix([1, 2, 3, 7])  # ends inside [3, 4]
    assert cache.take_events() == [KVSplit(node=1, upper=4, at=1)]
    put(alloc, cache, [5, 6], salt="t")  # the namespace comes before its first leaf
    assert cache.take_events() == [
        KVStored(node=5, parent=0, token_ids=[], cache_salt="t"),
        KVStored(node=6, parent=5, token_ids=[5, 6]),
    ]
    assert cache.evict(10**9) == 7
    (removed,) = cache.take_events()
    assert removed.nodes.index(5) == removed.nodes.index(6) + 1  # namespace right after its leaf
    assert sorted(removed.nodes) == [1, 2, 3, 4, 5, 6]
    assert cache.evict(10) == 0 and cache.take_events() == []
    cache.reset()
    assert cache.take_events() == [KVCleared()]


def test_evict_lists_leaves_in_removal_order():
    alloc, cache = make()
    put(alloc, cache, [1, 2])  # node 1
    put(alloc, cache, [1, 3])  # node 1 split: upper [1] is node 2, over [2] (1) and [3] (3)
    put(alloc, cache, [7])  # node 4
    cache.take_events()
    cache.match_prefix([7])  # [7] is now the most recent
    cache.evict(2)  # the two leaves under [1], least recent first
    assert cache.take_events() == [KVRemoved(nodes=[1, 3])]
    cache.evict(2)  # then [1], now a leaf and older than [7]
    assert cache.take_events() == [KVRemoved(nodes=[2, 4])]


def test_page_size_runs_are_whole_pages():
    alloc, cache = make(page_size=4)
    put(alloc, cache, list(range(10)))  # 8 tokens cached
    put(alloc, cache, [0, 1, 2, 3, 9, 9, 9, 9])
    events = cache.take_events()
    assert events == [
        KVStored(node=1, parent=0, token_ids=list(range(8))),
        KVSplit(node=1, upper=2, at=4),
        KVStored(node=3, parent=2, token_ids=[9, 9, 9, 9]),
    ]


def test_wire_form_nests_tagged_events():
    msg = KVEventBatch(
        replica=2,
        seq=1,
        events=[
            KVStored(node=1, parent=0, token_ids=[], cache_salt="s"),
            KVStored(node=2, parent=1, token_ids=[4, 5]),
            KVSplit(node=2, upper=3, at=1),
            KVRemoved(nodes=[2]),
            KVCleared(),
        ],
    )
    data = encode(msg)
    raw = msgspec.msgpack.decode(data)
    assert raw["type"] == "kv_events"
    assert [e["type"] for e in raw["events"]] == ["stored", "stored", "split", "removed", "cleared"]
    assert decode(data) == msg
    snap = KVSnapshot(replica=2, seq=7, events=msg.events[:2], page_size=4)
    assert decode(encode(snap)) == snap


def test_recording_off():
    alloc, cache = make(record=False)
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4], salt="s")
    cache.match_prefix([1, 2])
    cache.evict(1)
    cache.reset()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 5])
    put(alloc, cache, [9], salt="s")
    assert cache.take_events() == []
    tree = MirrorTree()
    tree.apply_all(cache.snapshot_events())
    assert_mirrors(tree, cache)


def test_snapshot_lists_parents_first():
    alloc, cache = make()
    for seq in ([1, 2, 3], [1, 2, 4], [1, 5], [2], [3, 3]):
        put(alloc, cache, seq)
        put(alloc, cache, seq, salt="a")
    seen = {0}
    for event in cache.snapshot_events():
        assert event.parent in seen
        seen.add(event.node)
    assert len(seen) - 1 == len(cache.snapshot_events())


# ------------------------------------------------------------------ the mirror


def test_mirror_match_equals_peek():
    alloc, cache = make(page_size=2)
    put(alloc, cache, [1, 2, 3, 4, 5, 6])
    put(alloc, cache, [1, 2, 3, 9])
    put(alloc, cache, [1, 2, 7, 7], salt="s")
    tree = MirrorTree(2)
    tree.apply_all(cache.take_events())
    probes = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 3, 9, 9], [1], [], [8]]
    for probe in probes:
        for salt in (None, "s", "other"):
            want = cache.peek_prefix(probe, cache_salt=salt).hit_len
            assert tree.match(probe, salt) == want, (probe, salt)
            assert tree.match(np.array(probe, dtype=np.int64), salt) == want
            assert tree.match(torch.tensor(probe, dtype=torch.int64), salt) == want
    assert tree.match([1, 2, 3, 4, 5, 6]) == 6 and tree.match([1, 2, 7, 7], "s") == 4


def test_mirror_rejects_events_that_do_not_fit():
    tree = MirrorTree()
    with pytest.raises(MirrorError, match="unknown node 99"):
        tree.apply(KVSplit(node=99, upper=100, at=1))
    with pytest.raises(MirrorError, match="unknown node 7"):
        tree.apply(KVStored(node=1, parent=7, token_ids=[1]))
    with pytest.raises(MirrorError, match="unknown node 5"):
        tree.apply(KVRemoved(nodes=[5]))
    tree.apply(KVStored(node=1, parent=0, token_ids=[1, 2]))
    with pytest.raises(MirrorError, match="already exists"):
        tree.apply(KVStored(node=1, parent=0, token_ids=[3]))
    tree.apply(KVStored(node=2, parent=1, token_ids=[3]))
    with pytest.raises(MirrorError, match="not a leaf"):
        tree.apply(KVRemoved(nodes=[1]))
    with pytest.raises(MirrorError, match="cannot split"):
        tree.apply(KVSplit(node=1, upper=3, at=2))
    with pytest.raises(MirrorError, match="whole pages"):
        MirrorTree(4).apply(KVStored(node=1, parent=0, token_ids=[1, 2]))
    with pytest.raises(TypeError, match="not a KV event"):
        tree.apply(KVEventBatch(replica=0, seq=1, events=[]))
    tree.apply(KVCleared())
    assert tree.num_nodes == 0 and tree.num_tokens == 0 and tree.cached_sequences() == set()


def test_cleared_then_ids_restart():
    alloc, cache = make()
    pub, mirror = Publisher(cache), ReplicaMirror(0)
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [4], salt="s")
    assert not mirror.on_batch(pub.batch())
    cache.reset()
    put(alloc, cache, [5, 6])  # node 1 again, now another run
    assert not mirror.on_batch(pub.batch())
    assert_mirrors(mirror.tree, cache)
    assert mirror.match([5, 6, 7]) == 2 and mirror.match([1, 2]) == 0


def _published(n: int, page_size: int = 1):
    """A cache and its first ``n`` batches, each from one change."""
    alloc, cache = make(page_size)
    pub = Publisher(cache)
    batches = []
    for i in range(n):
        put(alloc, cache, [1, 2, 3 + i % 3, i] * page_size, salt="s" if i % 4 == 3 else None)
        batches.append(pub.batch())
    return alloc, cache, pub, batches


def test_in_order_batches_and_duplicates():
    alloc, cache, pub, batches = _published(4)
    mirror = ReplicaMirror(0)
    for b in [batches[0], batches[1], batches[1], batches[0], batches[2], batches[3], batches[2]]:
        assert mirror.on_batch(b) is False
    assert mirror.seq == 4 and not mirror.resyncing and mirror.gaps == 0
    assert_mirrors(mirror.tree, cache)


def test_gap_resyncs_from_a_snapshot_with_batches_after_it():
    alloc, cache, pub, batches = _published(5)
    mirror = ReplicaMirror(0)
    for b in batches[:2]:
        mirror.on_batch(b)
    # batch 3 is lost
    assert mirror.on_batch(batches[3]) is True  # the gap: ask once
    assert mirror.resyncing and mirror.gaps == 1 and mirror.seq == 2
    assert mirror.on_batch(batches[4]) is False  # buffered, no second ask
    snap = pub.snapshot()  # at seq 5, while the replica goes on
    more = []
    for tokens in ([1, 2, 3, 7], [8, 8]):
        put(alloc, cache, tokens)
        more.append(pub.batch())
    cache.evict(3)
    more.append(pub.batch())
    for b in more:
        assert mirror.on_batch(b) is False
    assert mirror.match([1, 2]) == 2  # the stale tree still answers
    assert mirror.on_snapshot(snap) is False
    assert not mirror.resyncing and mirror.seq == 8 and mirror.resyncs == 1
    assert_mirrors(mirror.tree, cache)


def test_snapshot_older_than_the_buffered_batches():
    alloc, cache = make()
    pub, mirror = Publisher(cache), ReplicaMirror(0)
    snaps, batches = {}, []
    for i in range(6):
        put(alloc, cache, [1, 2, i, i])
        batches.append(pub.batch())
        snaps[pub.seq] = pub.snapshot()
    mirror.on_batch(batches[0])
    mirror.on_batch(batches[1])
    assert mirror.on_batch(batches[4])  # 3 and 4 lost
    mirror.on_batch(batches[5])
    assert mirror.on_snapshot(snaps[1]) is False  # older than what was applied: ignored
    assert mirror.resyncing and mirror.resyncs == 0
    assert mirror.on_snapshot(snaps[2]) is True  # batches 3, 4 still missing: ask again
    assert mirror.resyncing and mirror.gaps == 2 and mirror.seq == 2
    assert mirror.on_snapshot(snaps[4]) is False  # replays 5 and 6
    assert not mirror.resyncing and mirror.seq == 6 and mirror.resyncs == 2
    assert_mirrors(mirror.tree, cache)


def test_first_batch_must_be_seq_1_and_reset_restarts():
    alloc, cache, pub, batches = _published(3)
    mirror = ReplicaMirror(0)
    assert mirror.on_batch(batches[1]) is True  # joined late: resync
    assert mirror.on_snapshot(pub.snapshot()) is False
    assert mirror.seq == 3
    assert_mirrors(mirror.tree, cache)
    mirror.reset()  # the replica restarted
    alloc, cache, pub, batches = _published(2, page_size=4)
    for b in batches:
        assert mirror.on_batch(b) is False
    assert mirror.tree.page_size == 4 and mirror.seq == 2
    assert_mirrors(mirror.tree, cache)


def test_a_batch_that_does_not_fit_starts_a_resync():
    alloc, cache, pub, batches = _published(2)
    mirror = ReplicaMirror(0)
    bad = KVEventBatch(replica=0, seq=1, events=[KVRemoved(nodes=[42])])
    assert mirror.on_batch(bad) is True and mirror.resyncing and mirror.seq == 0
    assert mirror.on_snapshot(pub.snapshot()) is False
    assert_mirrors(mirror.tree, cache)
    with pytest.raises(ValueError, match="replica 3"):
        mirror.on_batch(KVEventBatch(replica=3, seq=3, events=[]))


# ---------------------------------------------- stateful: the mirror keeps up

ALPHABET = st.integers(0, 3)
SALTS = st.sampled_from([None, None, "a", "b"])


class EventTrace(RuleBasedStateMachine):
    """A cache under inserts, matches, locks, evictions and resets; its batches go over the wire
    form to a ReplicaMirror, some lost, some repeated, snapshots delivered late."""

    @initialize(page_size=st.sampled_from([1, 4]), num_slots=st.sampled_from([64, 128]))
    def setup(self, page_size, num_slots):
        self.p = page_size
        self.alloc, self.cache = make(page_size, num_slots)
        self.pub = Publisher(self.cache, replica=1)
        self.mirror = ReplicaMirror(1)
        self.seen: list[list[int]] = []
        self.locked = []
        self.lose_next = False
        self.lost_unseen = False  # a batch was lost, and neither a later one nor a snapshot came
        self.lost_seq = 0
        self.last = None
        self.snap = None

    # -- helpers

    def _publish(self):
        batch = self.pub.batch()
        if batch is None:
            return
        if self.lose_next:
            self.lose_next, self.lost_unseen, self.lost_seq = False, True, batch.seq
            return
        was_resyncing = self.mirror.resyncing
        asked = self.mirror.on_batch(batch)
        assert asked == (not was_resyncing and self.mirror.resyncing)
        assert asked == (self.lost_unseen and not was_resyncing)
        self.lost_unseen, self.last = False, batch

    def _tokens(self, data):
        if self.seen and data.draw(st.booleans(), label="share"):
            stem = data.draw(st.sampled_from(self.seen), label="stem")
            stem = stem[: data.draw(st.integers(0, len(stem)), label="cut")]
        else:
            stem = []
        return stem + data.draw(st.lists(ALPHABET, min_size=1, max_size=24), label="sfx")

    # -- rules

    @rule(data=st.data(), n=st.integers(1, 3))
    def insert(self, data, n):
        """One scheduler step finishing ``n`` requests: one batch."""
        for _ in range(n):
            tokens = self._tokens(data)
            self.seen.append(tokens)
            put(self.alloc, self.cache, tokens, data.draw(SALTS, label="salt"))
        self._publish()

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock):
        tokens = self._tokens(data)
        r = self.cache.match_prefix(tokens, cache_salt=data.draw(SALTS, label="salt"))
        if lock:
            self.cache.lock(r.last_node)
            self.locked.append(r.last_node)
        self._publish()

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locked) - 1), label="idx")
        self.cache.unlock(self.locked.pop(i))

    @rule(n=st.integers(0, 16))
    def evict(self, n):
        self.cache.evict(n)
        self._publish()

    @rule(go=st.integers(0, 5))
    def reset(self, go):
        if go:
            return
        while self.locked:
            self.cache.unlock(self.locked.pop())
        self.cache.reset()
        self._publish()

    @rule()
    def lose_next_batch(self):
        self.lose_next = True

    @precondition(lambda self: self.last is not None)
    @rule()
    def repeat_last_batch(self):
        assert self.mirror.on_batch(self.last) is False

    @precondition(lambda self: self.mirror.resyncing and self.snap is None)
    @rule()
    def take_snapshot(self):
        self.snap = self.pub.snapshot()

    @precondition(lambda self: self.snap is not None)
    @rule()
    def deliver_snapshot(self):
        snap, self.snap = self.snap, None
        asked = self.mirror.on_snapshot(snap)
        assert asked == self.mirror.resyncing
        if self.mirror.seq >= self.lost_seq:  # the snapshot covers the lost batch
            self.lost_unseen = False

    @rule(data=st.data())
    def probe(self, data):
        if not self._in_sync():
            return
        tokens = self._tokens(data)
        salt = data.draw(SALTS, label="salt")
        want = self.cache.peek_prefix(tokens, cache_salt=salt).hit_len
        assert self.mirror.match(tokens, salt) == want
        assert self.mirror.match(np.array(tokens, dtype=np.int64), salt) == want

    # -- invariants

    def _in_sync(self) -> bool:
        return not self.mirror.resyncing and not self.lost_unseen

    @invariant()
    def mirrors_the_cache(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        if not self._in_sync():
            return
        assert self.mirror.seq == self.pub.seq
        assert_mirrors(self.mirror.tree, self.cache)
        for tokens in self.seen[-4:]:
            for salt in (None, "a", "b"):
                want = self.cache.peek_prefix(tokens, cache_salt=salt).hit_len
                assert self.mirror.match(tokens, salt) == want

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        if self.mirror.resyncing or self.lost_unseen:  # unasked, a snapshot brings it forward
            assert self.mirror.on_snapshot(self.pub.snapshot()) is False
        assert self.mirror.seq == self.pub.seq
        assert_mirrors(self.mirror.tree, self.cache)


EventTrace.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEventTrace = EventTrace.TestCase


def test_sliding_window_batches_and_snapshots_carry_the_window():
    """A replica with sliding-window layers: its batches set the mirror's window, ``KVWindow``
    events go over the wire, and the mirror's hits (live and from a snapshot) are the
    cache's, short of a dropped window."""
    alloc = SWASlotAllocator(64, 32)
    cache = SWARadixCache(alloc, window=2, record_events=True)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7]):
        slots = alloc.alloc(len(tokens))
        cached = cache.insert(tokens, slots)
        alloc.free(slots[:cached])
    cache.evict_swa(3)  # tombstones the least recent live stretch
    events = cache.take_events()
    assert any(isinstance(e, KVWindow) and not e.held for e in events)
    batch = decode(encode(KVEventBatch(replica=0, seq=1, events=events, window=cache.window)))
    mirror = ReplicaMirror(0)
    assert mirror.on_batch(batch) is False and mirror.tree.window == 2
    snap = decode(
        encode(KVSnapshot(replica=0, seq=1, events=cache.snapshot_events(), window=cache.window))
    )
    from_snapshot = ReplicaMirror(0)
    from_snapshot.on_snapshot(snap)
    hits = []
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 2, 3, 4], [1, 2]):
        hit = cache.peek_prefix(tokens).hit_len
        assert mirror.match(tokens) == from_snapshot.match(tokens) == hit
        hits.append(hit)
    assert hits != [6, 4, 4, 2], "nothing was tombstoned: the test shows nothing"
    assert MirrorTree().apply_all(events) is None  # a window-less mirror still takes them
