"""Attention through the Triton kernels of ``radixrt_kernels`` (the default on CUDA).

Once per step, ``init_forward_metadata`` builds the index tensors on the
pool's device, sized from the batch's host-side lengths (no device sync), into
a metadata record that runs its kernel:
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
sequence.
Per layer, ``forward`` stores the new K/V with ``store_kv`` and runs the step's
record. On CPU it works only under the Triton interpreter (``TRITON_INTERPRET=1``
set before import), which is slow and meant for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt_kernels.triton import INTERPRET
from radixrt_kernels.triton.decode_attention import (
    DecodeWorkspace,
    choose_num_kv_splits,
    decode_attention,
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
    qo_indptr: torch.Tensor  # int64 [B + 1] over the T new tokens
    kv_indptr: torch.Tensor  # int64 [B + 1] over kv_indices
    kv_indices: torch.Tensor  # int64 [sum of prefix lens]: slots of each cached prefix
    max_extend_len: int

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        o = q.new_empty(q.shape)
        return extend_attention(
            q,
            k,
            v,
            o,
            k_buf,
            v_buf,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            scaling,
            self.max_extend_len,
        )


@dataclass
class _DecodeMeta:
    kv_indptr: torch.Tensor  # int64 [B + 1]
    kv_indices: torch.Tensor  # int64 [sum of seq lens]: slots of each whole sequence
    num_kv_splits: int
    workspace: DecodeWorkspace | None = None  # allocated by the first layer

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        if self.workspace is None:
            batch, heads, head_dim = q.shape
            self.workspace = DecodeWorkspace.allocate(
                batch, heads, head_dim, self.num_kv_splits, q.device
            )
        o = q.new_empty(q.shape)
        return decode_attention(
            q,
            k_buf,
            v_buf,
            o,
            self.kv_indptr,
            self.kv_indices,
            scaling,
            self.num_kv_splits,
            self.workspace,
        )


@dataclass
class _FixedExtendMeta:
    qo_indptr: torch.Tensor  # int64 [B + 1] over the T new tokens
    kv_indptr: torch.Tensor  # int64 [B + 1] over kv_indices
    kv_indices: torch.Tensor  # int64 [sum of seq lens]: slots of each whole sequence
    max_extend_len: int

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        o = q.new_empty(q.shape)
        return deterministic_extend_attention(
            q,
            o,
            k_buf,
            v_buf,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            scaling,
            self.max_extend_len,
        )


@dataclass
class _FixedDecodeMeta:
    kv_indptr: torch.Tensor  # int64 [B + 1]
    kv_indices: torch.Tensor  # int64 [sum of seq lens]: slots of each whole sequence
    max_seq_len: int
    workspace: DecodeWorkspace | None = None  # allocated by the first layer

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        if self.workspace is None:
            self.workspace = fixed_split_workspace(q, self.max_seq_len)
        o = q.new_empty(q.shape)
        return deterministic_decode_attention(
            q,
            k_buf,
            v_buf,
            o,
            self.kv_indptr,
            self.kv_indices,
            scaling,
            self.max_seq_len,
            self.workspace,
        )


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
        self._plan = _plan_fixed_splits if deterministic else self._plan_split_count

    def describe(self) -> str:
        return f"{self.name} (deterministic: fixed KV splits)" if self.deterministic else self.name

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = self._plan(self.pool.req_to_token, batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scaling: float,
    ) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        store_kv(k, v, k_buf, v_buf, batch.out_cache_loc)
        return batch.attn_metadata.run(q, k, v, k_buf, v_buf, scaling)

    def _plan_split_count(
        self, table: torch.Tensor, batch: ForwardBatch
    ) -> _DecodeMeta | _ExtendMeta:
        if batch.mode is ForwardMode.DECODE:
            kv_indptr, kv_indices = _kv_index(table, batch.req_rows, batch.seq_lens)
            splits = choose_num_kv_splits(
                batch.batch_size,
                self.pool.kv_heads,
                max(batch.seq_lens),
                self.num_sms,
                self.min_split_len,
            )
            return _DecodeMeta(kv_indptr, kv_indices, splits)
        kv_indptr, kv_indices = _kv_index(table, batch.req_rows, batch.prefix_lens)
        return _ExtendMeta(
            _indptr(batch.extend_lens, table.device), kv_indptr, kv_indices, max(batch.extend_lens)
        )


def _plan_fixed_splits(
    table: torch.Tensor, batch: ForwardBatch
) -> _FixedDecodeMeta | _FixedExtendMeta:
    """Both modes index whole sequences; the splits depend on no batch shape."""
    kv_indptr, kv_indices = _kv_index(table, batch.req_rows, batch.seq_lens)
    if batch.mode is ForwardMode.DECODE:
        return _FixedDecodeMeta(kv_indptr, kv_indices, max(batch.seq_lens))
    qo_indptr = _indptr(batch.extend_lens, table.device)
    return _FixedExtendMeta(qo_indptr, kv_indptr, kv_indices, max(batch.extend_lens))


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
