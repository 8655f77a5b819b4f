"""KV slots for a model with sliding-window layers: a full pool, an SWA pool, and a
translation between them.

Contract:
- Two free lists (``KVSlotAllocator``, page_size 1; slot 0 of each is reserved, padding
  writes go there). A *full slot* names a token's KV in the full-attention layers and is
  what ``req_to_token`` and the radix tree hold, as with the plain cache. An *SWA slot*
  holds the token's KV in the sliding-window layers.
- ``full_to_swa[s]`` is the SWA slot of the token whose full slot is ``s``, or 0 when it
  has none (``s`` is free, or the token's SWA part was released). The nonzero entries are
  distinct, and an SWA slot is in use exactly when one full slot in use maps to it, so
  the full pool's owners (free list, tree node, running request) partition the SWA pool
  too.
- ``alloc(n)`` takes n slots of each pool and pairs them, or takes nothing and returns
  None. ``free(full)`` returns full slots with whatever SWA slots they still hold;
  ``free_swa(full)`` returns only the SWA part, and each slot given must hold one;
  ``adopt_swa(dst, src)`` moves the SWA slots of ``src`` to ``dst`` (a tree node taking a
  request's SWA KV of the same tokens).
- ``available``, ``capacity``, ``num_slots``, ``page_size``, ``is_free`` and ``free_slots``
  are the full pool's, as ``KVSlotAllocator`` spells them, so ``RadixCache`` and
  ``check_slot_partition`` take this allocator as they take that one; the SWA pool's are
  ``swa_available``, ``swa_capacity``, ``num_swa_slots``, ``swa_free_slots``.
- A bad free (free, reserved, out of range, released twice) raises ``ValueError`` and
  changes nothing. Slots come back as int64 CPU tensors; every method also takes int
  tensors on any device and int numpy arrays.
"""

from __future__ import annotations

import numpy as np
import torch

from radixrt.cache.allocator import KVSlotAllocator

_INT64 = np.dtype(np.int64)


def _slots_np(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """1-D int64 numpy array of slot ids (a view where possible), read on the CPU."""
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().cpu().numpy()
    slots = slots.reshape(-1)
    return slots if slots.dtype == _INT64 else slots.astype(np.int64)


class SWASlotAllocator:
    """Pairs each full slot handed out with an SWA slot until its SWA part is released."""

    def __init__(
        self, num_slots: int, num_swa_slots: int, page_size: int = 1, *, debug: bool = False
    ) -> None:
        if page_size != 1:
            raise ValueError(
                f"the sliding-window KV cache supports page_size 1 only, not {page_size}"
            )
        self.full = KVSlotAllocator(num_slots, 1, debug=debug)
        self.swa = KVSlotAllocator(num_swa_slots, 1, debug=debug)
        self.page_size = 1
        self.num_slots = num_slots
        self.num_swa_slots = num_swa_slots
        self._map = np.zeros(num_slots, dtype=np.int64)  # full slot -> SWA slot, 0: none
        self.full_to_swa = torch.from_numpy(self._map)  # the same memory, read-only for callers

    @property
    def capacity(self) -> int:
        return self.full.capacity

    @property
    def available(self) -> int:
        return self.full.available

    @property
    def swa_capacity(self) -> int:
        return self.swa.capacity

    @property
    def swa_available(self) -> int:
        return self.swa.available

    def clear(self) -> None:
        """Every slot of both pools back to its free list (forgets all owners)."""
        self.full.clear()
        self.swa.clear()
        self._map[:] = 0

    def alloc(self, n: int) -> torch.Tensor | None:
        """n full slots, each paired with a fresh SWA slot; None (nothing taken) if either pool
        has fewer than n free."""
        if n > self.swa.available:
            return None
        full = self.full.alloc(n)
        if full is None:
            return None
        self._map[full.numpy()] = self.swa.alloc(n).numpy()
        return full

    def alloc_extend(self, n: int, last_slot: int) -> torch.Tensor | None:
        """``alloc(n)`` (with page_size 1 a request's slots need not continue a page)."""
        return self.alloc(n)

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return full slots, and the SWA slots those still hold, to their free lists."""
        full = _slots_np(slots)
        self.full.free(full)  # checks every slot first: a bad free raises and changes nothing
        swa = self._map[full]
        self._map[full] = 0
        held = swa[swa != 0]
        if held.size:
            self.swa.free(held)

    def free_swa(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return the SWA slots of these full slots; their full slots stay where they are."""
        full = _slots_np(slots)
        swa = self._map[full]
        if not swa.all():
            bad = full[swa == 0][:8].tolist()
            raise ValueError(f"free_swa: full slots {bad} hold no SWA slot (released already?)")
        self.swa.free(swa)
        self._map[full] = 0

    def adopt_swa(self, dst: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
        """Move the SWA slot of each ``src[i]`` to ``dst[i]`` (which must hold none)."""
        dst, src = _slots_np(dst), _slots_np(src)
        if dst.shape != src.shape:
            raise ValueError(f"adopt_swa: {dst.size} destinations for {src.size} sources")
        if self._map[dst].any() or not self._map[src].all():
            raise ValueError("adopt_swa: a destination holds an SWA slot or a source holds none")
        if self.full.is_free(torch.from_numpy(dst)).any():
            raise ValueError("adopt_swa: a destination full slot is free")
        swa = self._map[src]
        self._map[src] = 0
        self._map[dst] = swa

    def translate(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The SWA slot of each full slot (0 where it holds none), an int64 CPU tensor."""
        return torch.from_numpy(self._map[_slots_np(slots)])

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each full slot is on the full pool's free list."""
        return self.full.is_free(slots)

    def free_slots(self) -> torch.Tensor:
        """Every free full slot (for integrity checks)."""
        return self.full.free_slots()

    def swa_free_slots(self) -> torch.Tensor:
        """Every free SWA slot (for integrity checks)."""
        return self.swa.free_slots()

    def check_integrity(self) -> None:
        """Both free lists, and the translation: free full slots map to nothing, and the SWA
        slots in use are exactly the distinct targets of full slots in use."""
        self.full.check_integrity()
        self.swa.check_integrity()
        m = self._map
        assert m[0] == 0, "the reserved full slot maps to an SWA slot"
        assert not m[self.full.free_slots().numpy()].any(), "a free full slot maps to an SWA slot"
        targets = m[m != 0]
        assert targets.size == np.unique(targets).size, "two full slots map to one SWA slot"
        if targets.size:
            assert targets.min() >= 1 and targets.max() < self.num_swa_slots, (
                "a full slot maps outside the SWA pool"
            )
            assert not self.swa.is_free(torch.from_numpy(targets)).any(), (
                "a full slot maps to a free SWA slot"
            )
        in_use = self.swa.capacity - self.swa.available
        assert targets.size == in_use, (
            f"{in_use} SWA slots in use but {targets.size} mapped (leaked SWA slots)"
        )
