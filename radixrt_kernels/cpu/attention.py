"""Attention on the CPU, decode and extend: a C kernel (``cpu/attention.c``), cascade-aware.

The Triton kernels need a GPU; on the CPU this C kernel reads K/V straight
from the KV buffers through slot indices (no gathered copy), reads a prefix
shared by several requests once for all of them, and merges each query
token's parts by their log-sum-exps in the same call. It is part of the library
``radixrt_kernels.cpu.library`` builds on first use; where that library is
missing, callers fall back to PyTorch's kernels.

Segments: a query token's keys are one or two segments; a segment is a list
of slots plus the query tokens (members) that attend to it. In decode a shared
prefix is one segment for the requests of its group (part 0), a private tail
one for its request (part 1, or part 0 when the request has no shared prefix).
In extend a request's whole sequence is one causal segment for its new tokens:
they are its last keys, and each sees the keys up to itself.

Exact mode (``Segments.exact``, set by ``decode_segments(..., exact=True)`` and the
backend's extend segments): a query token's output has the same bits whatever the
batch around it, however its keys are split between a shared prefix and a private
tail, and whether it is computed in a decode or an extend. Every work item of the
call runs one path (AMX for bf16 where the CPU has it, whatever the item's rows), a
row's keys are reduced in blocks at fixed offsets from its first key, and a token's
private tail continues its prefix's online softmax instead of being merged with it:
the prefix must end on a multiple of ``EXACT_STEP`` keys (``decode_segments`` rounds
it down), and no lone request is split between the threads. Segments that break this
are refused (``ValueError``).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field

import torch

from radixrt_kernels.cpu import capture as cpu_capture

DIM_MULTIPLE = 32  # head_dim must be a multiple of this (the kernel's P·V chunk) ...
MAX_DIM = 256  # ... and at most this
DTYPES = (torch.float32, torch.bfloat16)
EXACT_STEP = 64  # exact mode: a shared prefix is a multiple of this many keys (attention.c)


@dataclass
class Segments:
    """A forward's key segments, as the kernel takes them (all int64, on the CPU)."""

    slots: torch.Tensor  # every segment's slots, one after another
    slot_start: torch.Tensor  # [S + 1] offsets into slots
    members: torch.Tensor  # every segment's query tokens (rows of q), one after another
    member_start: torch.Tensor  # [S + 1] offsets into members
    part: torch.Tensor  # [S] 0 or 1: where a member's result for this segment goes
    num_parts: torch.Tensor  # [T] 1 or 2 per query token
    causal: torch.Tensor | None = None  # [S] 1: the members are the segment's last keys, in order,
    # and each sees the keys up to itself (None: no causal segment)
    exact: bool = False  # exact mode (the module's text): a token's part 1 continues its part 0
    two_parts: bool = field(init=False)  # some token has two parts (the merge needs scratch)
    _call: tuple | None = field(
        init=False, default=None, repr=False, compare=False
    )  # see _call_args

    def __post_init__(self) -> None:
        self.two_parts = bool((self.num_parts == 2).any())

    def _call_args(self, t: int, h: int, d: int) -> tuple:
        """The kernel's segment arguments and merge scratch for a call on t tokens of h heads of
        d values: built on a forward's first layer, reused by the others (the key also holds
        the tensors' identities, so a Segments whose fields were replaced rebuilds them)."""
        tensors = (
            self.slots,
            self.slot_start,
            self.members,
            self.member_start,
            self.part,
            self.causal,
            self.num_parts,
        )
        key = (t, h, d, *map(id, tensors))
        if self._call is None or self._call[0] != key:
            # scratch for merging two parts: acc [T, 2, H, D], then m and l [T, 2, H] each
            scratch = torch.empty(t * 2 * h * (d + 2) if self.two_parts else 0, dtype=torch.float32)
            merge = tuple(
                scratch.data_ptr() + 4 * off for off in (0, t * 2 * h * d, t * 2 * h * (d + 1))
            )
            args = (self.part.numel(), *(None if x is None else x.data_ptr() for x in tensors))
            self._call = (key, scratch, args + merge)
        return self._call[2]


def concat_segments(a: Segments, b: Segments) -> Segments:
    """One call's segments for a's query tokens followed by b's (b's token i is token
    ``a.num_parts.numel() + i`` of the call): a step whose first tokens are decode rows and
    whose rest extend, each described as its kind is."""
    if a.exact != b.exact:
        raise ValueError("concat_segments: both sides must be exact, or neither")

    def causal(x: Segments) -> torch.Tensor:
        return x.causal if x.causal is not None else torch.zeros_like(x.part)

    return Segments(
        slots=torch.cat([a.slots, b.slots]),
        slot_start=torch.cat([a.slot_start, b.slot_start[1:] + a.slot_start[-1]]),
        members=torch.cat([a.members, b.members + a.num_parts.numel()]),
        member_start=torch.cat([a.member_start, b.member_start[1:] + a.member_start[-1]]),
        part=torch.cat([a.part, b.part]),
        num_parts=torch.cat([a.num_parts, b.num_parts]),
        causal=None if a.causal is None and b.causal is None else torch.cat([causal(a), causal(b)]),
        exact=a.exact,
    )


def supports(k_buf: torch.Tensor) -> bool:
    """True if the kernel takes this KV buffer [N, KH, D] (CPU, float32 or bfloat16, a head_dim
    it handles); queries are cast to its dtype."""
    d = k_buf.shape[-1]
    return (
        k_buf.device.type == "cpu"
        and k_buf.dtype in DTYPES
        and d % DIM_MULTIPLE == 0
        and d <= MAX_DIM
    )


def dots_available(lib: ctypes.CDLL) -> bool:
    """Whether ``attention(..., bf16_dots=True)`` runs dot products in this build."""
    return bool(lib.radixrt_attention_dots_available())


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D] as the kernel reads it: heads contiguous within a token, token rows any
    multiple of D apart (a view into the fused qkv output as it is; else a contiguous copy)."""
    return x if cpu_capture.heads_in_place(x) else x.contiguous()


def attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    seg: Segments,
    scaling: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    bf16_dots: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (the query tokens; token rows may be strided), k_buf/v_buf [N, KH, D]
    (contiguous, same dtype) → o [T, H, D] (into ``out`` where given: contiguous, q's dtype).

    ``new_kv``: (k, v [n, KH, D], slots int64 [n]): the forward's new K/V, written into the
    buffers at those slots first (one call instead of a store and an attention).
    ``bf16_dots``: bf16 work that AMX does not take runs on AVX512-BF16 dot products where the
    build has them (``dots_available``), else it is widened to float32 for FMA.
    ``seg.exact``: exact mode (the module's text)."""
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.attention(q, k_buf, v_buf, scaling, new_kv, bf16_dots, out)
    if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        raise ValueError("attention: k_buf and v_buf must be contiguous")
    call = AttentionCall(lib, q, k_buf, seg, scaling, new_kv, bf16_dots, out)
    call(k_buf.data_ptr(), v_buf.data_ptr())
    return call.out


class AttentionCall:
    """``attention``'s arguments checked once, for calls on several buffer pairs shaped like
    ``k_buf`` (a step's layers: the same queries' buffers, segments and new K/V rows, each
    layer's own pool buffers): ``call(k_address, v_address)`` runs the kernel into ``out``;
    ``fields`` are the same arguments as a decode chain's attention step reads them
    (``chain.Chain.attention``)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        seg: Segments,
        scaling: float,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        bf16_dots: bool = False,
        out: torch.Tensor | None = None,
    ) -> None:
        t, h, d = q.shape
        kh = k_buf.shape[1]
        q = _token_rows(q)
        if out is None:
            out = torch.empty(t, h, d, dtype=q.dtype)
        elif out.shape != (t, h, d) or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"attention: out must be contiguous {q.dtype} [{t}, {h}, {d}]")
        new_k = new_v = new_slots = None
        if new_kv is not None:
            new_k, new_v, new_slots = (_token_rows(new_kv[0]), _token_rows(new_kv[1]), new_kv[2])
            if new_k.shape[0] > 1 and new_k.stride(0) != new_v.stride(0):  # one stride for both
                new_k, new_v = new_k.contiguous(), new_v.contiguous()
            if not (
                new_k.dtype == new_v.dtype == k_buf.dtype
                and new_k.shape == new_v.shape == (new_slots.numel(), kh, d)
                and new_slots.dtype == torch.int64
                and new_slots.is_contiguous()
            ):
                raise ValueError(
                    "attention: new k/v must be [n, KH, D] in the buffers' dtype, "
                    "their slots contiguous int64 [n]"
                )
        self.lib, self.out, self.shape = lib, out, (h, kh, d)
        self.keep = (q, new_k, new_v, new_slots, seg)  # what the addresses below point into
        self.head = (q.data_ptr(), q.stride(0))
        new = (
            None if new_k is None else new_k.data_ptr(),
            None if new_v is None else new_v.data_ptr(),
            0 if new_k is None else new_k.stride(0),
            None if new_slots is None else new_slots.data_ptr(),
            0 if new_slots is None else new_slots.numel(),
        )
        flags = (int(q.dtype == torch.bfloat16), int(bf16_dots), int(seg.exact))
        sizes = (out.data_ptr(), *flags, t, h, kh, d)
        segments = seg._call_args(t, h, d)
        self.tail = (*sizes, scaling, *segments, torch.get_num_threads(), *new)

    @property
    def fields(self) -> list[int]:
        """The arguments as a decode chain's attention step takes them (cpu/chain.c's struct
        attention_args): the KV buffers and the thread count left out, scaling as a double's
        bits, NULL as 0."""
        t = self.tail  # sizes (8), scaling, segments (11), threads, new rows (5)
        scaling_bits = struct.unpack("<q", struct.pack("<d", t[8]))[0]
        return [
            0 if v is None else v for v in (*self.head, *t[:8], scaling_bits, *t[9:-6], *t[-5:])
        ]

    def __call__(self, k_address: int, v_address: int) -> None:
        rc = self.lib.radixrt_attention(*self.head, k_address, v_address, *self.tail)
        if rc == -2:
            raise ValueError(
                "attention: exact mode needs each two-part token's part 0 to be a non-causal "
                f"segment of a multiple of {EXACT_STEP} keys and its part 1 to continue it "
                "(decode_segments(..., exact=True) builds such segments; no split halves)"
            )
        if rc != 0:
            h, kh, d = self.shape
            raise ValueError(f"attention: unsupported shape (H {h}, KH {kh}, D {d})")


def decode_segments(
    lib: ctypes.CDLL,
    table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: list[int],
    min_prefix: int,
    min_group: int,
    split_from: int = 0,
    exact: bool = False,
) -> Segments:
    """A decode step's segments (one C call instead of ~60 PyTorch ops): requests grouped by a
    shared prefix (``radixrt.attention.cpu_backend`` states the rule; groups of >= ``min_group``
    requests sharing >= ``min_prefix`` slots), each group's prefix one segment, then each
    request's remaining slots; with ``split_from`` > 0, a request in no group with at least
    that many slots gets two segments, its slots' halves, as two parts. table int64 [rows,
    max_context] (each row's slots), req_rows int64 [B] (the requests' rows), seq_lens [B]
    (each >= 1). ``exact``: segments for exact mode: a group's prefix rounded down to a
    multiple of ``EXACT_STEP`` slots (the rest goes to each tail), and no request split
    (``split_from``, a way to share one request's keys between threads, is not used)."""
    b = len(seq_lens)
    if table.dtype != torch.int64 or table.stride(1) != 1 or req_rows.dtype != torch.int64:
        raise ValueError("decode_segments: table and req_rows must be int64, table rows contiguous")
    req_rows = req_rows.contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    slots = torch.empty(int(sum(seq_lens)), dtype=torch.int64)
    ints = torch.empty(
        10 * b + 2, dtype=torch.int64
    )  # slot_start, member_start, members, part, num_parts, order
    slot_start, member_start, members, part, num_parts, order = ints.split(
        [2 * b + 1, 2 * b + 1, 2 * b, 2 * b, b, b]
    )
    n = lib.radixrt_decode_segments(
        table.data_ptr(),
        table.stride(0),
        req_rows.data_ptr(),
        lens.data_ptr(),
        b,
        min_prefix,
        min_group,
        split_from,
        int(exact),
        slots.data_ptr(),
        slot_start.data_ptr(),
        members.data_ptr(),
        member_start.data_ptr(),
        part.data_ptr(),
        num_parts.data_ptr(),
        order.data_ptr(),
    )
    return Segments(
        slots=slots[: int(slot_start[n])],
        slot_start=slot_start[: n + 1],
        members=members[: int(member_start[n])],
        member_start=member_start[: n + 1],
        part=part[:n],
        num_parts=num_parts,
        exact=exact,
    )
