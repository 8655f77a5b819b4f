"""Attention through the Triton kernels of ``radixrt_kernels`` (the default on CUDA).

Once per step, ``init_forward_metadata`` builds the index tensors on the
pool's device, sized from the batch's host-side lengths (no device sync), into
a metadata record (``plan``) that runs its kernel (``run``):
- EXTEND: ``qo_indptr [B+1]`` over the new tokens; ``kv_indptr [B+1]`` and
  ``kv_indices`` over each request's cached prefix,
  ``req_to_token[row_b, :prefix_len_b]``. The new tokens' K/V are read
  straight from the layer's k/v, so the prefix is all the kernel gathers.
- DECODE: ``kv_indptr``/``kv_indices`` over each full sequence
  ``req_to_token[row_b, :seq_len_b]`` (the new token's K/V is stored before
  attention reads it); ``num_kv_splits`` from the batch shape; one stage-1
  workspace shared by every layer, allocated by the first (H is known then).
With ``deterministic=True`` (``--enable-deterministic-inference``) both modes
run ``deterministic_attention``: a query's output bits do not depend on the
batch, the cache hit or decode vs extend. Its extend indexes each whole
sequence ``req_to_token[row_b, :seq_len_b]`` (the new K/V are stored first);
its decode splits keys at fixed offsets, the split axis sized from the longest
sequence. Its records subclass the split-count ones: same planning, other kernel.
Per layer, ``forward`` stores the new K/V with ``store_kv`` and runs the step's
record with the layer's sliding window and logit soft cap (the kernels read no slot
before a token's window; in deterministic mode the fixed splits stay where they are).
On CPU it works only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
import), which is slow and meant for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt_kernels.triton import INTERPRET
from radixrt_kernels.triton.decode_attention import (
    DecodeWorkspace,
    choose_num_kv_splits,
    decode_attention,
    workspace_for,
)
from radixrt_kernels.triton.deterministic_attention import (
    deterministic_decode_attention,
    deterministic_extend_attention,
    fixed_split_workspace,
)
from radixrt_kernels.triton.extend_attention import extend_attention
from radixrt_kernels.triton.store_kv import store_kv

# Split sizing under the interpreter: a pretend 4-SM device and short splits, so that the
# short sequences of CPU tests still take several splits.
INTERPRETER_SMS = 4
INTERPRETER_MIN_SPLIT = 16
MIN_SPLIT_LEN = 256


@dataclass
class _ExtendMeta:
    """Split-count extend: kv_indices index each cached prefix; the kernel reads the new
    tokens' K/V from the layer's k, v."""

    qo_indptr: torch.Tensor  # int64 [B + 1] over the T new tokens
    kv_indptr: torch.Tensor  # int64 [B + 1] over kv_indices
    kv_indices: torch.Tensor  # int64 [sum of gathered_lens]: each request's slots
    max_extend_len: int
    attend: ClassVar[Callable[..., torch.Tensor]] = staticmethod(extend_attention)

    @staticmethod
    def gathered_lens(batch: ForwardBatch) -> list[int]:
        return batch.prefix_lens

    @classmethod
    def plan(cls, table: torch.Tensor, batch: ForwardBatch) -> _ExtendMeta:
        kv_indptr, kv_indices = _kv_index(table, batch.req_rows, cls.gathered_lens(batch))
        qo_indptr = _indptr(batch.extend_lens, table.device)
        return cls(qo_indptr, kv_indptr, kv_indices, max(batch.extend_lens))

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        scaling: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        o = q.new_empty(q.shape)
        index = (self.qo_indptr, self.kv_indptr, self.kv_indices)
        return self.attend(
            q, k, v, o, k_buf, v_buf, *index, scaling, self.max_extend_len, None, window, softcap
        )


class _FixedExtendMeta(_ExtendMeta):
    """Fixed-split extend: kv_indices index each whole sequence (the new K/V are stored
    first), so the cache hit does not show in the arithmetic."""

    @staticmethod
    def gathered_lens(batch: ForwardBatch) -> list[int]:
        return batch.seq_lens

    @staticmethod
    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        *rest: object,
    ) -> torch.Tensor:
        """``extend_attention``'s arguments; the new K/V (k, v) are read from the buffers."""
        return deterministic_extend_attention(q, o, k_buf, v_buf, *rest)


@dataclass
class _DecodeMeta:
    """Split-count decode over each whole sequence; ``split_arg`` is ``num_kv_splits``,
    chosen from the batch shape."""

    kv_indptr: torch.Tensor  # int64 [B + 1]
    kv_indices: torch.Tensor  # int64 [sum of seq lens]: slots of each whole sequence
    split_arg: int  # the kernel's split argument (after sm_scale), which sizes the workspace
    workspace: DecodeWorkspace | None = None  # allocated by the first layer
    attend: ClassVar[Callable[..., torch.Tensor]] = staticmethod(decode_attention)
    new_workspace: ClassVar[Callable[..., DecodeWorkspace]] = staticmethod(workspace_for)

    @classmethod
    def plan(cls, table: torch.Tensor, batch: ForwardBatch, split_arg: int) -> _DecodeMeta:
        return cls(*_kv_index(table, batch.req_rows, batch.seq_lens), split_arg)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        scaling: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        if self.workspace is None:
            self.workspace = self.new_workspace(q, self.split_arg)
        o = q.new_empty(q.shape)
        index = (self.kv_indptr, self.kv_indices)
        split, ws = self.split_arg, self.workspace
        return self.attend(q, k_buf, v_buf, o, *index, scaling, split, ws, None, window, softcap)


class _FixedDecodeMeta(_DecodeMeta):
    """Fixed-split decode; ``split_arg`` is ``max_seq_len``, which sizes the split axis and
    moves no split boundary."""

    attend = staticmethod(deterministic_decode_attention)
    new_workspace = staticmethod(fixed_split_workspace)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, pool: KVPool, deterministic: bool = False) -> None:
        super().__init__(pool)
        self.deterministic = deterministic
        if pool.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
            self.min_split_len = MIN_SPLIT_LEN
        elif INTERPRET:
            self.num_sms, self.min_split_len = INTERPRETER_SMS, INTERPRETER_MIN_SPLIT
        else:
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device, got {pool.device} "
                "(on CPU set TRITON_INTERPRET=1 before import, or use 'torch')"
            )
        if deterministic:
            self._extend, self._decode = _FixedExtendMeta, _FixedDecodeMeta
            self._split_arg = _longest_sequence
        else:
            self._extend, self._decode = _ExtendMeta, _DecodeMeta
            self._split_arg = self._num_kv_splits

    def describe(self) -> str:
        return f"{self.name} (deterministic: fixed KV splits)" if self.deterministic else self.name

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.pool.req_to_token
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = self._decode.plan(table, batch, self._split_arg(batch))
        else:
            batch.attn_metadata = self._extend.plan(table, batch)

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
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        store_kv(k, v, k_buf, v_buf, batch.out_cache_loc)
        return batch.attn_metadata.run(q, k, v, k_buf, v_buf, scaling, window, softcap)

    def _num_kv_splits(self, batch: ForwardBatch) -> int:
        return choose_num_kv_splits(
            batch.batch_size,
            self.pool.kv_heads,
            max(batch.seq_lens),
            self.num_sms,
            self.min_split_len,
        )


def _longest_sequence(batch: ForwardBatch) -> int:
    return max(batch.seq_lens)


def _indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    """int64 [B + 1]: 0 then the running sums of ``lens``, copied without a device sync."""
    host = torch.tensor([0] + lens, dtype=torch.int64).cumsum_(0)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _kv_index(
    table: torch.Tensor, rows: torch.Tensor, lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr [B + 1], ``table[rows[b], :lens[b]]`` for every b, concatenated), on table's
    device."""
    indptr = _indptr(lens, table.device)
    counts = indptr[1:] - indptr[:-1]
    total = sum(lens)
    row_of = torch.repeat_interleave(rows.to(table.device), counts, output_size=total)
    pos = torch.arange(total, device=table.device) - torch.repeat_interleave(
        indptr[:-1], counts, output_size=total
    )
    return indptr, table[row_of, pos]
