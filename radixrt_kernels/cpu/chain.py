"""Several decode-sized steps in one C call (``cpu/chain.c``).

A decode step of a small batch runs dozens of short kernels per layer, each a
Python wrapper, a ctypes call and an OpenMP team of its own, costs of the
same order as streaming a small layer's weights. A ``Chain`` holds a sequence
of RMS norms, rotary embeddings, packed linears (the ``"avx512_bf16"`` and
``"fma"`` kernels of ``cpu_linear``), linears on GGUF-quantized weights
(``cpu_quant``, every type and path), SiLU-and-mul and attentions over buffers
fixed when it is built, as a table of int64 rows; ``run`` executes it in one
call and one parallel region, a barrier between each step and the next. Each
step gives the results of the call it stands for (``elementwise.rms_norm``,
``elementwise.rope_``, ``elementwise.silu_mul``, ``linear.linear``,
``quant.linear``, ``attention.attention``) bit for bit.

A chain names its tensors by address: it keeps them alive, and callers write
a step's inputs into the buffers it was built on (``Chain`` checks shapes,
dtypes and strides when a step is added, never when it runs).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, NamedTuple

import torch

from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import linear as cpu_linear
from radixrt_kernels.cpu import quant as cpu_quant
from radixrt_kernels.cpu.capture import (
    CHAIN_LINEAR_KERNELS,
    Recorder,
    Step,
    capturing,
    storage,
    tensors,
)

LINEAR, NORM, ROPE, ATTENTION, QUANT, SILU_MUL = 1, 2, 3, 4, 5, 6  # chain.c's step kinds
_VEC_KERNEL = {"fma": 0, "avx512_bf16": 1}
KERNELS = CHAIN_LINEAR_KERNELS  # the linear kernels a chain runs
ALIGN = 64  # bytes: every tensor of a replay's arena starts on a cache line
STEP_FIELDS = (
    "kind kernel x x_stride w bias y y_stride y_f32 gated positions rope_cos "
    "rope_sin rope_dim rope_cols m n k residual eps path"
).split()  # a step's row of the table: chain.c's struct step
ROWS_FIELD = STEP_FIELDS.index("m")


def _rows(t: torch.Tensor, what: str, width: int) -> int:
    """The row stride of a 2-D bf16 CPU tensor [*, width] with unit column stride."""
    if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(
            f"chain: {what} must be a 2-D bf16 tensor [*, {width}] with contiguous rows, "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    return t.stride(0)


def _eps_bits(eps: float) -> int:
    return struct.unpack("<q", struct.pack("<d", eps))[0]


class Chain:
    """Steps over fixed buffers, run by ``run(lib)``. Add them in order with ``norm``,
    ``linear``, ``quant_linear``, ``rope``, ``silu_mul`` and ``attention``; a step may read
    what an earlier one wrote."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.fields = lib.radixrt_chain_fields()
        self.steps: list[list[int]] = []
        self.keep: list[torch.Tensor] = []  # every tensor a step names
        self._table: torch.Tensor | None = None

    def _add(self, tensors, **f) -> None:
        row = dict.fromkeys(STEP_FIELDS, 0)
        row.update(f)
        if len(row) != self.fields:
            raise RuntimeError("chain: the library's step has another layout")
        self.steps.append(list(row.values()))
        self.keep.extend(t for t in tensors if t is not None)
        self._table = None

    def norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> None:
        """out = ``elementwise.rms_norm(x, weight, eps, residual)`` (the sum into ``residual``):
        x [m, n] bf16 (rows may be strided), out and residual contiguous [m, n]; or each head's
        norm of x [m, heads, n] (heads contiguous, token rows may be strided) into out laid out
        alike (out may be x), without a residual."""
        heads = x.shape[1] if x.dim() == 3 else 1
        n = x.shape[-1]
        if x.dim() == 3:
            if residual is not None or out.shape != x.shape:
                raise ValueError("chain: a per-head norm has no residual, and out of x's shape")
            for t, what in ((x, "x"), (out, "output")):
                if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != n:
                    raise ValueError(
                        f"chain: a per-head norm's {what} must be bf16, heads contiguous"
                    )
            x_stride, y_stride = x.stride(0), out.stride(0)
        else:
            x_stride = _rows(x, "a norm's x", n)
            for t in (out, residual):
                if t is not None and (not t.is_contiguous() or _rows(t, "a norm's output", n) != n):
                    raise ValueError(
                        "chain: a norm's output and residual must be contiguous [m, n]"
                    )
                if t is not None and t.shape[0] != x.shape[0]:
                    raise ValueError("chain: a norm's output and residual need x's rows")
            y_stride = n
        if weight.dtype != torch.bfloat16 or weight.shape != (n,) or not weight.is_contiguous():
            raise ValueError(f"chain: a norm's weight must be contiguous bf16 [{n}]")
        self._add(
            (x, weight, out, residual),
            kind=NORM,
            x=x.data_ptr(),
            x_stride=x_stride,
            w=weight.data_ptr(),
            y=out.data_ptr(),
            y_stride=y_stride,
            m=x.shape[0],
            n=n,
            k=heads,
            residual=0 if residual is None else residual.data_ptr(),
            eps=_eps_bits(eps),
        )

    def linear(
        self,
        kernel: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        gated: bool = False,
        rope: cpu_linear.Rope | None = None,
    ) -> None:
        """out = ``linear.linear(x, packed, n, bias, gated=gated, rope=rope,
        kernel=kernel)``: x [m, k] and out [m, n (gated: n / 2)] bf16 with contiguous rows."""
        if kernel not in _VEC_KERNEL:
            raise ValueError(f"chain: unknown linear kernel {kernel!r} (one of {KERNELS})")
        m, k = x.shape
        width = n // 2 if gated else n
        x_stride, y_stride = _rows(x, "a linear's x", k), _rows(out, "a linear's output", width)
        if out.shape[0] != m or packed.numel() != cpu_linear.packed_elems(n, k):
            raise ValueError(
                f"chain: the packed weight does not hold [{n}, {k}] for x {tuple(x.shape)}"
            )
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
            raise ValueError("chain: the bias must be bf16 [n]")
        rope_f = {}
        if rope is not None:
            pos = rope.positions
            if pos.dtype != torch.int64 or pos.shape[0] < m or not pos.is_contiguous():
                raise ValueError("chain: rope positions must be contiguous int64 [>= m]")
            rope_f = dict(
                positions=pos.data_ptr(),
                rope_cos=rope.cos.data_ptr(),
                rope_sin=rope.sin_signed.data_ptr(),
                rope_dim=rope.head_dim,
                rope_cols=rope.cols,
            )
        bias = None if bias is None else bias.contiguous()
        self._add(
            (x, packed, out, bias, *(rope[:3] if rope is not None else ())),
            kind=LINEAR,
            kernel=_VEC_KERNEL[kernel],
            x=x.data_ptr(),
            x_stride=x_stride,
            w=packed.data_ptr(),
            bias=0 if bias is None else bias.data_ptr(),
            y=out.data_ptr(),
            y_stride=y_stride,
            gated=int(gated),
            m=m,
            n=n,
            k=k,
            **rope_f,
        )

    def quant_linear(
        self,
        qtype: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        k: int,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        """out = ``quant.linear(x, packed, n, k, bias, force_path=path)``: x [m, k] bf16 with
        contiguous rows, out [m, n] bf16 or float32 with contiguous rows (a stacked weight's
        columns), bias None or contiguous float32 or bf16 [n]; ``path`` one of ``quant.PATHS``
        (None: the path ``quant.path`` chooses for m rows)."""
        m = x.shape[0]
        x_stride = _rows(x, "a quantized linear's x", k)
        if (
            out.dtype not in (torch.bfloat16, torch.float32)
            or out.shape != (m, n)
            or out.stride(1) != 1
        ):
            raise ValueError(
                f"chain: a quantized linear's output must be [{m}, {n}] with contiguous rows"
            )
        if packed.dtype != torch.uint8 or packed.numel() != cpu_quant.packed_bytes(
            self.lib, qtype, n, k
        ):
            raise ValueError(f"chain: the packed {qtype} weight does not hold [{n}, {k}]")
        if bias is not None and (
            bias.dtype not in (torch.float32, torch.bfloat16)
            or bias.shape != (n,)
            or not bias.is_contiguous()
        ):
            raise ValueError(
                f"chain: a quantized linear's bias must be contiguous float32 or bf16 [{n}]"
            )
        if path is not None and not cpu_quant.path_available(self.lib, qtype, path):
            raise ValueError(f"chain: the {path} path does not run {qtype} here")
        self._add(
            (x, packed, out, bias),
            kind=QUANT,
            kernel=cpu_quant.QTYPES[qtype],
            x=x.data_ptr(),
            x_stride=x_stride,
            w=packed.data_ptr(),
            bias=0 if bias is None else bias.data_ptr(),
            y=out.data_ptr(),
            y_stride=out.stride(0),
            y_f32=int(out.dtype == torch.float32),
            gated=int(bias is not None and bias.dtype == torch.bfloat16),
            m=m,
            n=n,
            k=k,
            path=-1 if path is None else cpu_quant.PATHS.index(path),
        )

    def silu_mul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = ``elementwise.silu_mul(x)``: x [m, 2n] and out [m, n], contiguous bf16."""
        m, n2 = x.shape
        for t, width in ((x, n2), (out, n2 // 2)):
            if (
                t.dtype != torch.bfloat16
                or not t.is_contiguous()
                or t.shape != (m, width)
                or n2 % 2
            ):
                raise ValueError(
                    "chain: SiLU-and-mul takes contiguous bf16 x [m, 2n] and out [m, n]"
                )
        self._add((x, out), kind=SILU_MUL, x=x.data_ptr(), y=out.data_ptr(), m=m, n=n2 // 2)

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> None:
        """``elementwise.rope_(x, positions[:m], cos, sin_signed)``: x [m, heads, d] bf16 (token
        rows may be strided, heads contiguous), rotated in place."""
        m, heads, d = x.shape
        if x.dtype != torch.bfloat16 or x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError("chain: a rotation's x must be bf16 [m, heads, d], heads contiguous")
        if (
            positions.dtype != torch.int64
            or positions.shape[0] < m
            or not positions.is_contiguous()
        ):
            raise ValueError("chain: rope positions must be contiguous int64 [>= m]")
        tables = (cos, sin_signed)
        if any(
            t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1] != d for t in tables
        ):
            raise ValueError(f"chain: the rotary tables must be contiguous float32 [*, {d}]")
        self._add(
            (x, positions, cos, sin_signed),
            kind=ROPE,
            x=x.data_ptr(),
            x_stride=x.stride(0),
            positions=positions.data_ptr(),
            rope_cos=cos.data_ptr(),
            rope_sin=sin_signed.data_ptr(),
            m=m,
            n=heads,
            k=d,
        )

    def attention(self, args: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """``attention.attention`` on the KV buffers k_buf, v_buf [N, KH, D] (contiguous)
        with the rest of its arguments as ``args`` holds them when the chain runs: int64
        [``attention_fields(lib)``], ``attention.AttentionCall.fields`` (several layers'
        steps may share one ``args``). The kernel checks them when the chain runs."""
        if args.dtype != torch.int64 or args.shape != (self.lib.radixrt_chain_attention_fields(),):
            raise ValueError("chain: attention args must be int64 [attention fields]")
        if not (k_buf.is_contiguous() and v_buf.is_contiguous()) or k_buf.shape != v_buf.shape:
            raise ValueError("chain: the KV buffers must be contiguous, of one shape")
        self._add(
            (args, k_buf, v_buf),
            kind=ATTENTION,
            w=args.data_ptr(),
            y=k_buf.data_ptr(),
            residual=v_buf.data_ptr(),
        )

    def run(self, threads: int | None = None, rows: torch.Tensor | None = None) -> None:
        """Every step, in order, on ``threads`` threads (default: PyTorch's). ``rows``: int64
        [steps], each step's row count for this run instead of the one it was added with (at
        most that; 0 for an attention step, whose arguments name their rows)."""
        if self._table is None:
            self._table = torch.tensor(self.steps, dtype=torch.int64).reshape(-1, self.fields)
        if rows is not None:
            self._table[:, ROWS_FIELD] = rows
        rc = self.lib.radixrt_chain(
            self._table.data_ptr(), len(self.steps), threads or torch.get_num_threads()
        )
        if rc != 0:
            raise ValueError(f"chain: step {-rc - 1} does not fit the kernels here")


# ---- a captured forward, replayed ---------------------------------------------------------------


def replay(
    lib: ctypes.CDLL, recorder: Recorder, outputs: tuple[torch.Tensor, ...], rows: int
) -> Replay:
    """A finished capture (``capture.capture``) of a forward of ``rows`` tokens as a chain over
    one arena; ``outputs`` (what the captured code returned) become the tensors the chain
    leaves its results in. It runs any row count of ``recorder.rows`` up to ``rows``."""
    if capturing() is recorder:
        raise RuntimeError("replay: the capture has not ended")
    arena = _Arena(recorder.allocated, recorder.steps, outputs)
    steps = [Step(s.kind, arena.move(s.args)) for s in recorder.steps]
    low, high = recorder.rows
    serves = (low, rows if high is None else min(high, rows))
    return Replay(lib, steps, arena, outputs, rows, serves)


class _Arena:
    """One buffer for every tensor a capture allocated: each gets its own stretch for the steps
    between its first and last use (and to the end, for the forward's outputs), first fit."""

    def __init__(self, allocated: dict[int, torch.Tensor], steps: list[Step], outputs) -> None:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, step in enumerate(steps):
            for t in tensors(step.args):
                key = storage(t)
                if key in allocated:
                    first.setdefault(key, i)
                    last[key] = i
        for t in tensors(outputs):
            if storage(t) in allocated:
                last[storage(t)] = len(steps)
        self.offsets: dict[int, int] = {}
        placed: list[tuple[int, int, int]] = []  # (last use, offset, end)
        for key in sorted(first, key=first.get):
            live = sorted((o, e) for end, o, e in placed if end >= first[key])
            size = -(-allocated[key].untyped_storage().nbytes() // ALIGN) * ALIGN
            offset = 0
            for o, e in live:
                if offset + size <= o:
                    break
                offset = max(offset, e)
            self.offsets[key] = offset
            placed.append((last[key], offset, offset + size))
        self.buffer = torch.zeros(max((e for _, _, e in placed), default=0), dtype=torch.uint8)

    def move(self, value: Any) -> Any:
        """``value`` with every tensor the capture allocated (or a view of one) replaced by the
        same view of the arena."""
        if isinstance(value, torch.Tensor):
            key = storage(value)
            if key not in self.offsets:
                return value
            base = self.buffer.view(value.dtype)
            start = self.offsets[key] // value.element_size() + value.storage_offset()
            return base.as_strided(value.shape, value.stride(), start)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)._make(self.move(v) for v in value)
        if isinstance(value, (tuple, list)):
            return type(value)(self.move(v) for v in value)
        return value


class _Attention(NamedTuple):
    """An attention step's arguments (int64 [fields]) and the call they are filled from."""

    args: torch.Tensor
    q: torch.Tensor
    k_buf: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    out: torch.Tensor
    scaling: float
    bf16_dots: bool
    window: int | None
    softcap: float | None


class Replay:
    """A captured forward of ``rows`` tokens as one chain: ``run(segments, slots, m)``
    computes what the forward of the first m of them (m in ``serves``, the row counts whose
    choices are the capture's) computes on the inputs now in its input buffers, into the first
    m rows of ``outputs``. Every step's rows are the forward's tokens (or a multiple of them,
    heads as rows), so a run of fewer tokens runs each step on its first rows."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        steps: list[Step],
        arena: _Arena,
        outputs,
        rows: int,
        serves: tuple[int, int],
    ) -> None:
        self.lib, self.arena, self.rows, self.serves = lib, arena, rows, serves
        self.outputs = arena.move(tuple(outputs))
        self.chain = Chain(lib)
        self.attention: dict[tuple, _Attention] = {}  # steps with equal arguments share them
        self.kernels = sorted({s.args[0] for s in steps if s.kind == "linear"}) + sorted(
            {
                f"{s.args[0]} {s.args[7] or cpu_quant.path(lib, s.args[0], 1)}"
                for s in steps
                if s.kind == "quant_linear"
            }
        )
        for step in steps:
            if step.kind == "attention":
                self._add_attention(*step.args)
            else:
                getattr(self.chain, step.kind)(*step.args)
        per_token = []  # each step's rows per token (0: an attention step)
        for row in self.chain.steps:
            m = 0 if row[0] == ATTENTION else row[ROWS_FIELD]
            if m % rows:
                raise ValueError(f"chain: a step of {m} rows in a forward of {rows} tokens")
            per_token.append(m // rows)
        self.per_token = torch.tensor(per_token, dtype=torch.int64)
        tokens = [t for a in self.attention.values() for t in (a.q, a.new_k, a.new_v, a.out)]
        if any(t.shape[0] != rows for t in (*tokens, *self.outputs)):
            raise ValueError("chain: an attention or an output without a row per token")

    def _add_attention(
        self, q, k_buf, v_buf, new_k, new_v, out, scaling, bf16_dots, window, softcap
    ) -> None:
        key = tuple((t.data_ptr(), t.shape, t.stride()) for t in (q, new_k, new_v, out)) + (
            k_buf.shape,
            k_buf.dtype,
            scaling,
            bf16_dots,
            window,
            softcap,
        )
        if key not in self.attention:
            fields = self.lib.radixrt_chain_attention_fields()
            args = torch.zeros(fields, dtype=torch.int64)
            self.attention[key] = _Attention(
                args, q, k_buf, new_k, new_v, out, scaling, bf16_dots, window, softcap
            )
        self.chain.attention(self.attention[key].args, k_buf, v_buf)

    def run(
        self, segments: cpu_attention.Segments | None, slots: torch.Tensor | None, m: int
    ) -> None:
        """Every step over the first m tokens, the attentions over ``segments`` storing the new
        K/V at ``slots``."""
        if not self.serves[0] <= m <= self.serves[1]:
            raise ValueError(f"chain: a replay of {self.serves} rows cannot run {m}")
        for a in self.attention.values():
            call = cpu_attention.AttentionCall(
                self.lib,
                a.q[:m],
                a.k_buf,
                segments,
                a.scaling,
                (a.new_k[:m], a.new_v[:m], slots),
                a.bf16_dots,
                a.out[:m],
                a.window,
                a.softcap,
            )
            a.args.copy_(torch.tensor(call.fields, dtype=torch.int64))
        self.chain.run(rows=self.per_token * m)
