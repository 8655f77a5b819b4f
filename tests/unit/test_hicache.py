"""The tiers below the KV pool (no model): KVManager + HierarchicalCache + StorageTier.

A fake forward writes each position's KV as a function of its whole prefix and salt, so a
load from any tier can be checked against what a recompute would write.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixrt.cache import KVPool
from radixrt.cache.hicache import WRITE_POLICIES, HierarchicalCache, block_keys, block_tokens
from radixrt.cache.storage import StorageTier
from radixrt.sampling import SamplingParams
from radixrt.scheduler.kv import KVManager
from radixrt.scheduler.req import Req

LAYERS, HEADS, DIM = 2, 1, 4
FINGERPRINT = b"m" * 16
_STEP = torch.arange(2 * LAYERS * HEADS * DIM, dtype=torch.float32).view(2, LAYERS, HEADS, DIM)


def kv_of(tokens: list[int], salt: str | None, i: int) -> torch.Tensor:
    """The KV a forward writes at position i: [2, layers, heads, dim], from tokens[:i + 1]."""
    h = hashlib.blake2b(repr((salt, tokens[: i + 1])).encode(), digest_size=3).digest()
    return _STEP + float(int.from_bytes(h, "little"))


def make_pool(page: int, usable: int = 96) -> KVPool:
    return KVPool((usable // page + 1) * page, LAYERS, HEADS, DIM, torch.float32, 4, 128)


def block_file_bytes(page: int) -> int:
    return block_tokens(page) * KVPool.bytes_per_slot(LAYERS, HEADS, DIM, torch.float32)


def make_storage(root, page: int, blocks: int, fingerprint: bytes = FINGERPRINT) -> StorageTier:
    block_bytes = block_file_bytes(page)
    limit = blocks * (block_bytes + 128)  # room for ``blocks`` files with their headers
    return StorageTier(root, limit, fingerprint, block_bytes, torch.float32)


class Hit(NamedTuple):
    prefix_len: int  # cached at admission (the device's hit and what was loaded)
    loaded_tokens: tuple[int, int]  # of them, from (host, storage)


class Harness:
    """KVManager over a small pool with tiers, driven as the scheduler drives it."""

    def __init__(
        self,
        page: int,
        policy: str,
        host_blocks: int,
        storage: StorageTier | None,
        pool_tokens: int = 96,
    ):
        self.pool = make_pool(page, pool_tokens)
        self.hicache = HierarchicalCache(self.pool, page, host_blocks, policy, storage)
        self.kv = KVManager(self.pool, page, False, "lru", self.hicache)
        self.count = 0

    def admit(self, tokens: list[int], salt: str | None = None) -> Req | None:
        """Admit, check the cached prefix's KV, compute the rest; None if it did not fit."""
        self.count += 1
        req = Req(str(self.count), tokens, SamplingParams(max_new_tokens=2, cache_salt=salt))
        if not self.kv.admit(req):
            return None
        self.check_kv(req, req.prefix_len)
        self.hit = Hit(req.prefix_len, req.loaded_tokens)
        n = req.fill_len - req.kv_len
        slots = self.kv.alloc(req, n)
        if slots is None:
            self.kv.release(req)
            return None
        for j, slot in enumerate(slots.tolist()):
            self.pool.kv[:, :, slot] = kv_of(tokens, salt, req.kv_len + j)
        req.kv_len = req.fill_len
        self.kv.cache_computed(req)
        return req

    def check_kv(self, req: Req, n: int) -> None:
        slots = self.pool.req_to_token[req.row, :n].tolist()
        for i, slot in enumerate(slots):
            want = kv_of(req.prompt_ids, req.params.cache_salt, i)
            assert torch.equal(self.pool.kv[:, :, slot], want), f"position {i} has wrong KV"

    def serve(self, tokens: list[int], salt: str | None = None) -> Hit:
        """Admit, compute and finish a request; what it found cached."""
        req = self.admit(tokens, salt)
        assert req is not None
        self.kv.release(req)
        return self.hit


# ------------------------------------------------------------------ loads


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_an_evicted_prefix_loads_from_host_then_storage(tmp_path, page, policy):
    h = Harness(page, policy, host_blocks=8, storage=make_storage(tmp_path, page, 16))
    tokens = list(range(10, 60))  # 50 tokens: three whole blocks of 16
    first = h.serve(tokens)
    assert first.loaded_tokens == (0, 0)
    h.kv.tree.evict(10**9)  # the device forgets it (write_back writes it down here)
    again = h.serve(tokens + [1, 2])
    assert again.prefix_len == 48 and again.loaded_tokens == (48, 0)
    h.kv.tree.evict(10**9)
    h.hicache.clear_host()
    h.hicache.storage.flush()
    third = h.serve(tokens + [3])  # write_back: the host blocks were dropped, never evicted
    want = 48 if policy == "write_through" else 0
    assert third.prefix_len == want and third.loaded_tokens == (0, want)
    h.kv.check(idle=True)
    stats = h.hicache.get_stats()
    assert stats["hicache_host_hit_tokens"] == 48
    h.hicache.close()


def test_write_back_sends_what_the_host_tier_cannot_keep_to_storage(tmp_path):
    h = Harness(1, "write_back", host_blocks=1, storage=make_storage(tmp_path, 1, 8))
    tokens = list(range(300, 350))
    h.serve(tokens)
    h.hicache.storage.flush()
    assert h.hicache.storage.get_stats()["blocks"] == 0  # nothing written before eviction
    h.kv.tree.evict(10**9)
    h.serve(list(range(400, 420)))  # evicted in turn: its block pushes the host's to storage
    h.kv.tree.evict(10**9)
    h.hicache.storage.flush()
    req = h.serve(tokens)
    assert req.prefix_len == 48 and sum(req.loaded_tokens) == 48 and req.loaded_tokens[1] >= 32
    h.kv.check(idle=True)
    h.hicache.close()


def test_a_waiting_request_has_its_blocks_read_ahead(tmp_path):
    h = Harness(1, "write_through", host_blocks=8, storage=make_storage(tmp_path, 1, 16))
    tokens = list(range(500, 550))
    h.serve(tokens)
    h.kv.tree.evict(10**9)
    h.hicache.clear_host()
    storage = h.hicache.storage
    storage.flush()
    h.kv.prefetch(Req("ahead", tokens + [1], SamplingParams(max_new_tokens=2)))
    storage.flush()
    assert storage.get_stats()["prefetched_blocks"] == 3
    for path in storage.dir.glob("*.kv"):  # from now on only what was read ahead can serve
        path.unlink()
    assert h.serve(tokens + [1]) == (48, (0, 48))
    h.kv.check(idle=True)
    h.hicache.close()


def test_match_below_reports_each_tier_and_changes_nothing(tmp_path):
    h = Harness(1, "write_through", host_blocks=2, storage=make_storage(tmp_path, 1, 16))
    tokens = list(range(600, 650))  # three blocks; the host tier has room for the first two
    h.serve(tokens)
    h.kv.tree.evict(10**9)
    h.hicache.storage.flush()
    ids = torch.tensor(tokens + [1]).numpy()
    order = list(h.hicache.host.index)
    match = h.hicache.match_below(ids, 0, 50, None)
    assert (match.start, match.end, match.host_tokens, match.storage_tokens) == (0, 48, 32, 16)
    assert [tier for _, tier in match.blocks] == ["host", "host", "storage"]
    assert list(h.hicache.host.index) == order and not h.hicache.host.pins
    assert h.hicache.match_below(ids, 16, 50, None)[:4] == (16, 48, 16, 16)
    assert h.hicache.match_below(ids, 0, 50, "other") is None
    assert h.serve(tokens + [1]) == (48, (32, 16))
    h.hicache.close()


def test_a_device_hit_inside_a_block_continues_from_below(tmp_path):
    h = Harness(1, "write_through", host_blocks=8, storage=None)
    tokens = list(range(100, 150))
    h.serve(tokens)
    h.kv.tree.evict(10**9)
    h.serve(tokens[:20])  # the device holds 20 tokens: block 1 is partly on the device
    req = h.admit(tokens + [7])
    assert h.hit == (48, (28, 0))
    h.kv.release(req)
    h.kv.check(idle=True)


def test_salts_never_share_blocks(tmp_path):
    h = Harness(1, "write_through", host_blocks=8, storage=make_storage(tmp_path, 1, 8))
    tokens = list(range(40))
    h.serve(tokens, salt="alice")
    h.kv.tree.evict(10**9)
    assert h.serve(tokens, salt="bob").prefix_len == 0
    assert h.serve(tokens).prefix_len == 0
    assert block_keys(torch.arange(32).numpy(), 2, 16, "a") != block_keys(
        torch.arange(32).numpy(), 2, 16, "b"
    )
    h.hicache.close()


def test_storage_survives_a_restart(tmp_path):
    h = Harness(4, "write_through", host_blocks=4, storage=make_storage(tmp_path, 4, 16))
    tokens = list(range(200, 245))
    h.serve(tokens)
    h.hicache.close()
    fresh = Harness(4, "write_through", host_blocks=4, storage=make_storage(tmp_path, 4, 16))
    req = fresh.serve(tokens)
    assert req.loaded_tokens == (0, 32)  # 44 tokens may come from below: two whole blocks
    other = Harness(4, "write_through", 4, make_storage(tmp_path, 4, 16, fingerprint=b"x" * 16))
    assert other.serve(tokens).loaded_tokens == (0, 0)  # another model's files are not read
    fresh.hicache.close()
    other.hicache.close()


# ------------------------------------------------------------------ storage faults


def stored(tmp_path, page: int = 1) -> tuple[StorageTier, bytes, Path]:
    """A storage tier holding one written block; its key and file."""
    storage = make_storage(tmp_path, page, 8)
    key = b"k" * 16
    storage.write(key, torch.arange(block_file_bytes(page) // 4, dtype=torch.float32))
    storage.flush()
    return storage, key, storage._path(key)


def test_a_block_reads_back(tmp_path):
    storage, key, path = stored(tmp_path)
    assert path.is_file()
    data = storage.read(key)
    assert torch.equal(data, torch.arange(data.numel(), dtype=torch.float32))
    storage.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, caplog, damage):
    storage, key, path = stored(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = b""
    else:  # another model's file under this model's name
        raw[6:22] = b"z" * 16
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="radixrt.hicache"):
        assert storage.read(key) is None
    assert not path.exists() and not storage.contains(key)
    assert storage.get_stats()["corrupt_blocks"] == 1
    assert "recomputing" in caplog.text
    storage.check()
    storage.close()


def test_a_torn_write_leaves_nothing_that_is_read(tmp_path):
    storage, key, path = stored(tmp_path)
    storage.close()
    dead = _dead_pid()
    torn = path.with_name(f"{'ab' * 16}.kv.{dead}.tmp")
    torn.write_bytes(path.read_bytes()[:100])
    again = make_storage(tmp_path, 1, 8)
    assert not torn.exists()
    assert again.contains(key) and not again.contains(bytes.fromhex("ab" * 16))
    again.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_size_limit_deletes_the_least_recently_used(tmp_path):
    storage = make_storage(tmp_path, 1, 3)
    data = torch.zeros(block_file_bytes(1) // 4)
    keys = [bytes([i]) * 16 for i in range(5)]
    for key in keys[:3]:
        storage.write(key, data)
    storage.flush()
    assert storage.read(keys[0]) is not None  # now the most recently used
    for key in keys[3:]:
        storage.write(key, data)
    storage.flush()
    assert [storage.contains(k) for k in keys] == [True, False, False, True, True]
    assert len(list(storage.dir.glob("*.kv"))) == 3
    storage.check()
    storage.close()


def test_a_removed_directory_is_made_again(tmp_path):
    storage, key, path = stored(tmp_path)
    shutil.rmtree(tmp_path)
    assert storage.read(key) is None
    storage.write(b"n" * 16, torch.zeros(block_file_bytes(1) // 4))
    storage.flush()
    assert storage.read(b"n" * 16) is not None
    storage.check()
    storage.close()


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` made read-only (chmod, and for root chattr +i); skips where neither holds."""
    os.chmod(path, 0o555)
    immutable = False
    if os.access(path, os.W_OK) or os.geteuid() == 0:
        immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    try:
        probe = path / "probe"
        try:
            probe.touch()
            probe.unlink()
            pytest.skip("cannot make a directory read-only here")
        except OSError:
            pass
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=False)
        os.chmod(path, 0o755)


def test_a_read_only_directory_drops_writes_and_keeps_serving(tmp_path, caplog):
    storage, key, _ = stored(tmp_path)
    with read_only(storage.dir), caplog.at_level(logging.WARNING, logger="radixrt.hicache"):
        for i in range(3):
            storage.write(bytes([i]) * 16, torch.zeros(block_file_bytes(1) // 4))
        storage.flush()
        assert storage.get_stats()["write_errors"] == 3
        assert caplog.text.count("cannot write") == 1  # logged once
        assert storage.read(key) is not None  # what is there still reads
    storage.check()
    storage.close()


def test_a_full_disk_drops_writes_and_keeps_serving(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a small file system here")
    try:
        storage = StorageTier(mount, 10**9, FINGERPRINT, 16 << 10, torch.float32)
        for i in range(8):  # 8 x 16 KiB do not fit in 64 KiB
            storage.write(bytes([i]) * 16, torch.zeros(4 << 10))
        storage.flush()
        stats = storage.get_stats()
        assert stats["write_errors"] >= 1 and stats["blocks"] >= 1
        assert all(storage.read(bytes([i]) * 16) is not None for i in range(stats["blocks"]))
        assert not list(storage.dir.glob("*.tmp"))
        storage.check()
        storage.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# ------------------------------------------------------------------ a trace over the tiers

BASES = [[(7 * b + 3 * i) % 23 + 1 for i in range(48)] for b in range(2)]


class TierTrace(RuleBasedStateMachine):
    """Admit / finish / evict / load across tiers: every load brings the right KV, every block
    is in one place per tier and every tier stays within its limit."""

    @initialize(
        page=st.sampled_from([1, 4]),
        policy=st.sampled_from(WRITE_POLICIES),
        host_blocks=st.integers(1, 6),
        storage_blocks=st.integers(0, 6),
    )
    def setup(self, page, policy, host_blocks, storage_blocks):
        self.root = tempfile.mkdtemp(prefix="radixrt-tiers-")
        storage = make_storage(self.root, page, storage_blocks) if storage_blocks else None
        self.h = Harness(page, policy, host_blocks, storage, pool_tokens=64)
        self.running: list[Req] = []
        self.seen: list[tuple[list[int], str | None]] = []
        self.loads = 0

    @rule(
        base=st.integers(0, len(BASES) - 1),
        cut=st.integers(8, 48),
        tail=st.lists(st.integers(30, 40), max_size=4),
        salt=st.sampled_from([None, "a"]),
        keep=st.booleans(),
    )
    def admit(self, base, cut, tail, salt, keep):
        self._run(BASES[base][:cut] + tail, salt, keep)

    @rule(data=st.data(), keep=st.booleans())
    def revisit(self, data, keep):
        """A prompt served before comes back (after evictions, its prefix is below)."""
        if self.seen:
            self._run(*data.draw(st.sampled_from(self.seen)), keep)

    def _run(self, tokens, salt, keep):
        if not self.h.pool.free_rows:
            return
        req = self.h.admit(tokens, salt)
        if req is None:
            return
        self.seen.append((tokens, salt))
        self.loads += sum(self.h.hit.loaded_tokens) > 0
        if keep:
            self.running.append(req)
        else:
            self.h.kv.release(req)

    @rule(data=st.data())
    def finish(self, data):
        if self.running:
            req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
            self.h.kv.release(req)

    @rule(n=st.integers(1, 64))
    def evict(self, n):
        self.h.kv.tree.evict(n)

    @rule()
    def drop_host(self):
        if not self.h.hicache.host.pins:
            self.h.hicache.clear_host()

    @invariant()
    def tiers_hold(self):
        if not hasattr(self, "h"):
            return
        self.h.kv.check(idle=not self.running)
        host = self.h.hicache.host
        assert len(host) <= host.num_blocks
        for req in self.running:
            self.h.check_kv(req, req.kv_len)

    def teardown(self):
        if hasattr(self, "h"):
            self.h.hicache.close()
            shutil.rmtree(self.root, ignore_errors=True)


TierTrace.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTierTrace = TierTrace.TestCase
