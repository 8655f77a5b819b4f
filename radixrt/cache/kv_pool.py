"""K/V buffers per layer and the request → token table.

Shapes:
- ``k_buffers[layer]``, ``v_buffers[layer]``: ``[num_slots, kv_heads, head_dim]``;
  row ``slot`` holds the K (V) of the token stored in that KV slot. Slot 0
  (the reserved page) absorbs padding writes. All are views of one
  ``[2, num_layers, num_slots, kv_heads, head_dim]`` tensor; on the CPU it is
  backed by huge pages where the kernel allows (``radixrt.memory``).
- ``req_to_token``: int64 ``[max_running, max_context]``; row ``r`` maps the
  positions of the running request that owns row r to its KV slots.
Rows are handed out by ``alloc_row`` and returned by ``free_row``.
"""

from __future__ import annotations

import torch

from radixrt.memory import huge_page_zeros


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_running: int,
        max_context: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (2, num_layers, num_slots, kv_heads, head_dim)
        if self.device.type == "cpu":  # one allocation, in huge pages where the kernel allows
            kv = huge_page_zeros(shape, dtype)
        else:
            kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv = kv  # [2, num_layers, num_slots, kv_heads, head_dim]
        self.k_buffers, self.v_buffers = list(kv[0].unbind()), list(kv[1].unbind())
        self.req_to_token = torch.zeros(
            (max_running, max_context), dtype=torch.int64, device=self.device
        )
        self.max_running = max_running
        self.max_context = max_context
        self._free_rows = list(range(max_running - 1, -1, -1))

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        if not 0 <= row < self.max_running or row in self._free_rows:
            raise ValueError(f"free_row: row {row} is not in use")
        self._free_rows.append(row)

    def store_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ``[n, kv_heads, head_dim]`` into ``slots`` ``[n]`` of one layer."""
        n = slots.numel()
        # index_copy_ on a 2-D view: advanced-index assignment is orders of magnitude slower on CPU.
        self.k_buffers[layer].view(self.num_slots, -1).index_copy_(
            0, slots, k.reshape(n, -1).to(self.dtype)
        )
        self.v_buffers[layer].view(self.num_slots, -1).index_copy_(
            0, slots, v.reshape(n, -1).to(self.dtype)
        )

    def kv_bytes(self) -> int:
        per = self.k_buffers[0].element_size() * self.kv_heads * self.head_dim
        return 2 * self.num_layers * self.num_slots * per

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
