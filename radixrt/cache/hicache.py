"""Tiers below the KV pool: host memory and storage (``enable_hierarchical_cache``).

One tree across tiers. The radix tree (``RadixCache``) holds the prefixes whose KV is in the
device pool. Below it, the host tier (``HostTier``: one preallocated buffer, pinned on a GPU
machine) and the storage tier (``StorageTier``: one file per block in a directory) hold KV in
blocks of ``block_size`` tokens (whole pages), each under a chained key:
``key(j) = H(key(j - 1) || tokens of block j)``, from a namespace root ``H(cache_salt)``. A
block's key so names its whole prefix: the keys of a sequence's blocks are its path through
the tree, continued below the device, and two sequences share exactly the blocks of their
common prefix (as HiCache's storage keys do).

- ``match_below`` reports, changing nothing, how much of a prompt past its device hit the
  tiers hold and where. ``load_prefix`` (admission): after the device hit, the longest run
  of the prompt's next blocks held below (host first, then storage) is read into new device
  slots, and the caller inserts it into the tree; only the rest is computed. The host blocks
  of a load in flight are pinned, so the eviction its own allocation may cause never reuses
  them. ``prefetch`` (for a request left waiting by a step) has the storage tier read its
  blocks ahead, on a thread, while the step's forward runs.
- Writes (``write_policy``): ``write_through`` copies a finished (or retracted) request's
  full blocks down when it leaves (``write_through``), host and storage together;
  ``write_back`` copies the blocks of a node when the device tree evicts it (``evicted``),
  and a block the host tier evicts goes to storage (the rest at ``close``). A block is
  written where it is missing only.
- Each tier has its own LRU order and limit: the host tier a number of blocks, the storage
  tier bytes (``StorageTier``).
- A block is counted where it was found: ``hits`` has the tokens loaded from each tier,
  the bytes read and the seconds loading took.

Nothing wrong is served: every storage file carries the model's fingerprint, its key and a
checksum of its bytes (see ``StorageTier``); a block that fails a check, or cannot be read or
written, is a miss (recomputed), logged once per kind of failure.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from radixrt.cache.kv_pool import KVPool
from radixrt.cache.radix_cache import NamespaceNode, TreeNode
from radixrt.cache.storage import StorageTier

logger = logging.getLogger("radixrt.hicache")

WRITE_POLICIES = ("write_through", "write_back")
MIN_BLOCK_TOKENS = 16  # a lower-tier block: at least this many tokens, whole pages
_KEY_BYTES = 16


def block_tokens(page_size: int) -> int:
    """Tokens per lower-tier block: whole pages, at least ``MIN_BLOCK_TOKENS``."""
    return -(-MIN_BLOCK_TOKENS // page_size) * page_size


def block_keys(tokens: np.ndarray, num_blocks: int, block: int, salt: str | None) -> list[bytes]:
    """The chained keys of the first ``num_blocks`` blocks of ``tokens`` (int64) under ``salt``."""
    key = hashlib.blake2b(
        b"radixrt-kv\0" + (b"" if salt is None else b"salt\0" + salt.encode()),
        digest_size=_KEY_BYTES,
    ).digest()
    raw = np.ascontiguousarray(tokens[: num_blocks * block], dtype=np.int64).tobytes()
    step, keys = block * 8, []
    for j in range(num_blocks):
        key = hashlib.blake2b(key + raw[j * step : (j + 1) * step], digest_size=_KEY_BYTES).digest()
        keys.append(key)
    return keys


class BelowMatch(NamedTuple):
    start: int  # the device hit
    end: int  # positions [start, end) are held below
    host_tokens: int  # of them, in the host tier
    storage_tokens: int  # and only in storage
    base: int  # the first position of blocks[0]
    blocks: list[tuple[bytes, str]]  # (key, "host" or "storage") of each block covering them


class Loaded(NamedTuple):
    end: int  # positions [start, end) now have KV in ``slots``
    slots: torch.Tensor  # int64 [end - start], the new device slots, not yet in the tree
    host_tokens: int  # of them, loaded from the host tier
    storage_tokens: int  # and from storage


class HostTier:
    """Blocks in one host buffer ``[num_blocks, *block_shape]``, LRU order, pins.

    Every block index is either free or held by one key. A pinned key (a load in flight) is
    never evicted.
    """

    def __init__(
        self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> None:
        self.num_blocks = num_blocks
        self.buffer = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self.free = list(range(num_blocks - 1, -1, -1))
        self.pins: Counter[bytes] = Counter()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def touch(self, key: bytes) -> None:
        self.index.move_to_end(key)

    def victims(self, n: int) -> list[bytes]:
        """Up to n least recently used unpinned keys (to evict before taking n free blocks)."""
        need = n - len(self.free)
        out = []
        if need > 0:
            for key in self.index:
                if key not in self.pins:
                    out.append(key)
                    if len(out) == need:
                        break
        return out

    def remove(self, key: bytes) -> None:
        self.free.append(self.index.pop(key))

    def add(self, key: bytes) -> int:
        """Take a free block for ``key`` (the caller fills ``buffer[index]``)."""
        idx = self.free.pop()
        self.index[key] = idx
        return idx

    def check(self, idle: bool) -> None:
        held = list(self.index.values())
        assert len(set(held)) == len(held), "a host block is held by two keys"
        assert not set(held) & set(self.free), "a host block is both free and held"
        assert len(held) + len(self.free) == self.num_blocks, "host blocks leaked"
        assert not idle or not self.pins, f"{len(self.pins)} host blocks pinned at idle"


class HierarchicalCache:
    """The lower tiers of one KV pool (see the module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        page_size: int,
        host_blocks: int,
        write_policy: str = "write_through",
        storage: StorageTier | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}")
        if host_blocks < 1:
            raise ValueError(f"the host tier must hold at least one block, got {host_blocks}")
        self.pool = pool
        self.block = block_tokens(page_size)
        self.page_size = page_size
        self.write_policy = write_policy
        kv = pool.kv  # [2, layers, slots, kv_heads, head_dim]
        self.block_shape = (2, kv.shape[1], self.block, *kv.shape[3:])
        self.block_bytes = int(np.prod(self.block_shape)) * kv.element_size()
        self.host = HostTier(host_blocks, self.block_shape, kv.dtype, pin=kv.is_cuda)
        self.storage = storage
        if storage is not None and storage.block_bytes != self.block_bytes:
            raise ValueError("storage tier block size does not match the KV pool")
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------ loading

    def match_below(
        self, tokens: np.ndarray, start: int, limit: int, salt: str | None
    ) -> BelowMatch | None:
        """How much of ``tokens[start:limit]`` (``start``: the device hit, page-aligned) the
        lower tiers hold as one run, and in which tier; None for nothing. Changes nothing (no
        LRU order, no pins): the lookup that ranks or reports, as ``peek_prefix`` is above."""
        b = self.block
        first, last = start // b, len(tokens) // b  # the whole blocks from the one holding start
        if last <= first or limit <= start:
            return None
        found = self._find(block_keys(tokens, last, b, salt)[first:])
        end = min((first + len(found)) * b, limit) // self.page_size * self.page_size
        if end <= start:
            return None
        found = found[: -(-(end - first * b) // b)]
        host = sum(
            self._span(first * b, i, start, end) for i, (_, t) in enumerate(found) if t == "host"
        )
        return BelowMatch(start, end, host, end - start - host, first * b, found)

    def load_prefix(
        self,
        tokens: np.ndarray,
        start: int,
        limit: int,
        salt: str | None,
        alloc: Callable[[int], torch.Tensor | None],
    ) -> Loaded | None:
        """Load the longest run of ``tokens[start:limit]`` the lower tiers hold (``match_below``)
        into new device slots from ``alloc(n)``; None when they hold nothing of it (or no slots
        were had). Host blocks are pinned from the lookup until their KV is in the pool."""
        match = self.match_below(tokens, start, limit, salt)
        if match is None:
            return None
        pinned = [k for k, tier in match.blocks if tier == "host"]
        self.host.pins.update(pinned)
        try:
            return self._load(match.blocks, match.base, start, match.end, alloc)
        finally:
            self.host.pins.subtract(pinned)
            self.host.pins = +self.host.pins  # drop the zero counts

    def _span(self, base: int, i: int, start: int, end: int) -> int:
        """Positions of [start, end) in the i-th block from ``base``."""
        return min(end, base + (i + 1) * self.block) - max(start, base + i * self.block)

    def prefetch(self, tokens: np.ndarray, start: int, salt: str | None) -> None:
        """Start reading from storage the blocks of ``tokens`` past the device hit ``start``
        that the host tier lacks (a request that will be admitted later: its load then finds
        them read). Stops at the first block held nowhere below."""
        if self.storage is None:
            return
        b = self.block
        first, last = start // b, len(tokens) // b
        if last <= first:
            return
        wanted = []
        for key in block_keys(tokens, last, b, salt)[first:]:
            if key not in self.host:
                if not self.storage.contains(key):
                    break
                wanted.append(key)
        self.storage.prefetch(wanted)

    def _find(self, keys: list[bytes]) -> list[tuple[bytes, str]]:
        """The leading keys held below, each with the tier it will be read from."""
        found = []
        for key in keys:
            if key in self.host:
                found.append((key, "host"))
            elif self.storage is not None and self.storage.contains(key):
                found.append((key, "storage"))
            else:
                break
        return found

    def _load(
        self,
        found: list[tuple[bytes, str]],
        base: int,
        start: int,
        end: int,
        alloc: Callable[[int], torch.Tensor | None],
    ) -> Loaded | None:
        """Read the blocks ``found`` (covering positions from ``base``) and write positions
        [start, end) of them into new slots; a block that fails to read ends the run there."""
        began = time.perf_counter()
        blocks, tiers = [], []
        for key, tier in found:
            data = self._read(key, tier)
            if data is None:
                break
            blocks.append(data)
            tiers.append(tier)
        end = min(end, (base + len(blocks) * self.block) // self.page_size * self.page_size)
        if end <= start:
            return None
        slots = alloc(end - start)
        if slots is None:
            return None
        device_slots = slots.to(self.pool.kv.device)
        for i, data in enumerate(blocks):  # each [2, layers, block, heads, dim]
            lo, hi = max(start, base + i * self.block), min(end, base + (i + 1) * self.block)
            at = lo - base - i * self.block
            self.pool.kv.index_copy_(
                2,
                device_slots[lo - start : hi - start],
                data[:, :, at : at + hi - lo].to(self.pool.kv.device),
            )
        host = sum(self._span(base, i, start, end) for i, t in enumerate(tiers) if t == "host")
        self.stats["host_hit_tokens"] += host
        self.stats["storage_hit_tokens"] += end - start - host
        self.stats["loaded_bytes"] += len(blocks) * self.block_bytes
        self.stats["load_s"] += time.perf_counter() - began
        return Loaded(end, slots, host, end - start - host)

    def _read(self, key: bytes, tier: str) -> torch.Tensor | None:
        """One block's KV (a tensor of ``block_shape``); a storage block is promoted to host."""
        if tier == "host":
            self.host.touch(key)
            return self.host.buffer[self.host.index[key]]
        data = self.storage.read(key)
        if data is None:
            return None
        data = data.view(self.block_shape)
        self._put_host([key], data.unsqueeze(0), to_storage=False)
        return data

    # ------------------------------------------------------------ writing

    def write_through(self, tokens: np.ndarray, slots: torch.Tensor, salt: str | None) -> None:
        """With ``write_through``: copy the full blocks of a sequence leaving the device's
        running set (``tokens[:n]`` in ``slots[:n]``) to the tiers that lack them."""
        if self.write_policy == "write_through":
            self._write(tokens, slots, salt, 0)

    def evicted(self, node: TreeNode) -> None:
        """With ``write_back``: the tree is about to evict ``node`` (a leaf still in the tree):
        copy the blocks that end inside its edge down."""
        if self.write_policy != "write_back":
            return
        runs, slot_runs = [], []
        start = node.num_tokens
        while node._key:
            runs.append(node._key)
            slot_runs.append(node._np)
            node = node.parent
        salt = node.salt if isinstance(node, NamespaceNode) else None
        tokens = np.frombuffer(b"".join(reversed(runs)), dtype=np.int64)
        slots = torch.from_numpy(np.concatenate(slot_runs[::-1]))
        self._write(tokens, slots, salt, len(tokens) - start)

    def _write(self, tokens: np.ndarray, slots: torch.Tensor, salt: str | None, since: int) -> None:
        """Write the full blocks of ``tokens`` that end after position ``since``."""
        b = self.block
        n = min(len(tokens), slots.numel()) // b
        first = since // b
        if n <= first:
            return
        keys = block_keys(tokens, n, b, salt)
        new = [j for j in range(first, n) if keys[j] not in self.host]
        for j in range(first, n):
            if keys[j] in self.host:
                self.host.touch(keys[j])
        if not new:
            return
        index = torch.cat([slots[j * b : (j + 1) * b] for j in new]).to(self.pool.kv.device)
        # [2, layers, len(new) * block, heads, dim] -> [len(new), 2, layers, block, heads, dim]
        data = self.pool.kv.index_select(2, index).unflatten(2, (len(new), b)).movedim(2, 0)
        self._put_host([keys[j] for j in new], data, to_storage=True)

    def _put_host(self, keys: list[bytes], data: torch.Tensor, to_storage: bool) -> None:
        """Put blocks (``data[i]`` under ``keys[i]``) in the host tier, evicting its least
        recently used unpinned blocks; with ``write_back`` an evicted block, or one that finds
        no room, goes to storage; with ``write_through`` and ``to_storage`` every block does."""
        for victim in self.host.victims(len(keys)):
            if self.write_policy == "write_back":
                self._put_storage(victim, self.host.buffer[self.host.index[victim]])
            self.host.remove(victim)
            self.stats["host_evicted_blocks"] += 1
        kept = min(len(keys), len(self.host.free))
        if kept:
            dst = torch.tensor([self.host.add(key) for key in keys[:kept]], dtype=torch.int64)
            self.host.buffer.index_copy_(0, dst, data[:kept].to(self.host.buffer.device))
            self.stats["host_written_blocks"] += kept
        write_through = to_storage and self.write_policy == "write_through"
        for i in range(0 if write_through else kept, len(keys)):
            self._put_storage(keys[i], data[i])

    def _put_storage(self, key: bytes, data: torch.Tensor) -> None:
        if self.storage is not None and not self.storage.contains(key):
            self.storage.write(key, data.cpu())

    # ------------------------------------------------------------ misc

    def close(self) -> None:
        """Flush what storage lacks (``write_back``'s host blocks) and stop its writer."""
        if self.storage is None:
            return
        if self.write_policy == "write_back":
            for key, idx in list(self.host.index.items()):
                self._put_storage(key, self.host.buffer[idx])
        self.storage.close()

    def clear_host(self) -> None:
        """Drop every host block (``flush_cache``); storage keeps its files."""
        for key in list(self.host.index):
            self.host.remove(key)

    def check(self, idle: bool) -> None:
        """Assert each tier's bookkeeping (and, at idle, that no load is in flight)."""
        self.host.check(idle)
        if self.storage is not None:
            self.storage.check()

    def get_stats(self) -> dict[str, float]:
        counters = ("host_hit_tokens", "storage_hit_tokens", "loaded_bytes", "load_s")
        s = {f"hicache_{k}": self.stats[k] for k in counters}
        s.update({f"hicache_{k}": v for k, v in self.stats.items()})
        s["hicache_host_blocks"] = len(self.host)
        s["hicache_host_capacity_blocks"] = self.host.num_blocks
        s["hicache_block_tokens"] = self.block
        if self.storage is not None:
            s.update({f"hicache_storage_{k}": v for k, v in self.storage.get_stats().items()})
        return s


GB = 10**9


def make_hierarchical_cache(
    config, pool: KVPool, model_fingerprint: Callable[..., bytes]
) -> HierarchicalCache | None:
    """The lower tiers ``config`` (an ``EngineConfig``) asks for over ``pool``; None without
    ``enable_hierarchical_cache``. ``model_fingerprint(*layout)`` names the model's KV laid out
    as ``layout`` (dtype, block tokens, layers, KV heads, head dim): the caller's, as the cache
    knows no model. It is called once, and only where a storage tier is configured (it may read
    every weight file)."""
    if not config.enable_hierarchical_cache:
        return None
    block = block_tokens(config.page_size)
    block_bytes = block * KVPool.bytes_per_slot(
        pool.num_layers, pool.kv_heads, pool.head_dim, pool.dtype
    )
    host_bytes = config.hicache_size * GB or config.hicache_ratio * pool.kv_bytes()
    storage = None
    if config.hicache_storage_dir is not None:
        layout = (str(pool.dtype), block, pool.num_layers, pool.kv_heads, pool.head_dim)
        storage = StorageTier(
            config.hicache_storage_dir,
            int(config.hicache_storage_size * GB),
            model_fingerprint(*layout),
            block_bytes,
            pool.dtype,
        )
    return HierarchicalCache(
        pool,
        config.page_size,
        max(1, int(host_bytes // block_bytes)),
        config.hicache_write_policy,
        storage,
    )
