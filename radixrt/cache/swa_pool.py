"""K/V buffers for a model whose layers are full-attention or sliding-window, and the
request -> token table.

Shapes:
- ``k_buffers[layer]``, ``v_buffers[layer]``: ``[num_slots, kv_heads, head_dim]`` for a
  full-attention layer, ``[num_swa_slots, kv_heads, head_dim]`` for a sliding-window one
  (``sliding[layer]``). A full layer's rows are indexed by full slots, a sliding layer's by
  SWA slots (``SWASlotAllocator.translate`` turns the one into the other). Row 0 of each
  absorbs padding writes.
- ``req_to_token``: int64 ``[max_running, max_context]`` of full slots, as in ``KVPool``.

The full layers' buffers are one ``KVPool`` (which also holds ``req_to_token`` and the
rows), the sliding layers' another, so each kind is one allocation.
"""

from __future__ import annotations

import torch

from radixrt.cache.kv_pool import KVPool


class SWAKVPool:
    def __init__(
        self,
        num_slots: int,
        num_swa_slots: int,
        sliding: list[bool],
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_running: int,
        max_context: int,
        device: torch.device | str = "cpu",
        window: int = 0,
    ) -> None:
        """``window``: the sliding layers' window W (what the KV bookkeeping keeps of them)."""
        self.window = window
        self.full_to_swa: torch.Tensor | None = None  # attached by the KV bookkeeping
        if not any(sliding):
            raise ValueError("SWAKVPool: no layer has a sliding window (use KVPool)")
        self.sliding = list(sliding)
        self.num_layers = len(sliding)
        self.num_slots = num_slots
        self.num_swa_slots = num_swa_slots
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        n_swa = sum(self.sliding)
        args = (kv_heads, head_dim, dtype)
        self.full = KVPool(
            num_slots, self.num_layers - n_swa, *args, max_running, max_context, device
        )
        self.swa = KVPool(num_swa_slots, n_swa, *args, 1, 1, device)  # its 1x1 table is unused
        self.device = self.full.device
        self.req_to_token = self.full.req_to_token
        self.max_running, self.max_context = max_running, max_context
        # (pool, index in it) of each model layer
        counts = [0, 0]
        self._where: list[tuple[KVPool, int]] = []
        for s in self.sliding:
            self._where.append((self.swa if s else self.full, counts[s]))
            counts[s] += 1
        self.k_buffers = [pool.k_buffers[i] for pool, i in self._where]
        self.v_buffers = [pool.v_buffers[i] for pool, i in self._where]

    def slots_for(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The rows of ``layer``'s buffers that hold the tokens of full slots ``slots``: the
        slots themselves for a full layer, their SWA slots (``full_to_swa``, which the KV
        bookkeeping attaches: ``SWASlotAllocator.full_to_swa``) for a sliding one."""
        if not self.sliding[layer]:
            return slots
        return self.full_to_swa[slots.cpu()].to(slots.device)

    @property
    def free_rows(self) -> int:
        return self.full.free_rows

    def alloc_row(self) -> int | None:
        return self.full.alloc_row()

    def free_row(self, row: int) -> None:
        self.full.free_row(row)

    def store_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ``[n, kv_heads, head_dim]`` into rows ``slots`` ``[n]`` of one layer:
        full slots for a full layer, SWA slots for a sliding one."""
        pool, i = self._where[layer]
        pool.store_kv(i, slots, k, v)

    def kv_bytes(self) -> int:
        n_swa = sum(self.sliding)
        args = (self.kv_heads, self.head_dim, self.dtype)
        full = KVPool.bytes_per_slot(self.num_layers - n_swa, *args) * self.num_slots
        return full + KVPool.bytes_per_slot(n_swa, *args) * self.num_swa_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one slot of a pool with ``num_layers`` layers (full or sliding)."""
        return KVPool.bytes_per_slot(num_layers, kv_heads, head_dim, dtype)
