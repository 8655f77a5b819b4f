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
from collections.abc import Iterator
from contextlib import contextmanager
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
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T], slots receiving the new K/V
    req_rows: torch.Tensor  # int64 [B], rows of req_to_token
    seq_lens: list[int]  # [B] KV length after this step
    extend_lens: list[int]  # [B] new tokens per request (all 1 in decode)
    # Which token positions (indices into T) need logits; default: each request's last.
    logits_indices: torch.Tensor | None = None
    # EXTEND: the first decode_rows requests are running ones computing their next token (a
    # mixed step); a backend may treat them as a decode step's rows.
    decode_rows: int = 0
    attn_backend: AttentionBackend | None = field(default=None, repr=False)  # set by the runner
    attn_metadata: Any = field(default=None, repr=False)  # set by the backend
    # A pool with sliding-window layers (SWAKVPool): the same, over those layers' own slots,
    # and the new tokens' slots there (set by the backend).
    swa_metadata: Any = field(default=None, repr=False)
    swa_out_cache_loc: torch.Tensor | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    def last_token_indices(self) -> torch.Tensor:
        return torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1


class AttentionBackend(ABC):
    """Stores new K/V in the pool and computes attention over the requests' slots."""

    name = "base"  # the attention_backend setting that selects it

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def describe(self) -> str:
        """The backend, and the kernel path it chose where it has several."""
        return self.name

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the per-step index tensors (once per step, shared by all layers)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scaling: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KH, D] → attention output [T, H, D]. ``window``: a query at
        position p attends only keys at positions p - window + 1 .. p (a sliding-window layer;
        None: every key); ``softcap``: scores (after ``scaling``) become softcap·tanh(s/softcap)
        before the softmax (None: as they are). A backend that does not implement one refuses
        it (``unsupported``)."""

    def layer_view(self, layer_id: int, batch: ForwardBatch) -> tuple[Any, torch.Tensor]:
        """(the step's metadata, the new tokens' slots) for ``layer_id``: a sliding-window
        layer of an ``SWAKVPool`` reads and writes its own slots (``swa_metadata``)."""
        sliding = getattr(self.pool, "sliding", None)
        if sliding is not None and sliding[layer_id]:
            if batch.swa_metadata is None:
                raise RuntimeError(
                    "a sliding-window layer's KV slots are not known: the pool's full_to_swa "
                    "is attached by the scheduler's KV bookkeeping (SWAKVManager)"
                )
            return batch.swa_metadata, batch.swa_out_cache_loc
        return batch.attn_metadata, batch.out_cache_loc

    def unsupported(self, window: int | None, softcap: float | None) -> None:
        """Refuses a sliding window or a logit soft-cap, naming it, for a backend without them."""
        for name, value in (("sliding window", window), ("logit soft-capping", softcap)):
            if value is not None:
                raise NotImplementedError(
                    f"the {self.name} attention backend has no {name} ({value}); "
                    "choose another --attention-backend"
                )


# ---- attention inside a compiled model ------------------------------------------------------
# torch.compile traces tensors, not a ForwardBatch with its Python lists, so a compiled model
# reaches attention through one opaque op that finds the step's batch here (the model sets it
# around the compiled call). The op also writes the new K/V into the pool, which the graph
# does not see; nothing can reorder those writes, since each layer's attention input is
# computed from the previous layer's attention output.
_current_batch: ForwardBatch | None = None


@contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[None]:
    """The batch a compiled model's attention reads (one at a time: it does not nest)."""
    global _current_batch
    if _current_batch is not None:
        raise RuntimeError("forward_context is already set: compiled forwards do not nest")
    _current_batch = batch
    try:
        yield
    finally:
        _current_batch = None


@torch.library.custom_op("radixrt::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    scaling: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """``attention`` for a compiled model: window 0 and softcap 0.0 stand for None."""
    batch = _current_batch
    if batch is None:
        raise RuntimeError(
            "radixrt::attention ran outside forward_context (no batch to attend over)"
        )
    return batch.attn_backend.forward(
        q, k, v, layer_id, batch, scaling, window or None, softcap or None
    )


@_attention_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    scaling: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch | None,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The layer's attention (``AttentionBackend.forward``): straight to the batch's backend,
    or (batch None: inside a compiled model) through the ``radixrt::attention`` op."""
    if batch is None:
        return _attention_op(q, k, v, layer_id, scaling, window or 0, softcap or 0.0)
    return batch.attn_backend.forward(q, k, v, layer_id, batch, scaling, window, softcap)
