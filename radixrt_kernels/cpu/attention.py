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

Sliding windows and soft-capping (``attention(..., window=W, softcap=c)``, per call: a model's
layers differ): a token at position p sees only the keys at positions p - W + 1 .. p, and
scores (after scaling) become c·tanh(s / c) before the softmax. Positions come with the
segments (``Segments.key_start``, ``Segments.position``, which ``decode_segments`` and the
backend's extend segments fill). A windowed call reads no slot before a token's window (a
slot the window dropped may hold anything) and costs what the window's keys cost, whatever
the sequence's length; in exact mode a row's bits stay its own (the kernel's header says
why).
"""

from __future__ import annotations

import ctypes
import math
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
    # A window's positions (None: segments for calls without a window):
    key_start: torch.Tensor | None = None  # [S] the position of each segment's first key in the
    # sequences of its members
    position: torch.Tensor | None = None  # [T] each token's own key's position (it sees up to it)
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
        key = (t, h, d, *map(id, tensors + (self.key_start, self.position)))
        if self._call is None or self._call[0] != key:
            # scratch for merging two parts: acc [T, 2, H, D], then m and l [T, 2, H] each
            scratch = torch.empty(t * 2 * h * (d + 2) if self.two_parts else 0, dtype=torch.float32)
            merge = tuple(
                scratch.data_ptr() + 4 * off for off in (0, t * 2 * h * d, t * 2 * h * (d + 1))
            )
            args = (self.part.numel(), *(None if x is None else x.data_ptr() for x in tensors))
            window = tuple(
                None if x is None else x.data_ptr() for x in (self.key_start, self.position)
            )
            self._call = (key, scratch, args + merge, window)
        return self._call[2]

    def _window_args(self) -> tuple:
        """The kernel's window arguments (seg_key_start, positions) after ``_call_args``."""
        if self.key_start is None or self.position is None:
            raise ValueError(
                "attention: a sliding window needs the segments' key_start and position "
                "(decode_segments and the backend's extend segments fill them)"
            )
        return self._call[3]


def concat_segments(a: Segments, b: Segments) -> Segments:
    """One call's segments for a's query tokens followed by b's (b's token i is token
    ``a.num_parts.numel() + i`` of the call): a step whose first tokens are decode rows and
    whose rest extend, each described as its kind is."""
    if a.exact != b.exact:
        raise ValueError("concat_segments: both sides must be exact, or neither")

    def causal(x: Segments) -> torch.Tensor:
        return x.causal if x.causal is not None else torch.zeros_like(x.part)

    positioned = all(x.key_start is not None and x.position is not None for x in (a, b))
    return Segments(
        slots=torch.cat([a.slots, b.slots]),
        slot_start=torch.cat([a.slot_start, b.slot_start[1:] + a.slot_start[-1]]),
        members=torch.cat([a.members, b.members + a.num_parts.numel()]),
        member_start=torch.cat([a.member_start, b.member_start[1:] + a.member_start[-1]]),
        part=torch.cat([a.part, b.part]),
        num_parts=torch.cat([a.num_parts, b.num_parts]),
        causal=None if a.causal is None and b.causal is None else torch.cat([causal(a), causal(b)]),
        exact=a.exact,
        key_start=torch.cat([a.key_start, b.key_start]) if positioned else None,
        position=torch.cat([a.position, b.position]) if positioned else None,
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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] (the query tokens; token rows may be strided), k_buf/v_buf [N, KH, D]
    (contiguous, same dtype) → o [T, H, D] (into ``out`` where given: contiguous, q's dtype).

    ``new_kv``: (k, v [n, KH, D], slots int64 [n]): the forward's new K/V, written into the
    buffers at those slots first (one call instead of a store and an attention).
    ``bf16_dots``: bf16 work that AMX does not take runs on AVX512-BF16 dot products where the
    build has them (``dots_available``), else it is widened to float32 for FMA.
    ``window``, ``softcap``: a sliding window of that many keys, and the scores' soft cap (the
    module's text; None: none).
    ``seg.exact``: exact mode (the module's text)."""
    check_window(window, softcap)
    if (recorder := cpu_capture.capturing()) is not None:
        return recorder.attention(q, k_buf, v_buf, scaling, new_kv, bf16_dots, out, window, softcap)
    if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        raise ValueError("attention: k_buf and v_buf must be contiguous")
    call = AttentionCall(lib, q, k_buf, seg, scaling, new_kv, bf16_dots, out, window, softcap)
    call(k_buf.data_ptr(), v_buf.data_ptr())
    return call.out


def check_window(window: int | None, softcap: float | None) -> None:
    """A sliding window is None or a positive int, a soft cap None or a positive finite number."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"attention: a sliding window must be a positive int, got {window!r}")
    if softcap is not None and not (
        isinstance(softcap, (int, float))
        and not isinstance(softcap, bool)
        and 0 < softcap < math.inf
    ):
        raise ValueError(f"attention: a soft cap must be a positive finite number, got {softcap!r}")


def _new_rows(
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, kh: int, d: int, dtype
) -> tuple:
    """(new_k, new_v, new_slots) as the kernel reads them (Nones without new rows)."""
    if new_kv is None:
        return None, None, None
    new_k, new_v, new_slots = (_token_rows(new_kv[0]), _token_rows(new_kv[1]), new_kv[2])
    if new_k.shape[0] > 1 and new_k.stride(0) != new_v.stride(0):  # one stride for both
        new_k, new_v = new_k.contiguous(), new_v.contiguous()
    if not (
        new_k.dtype == new_v.dtype == dtype
        and new_k.shape == new_v.shape == (new_slots.numel(), kh, d)
        and new_slots.dtype == torch.int64
        and new_slots.is_contiguous()
    ):
        raise ValueError(
            "attention: new k/v must be [n, KH, D] in the buffers' dtype, "
            "their slots contiguous int64 [n]"
        )
    return new_k, new_v, new_slots


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
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        t, h, d = q.shape
        kh = k_buf.shape[1]
        q = _token_rows(q)
        if out is None:
            out = torch.empty(t, h, d, dtype=q.dtype)
        elif out.shape != (t, h, d) or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"attention: out must be contiguous {q.dtype} [{t}, {h}, {d}]")
        check_window(window, softcap)
        new_k, new_v, new_slots = _new_rows(new_kv, kh, d, k_buf.dtype)
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
        self.sizes = (out.data_ptr(), *flags, t, h, kh, d)
        self.scaling, self.segments, self.new = scaling, seg._call_args(t, h, d), new
        window_at = seg._window_args() if window is not None else (None, None)
        self.window = (*window_at, window or 0, softcap or 0.0)
        self.tail = (
            *self.sizes,
            scaling,
            *self.segments,
            torch.get_num_threads(),
            *self.new,
            *self.window,
        )

    @property
    def fields(self) -> list[int]:
        """The arguments as a decode chain's attention step takes them (cpu/chain.c's struct
        attention_args): the KV buffers and the thread count left out, scaling and the soft cap
        as doubles' bits, NULL as 0."""
        *window, cap = self.window
        values = (*self.head, *self.sizes, _bits(self.scaling), *self.segments, *self.new)
        return [0 if v is None else v for v in (*values, *window, _bits(cap))]

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


def _bits(x: float) -> int:
    """A double's bits as an int64."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


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
    (``split_from``, a way to share one request's keys between threads, is not used). The
    segments carry their positions for windowed calls: slot p of a request's row is at
    position p."""
    b = len(seq_lens)
    if table.dtype != torch.int64 or table.stride(1) != 1 or req_rows.dtype != torch.int64:
        raise ValueError("decode_segments: table and req_rows must be int64, table rows contiguous")
    req_rows = req_rows.contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    slots = torch.empty(int(sum(seq_lens)), dtype=torch.int64)
    # slot_start, member_start, members, part, num_parts, key_start, position, order
    ints = torch.empty(13 * b + 2, dtype=torch.int64)
    slot_start, member_start, members, part, num_parts, key_start, position, order = ints.split(
        [2 * b + 1, 2 * b + 1, 2 * b, 2 * b, b, 2 * b, b, b]
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
        key_start.data_ptr(),
        position.data_ptr(),
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
        key_start=key_start[:n],
        position=position,
    )
