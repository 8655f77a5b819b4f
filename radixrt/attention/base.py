"""The attention backend interface and the forward batch it reads.

A ``ForwardBatch`` describes one model step over B requests and T new tokens:
- EXTEND: request b computes ``extend_lens[b]`` new tokens after
  ``prefix_lens[b]`` tokens whose KV is already in the pool;
- DECODE: every request computes exactly one new token.
New K/V are written to ``out_cache_loc`` before attention reads them; request
b's full KV (prefix + new) is ``req_to_token[req_rows[b], :seq_lens[b]]``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from radixrt.cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor      # int64 [T]
    positions: torch.Tensor      # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T], slots receiving the new K/V
    req_rows: torch.Tensor       # int64 [B], rows of req_to_token
    seq_lens: list[int]          # [B] KV length after this step
    extend_lens: list[int]       # [B] new tokens per request (all 1 in decode)
    # Which token positions (indices into T) need logits; default: each request's last.
    logits_indices: torch.Tensor | None = None
    attn_backend: AttentionBackend | None = field(default=None, repr=False)  # set by the runner
    attn_metadata: Any = field(default=None, repr=False)  # set by the backend

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    def last_token_indices(self) -> torch.Tensor:
        return torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1


class AttentionBackend(ABC):
    """Stores new K/V in the pool and computes attention over gathered slots."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the per-step index tensors (once per step, shared by all layers)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scaling: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KH, D] → attention output [T, H, D]."""
