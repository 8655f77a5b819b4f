"""Attention through the C kernel of ``radixrt_kernels.cpu.attention`` (the default on CPU).

One kernel call per layer reads K/V in place through the slots and also stores the forward's
new K/V. Its work is described once per step as segments (``attention.Segments``):
- decode: requests are grouped by the prefix they share through the radix cache (groups of
  >= ``MIN_GROUP_SIZE`` requests whose rows start with the same >= ``MIN_SHARED_PREFIX``
  slots, the prefix capped at seq_len - 1 of each); each group's prefix is one segment for
  all its requests, then every request's private tail one of its own. The grouping is
  computed in C (``attention.decode_segments``). When the batch gives fewer work items
  (requests × KV heads) than twice the threads, a request in no group with at least
  ``SPLIT_MIN_KEYS`` keys has them in two halves, two parts merged as a group's are, so the
  threads share one long sequence's keys;
- extend: each request's whole sequence (cached prefix and new tokens) is one causal segment
  for its new tokens;
- a mixed step (an extend whose first ``decode_rows`` requests compute one running request's
  next token each): the decode rows' segments as a decode step's, then the extend's.
The kernel takes float32 and bf16 with head_dim a multiple of 32 (``supports``). Its bf16 work
that AMX does not take runs on AVX512-BF16 dot products or widened to float32 for FMA, whichever
``calibrate.Calibrator.attention_dots`` measured faster for the model's attention shape on this
CPU (``bf16_dots``).

With ``exact`` (exact mode, ``attention``'s module text) a request's outputs have the same bits
whatever the batch, the prefix shared with it, and decode or extend: a group's prefix ends on a
multiple of ``attention.EXACT_STEP`` keys and each tail continues it, no request is split, and
every bf16 work item runs AMX where the CPU has it (else the ``bf16_dots`` choice).

A layer's sliding window and logit soft cap (``forward(..., window, softcap)``) go to the kernel
with the step's segments, which carry every key's and token's position: a windowed layer reads
only its tokens' windows' keys, whatever the rest of the sequence's slots hold, in exact mode
too.
"""

from __future__ import annotations

import dataclasses

import torch

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt.model.calibrate import Calibrator
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import library as cpu_library

MIN_GROUP_SIZE = 2
MIN_SHARED_PREFIX = 16
SPLIT_MIN_KEYS = 256  # a lone request's keys are split between the threads from this many


def unavailable_reason(pool: KVPool) -> str | None:
    """Why the C kernel cannot serve this pool (None: it can)."""
    if pool.device.type != "cpu":
        return f"the KV pool is on {pool.device}, not the CPU"
    if cpu_library.load(cache_dir()) is None:
        return f"the CPU kernels' library is unavailable: {cpu_library.why_unavailable()}"
    if not cpu_attention.supports(pool.k_buffers[0]):
        return (
            f"the kernel takes float32 or bf16 heads of a multiple of {cpu_attention.DIM_MULTIPLE}"
            f" up to {cpu_attention.MAX_DIM}, not {pool.dtype} heads of {pool.head_dim}"
        )
    return None


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(
        self,
        pool: KVPool,
        num_heads: int | None = None,
        bf16_dots: bool | None = None,
        exact: bool = False,
    ):
        """``num_heads``: the model's query heads (default: one per KV head); ``bf16_dots``:
        force the bf16 path (None: the measured choice, for a bf16 pool); ``exact``: exact
        mode (the module's text)."""
        super().__init__(pool)
        self.exact = exact
        why = unavailable_reason(pool)
        if why is not None:
            raise RuntimeError(f"attention_backend='cpu' cannot run: {why}")
        self.lib = cpu_library.load(cache_dir())
        if pool.dtype != torch.bfloat16 or not cpu_attention.dots_available(self.lib):
            bf16_dots = False
        elif bf16_dots is None:
            group = (num_heads or pool.kv_heads) // pool.kv_heads
            bf16_dots = Calibrator(self.lib, cache_dir(), exact=exact).attention_dots(
                pool.kv_heads, group, pool.head_dim
            )
        self.bf16_dots = bf16_dots

    def describe(self) -> str:
        notes = ["bf16: dot products"] if self.bf16_dots else []
        notes += ["exact"] if self.exact else []
        return f"cpu ({', '.join(notes)})" if notes else "cpu"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            few = len(batch.seq_lens) * self.pool.kv_heads < 2 * torch.get_num_threads()
            batch.attn_metadata = self._decode_segments(batch.req_rows, batch.seq_lens, few)
            self._swa_view(batch)
            return
        d, table = batch.decode_rows, self.pool.req_to_token
        extend = extend_segments(
            table, batch.req_rows[d:], batch.seq_lens[d:], batch.extend_lens[d:], self.exact
        )
        if d:  # a mixed step: its decode rows grouped by shared prefix as a decode step's are
            decode = self._decode_segments(batch.req_rows[:d], batch.seq_lens[:d], few=False)
            extend = cpu_attention.concat_segments(decode, extend)
        batch.attn_metadata = extend
        self._swa_view(batch)

    def _swa_view(self, batch: ForwardBatch) -> None:
        """For a pool with sliding-window layers: the segments over their slots (positions
        behind a window map to slot 0, which the kernel never reads there)."""
        to_swa = getattr(self.pool, "full_to_swa", None)
        if to_swa is None:
            return
        meta = batch.attn_metadata
        batch.swa_metadata = dataclasses.replace(meta, slots=to_swa[meta.slots])
        batch.swa_out_cache_loc = to_swa[batch.out_cache_loc]

    def _decode_segments(
        self, req_rows: torch.Tensor, seq_lens: list[int], few: bool
    ) -> cpu_attention.Segments:
        """Segments of decode rows; ``few``: too few work items for the threads (split the
        long lone requests' keys, outside exact mode)."""
        return cpu_attention.decode_segments(
            self.lib,
            self.pool.req_to_token,
            req_rows,
            seq_lens,
            MIN_SHARED_PREFIX,
            MIN_GROUP_SIZE,
            SPLIT_MIN_KEYS if few and not self.exact else 0,
            exact=self.exact,
        )

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
        """q [T, H, D], the new k/v [T, KH, D] (views into qkv are read in place) → [T, H, D]."""
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        dt, out_dtype = k_buf.dtype, q.dtype
        if not q.dtype == k.dtype == v.dtype == dt:
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        segments, new_slots = self.layer_view(layer_id, batch)
        o = cpu_attention.attention(
            self.lib,
            q,
            k_buf,
            v_buf,
            segments,
            scaling,
            (k, v, new_slots),
            bf16_dots=self.bf16_dots,
            window=window,
            softcap=softcap,
        )
        return o.to(out_dtype)


def extend_segments(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    exact: bool = False,
) -> cpu_attention.Segments:
    """An extend's segments: per request its whole sequence, causal, with its new tokens as
    members (``exact``: for exact mode); token i of request b at position
    seq_len_b - extend_len_b + i."""
    dev = table.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
    valid = torch.arange(max(seq_lens), device=dev)[None, :] < lens[:, None]
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    ext = torch.tensor(extend_lens, dtype=torch.int64, device=dev)
    t, s = int(ext.sum()), len(seq_lens)
    first = torch.repeat_interleave(ext.cumsum(0) - ext, ext, output_size=t)  # a token's request's
    prefix = torch.repeat_interleave(lens - ext, ext, output_size=t)
    return cpu_attention.Segments(
        slots=table[:, : valid.shape[1]].index_select(0, req_rows)[valid],  # request by request
        slot_start=torch.cat([zero, lens.cumsum(0)]),
        members=torch.arange(t, device=dev),
        member_start=torch.cat([zero, ext.cumsum(0)]),
        part=torch.zeros(s, dtype=torch.int64, device=dev),
        num_parts=torch.ones(t, dtype=torch.int64, device=dev),
        causal=torch.ones(s, dtype=torch.int64, device=dev),
        exact=exact,
        key_start=torch.zeros(s, dtype=torch.int64, device=dev),
        position=prefix + torch.arange(t, device=dev) - first,
    )
