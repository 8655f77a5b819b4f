"""Forwards as one C call: the model's decoder layers captured and replayed as a chain.

In eager mode a decoder layer makes several kernel calls (norms, linears,
rotary, attention), each through a Python wrapper, ctypes and an OpenMP team of
its own; for a decode step those fixed costs are of the order of streaming a
small layer's weights, and a prefill step of a few hundred tokens still pays
them once per call. A ``DecodeChain`` runs the model's ``body`` (its decoder
layers, exactly as the model file writes them) under ``capture.capture``: the
CPU kernels' wrappers note their calls instead of computing, and
``chain.replay`` turns the notes into one chain, one call and one thread team
with a barrier between steps. A forward of up to ``max_rows`` tokens (a decode
batch, a prefill step, or both in one) is then the model's ``embed``, the
replay, and the model's ``head``.

One capture serves every row count that makes the same choices by row count
(``capture.small_side``: the decode-sized kernels and paths, or the larger
ones), so a model has a few captures, not one per row count.

Nothing here knows what a layer computes. The replay runs the calls the
layers made, with the kernels they choose for the row count it runs, so its
logits equal the layer-by-layer forward's bit for bit. A body that does
anything a chain cannot replay (an operation on PyTorch's kernels, a kernel
without a chain step) is refused when captured, with the reason; those
forwards run layer by layer."""

from __future__ import annotations

from operator import attrgetter

import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.model.calibrate import THRESHOLD
from radixrt_kernels.cpu import capture as cpu_capture
from radixrt_kernels.cpu import chain as cpu_chain

MAX_ROWS = 512  # the most tokens a forward replayed as a chain has


def unavailable_reason(model, backend, lib) -> str | None:
    """Why no chain can run this model's forwards, before trying to capture them (None: try)."""
    from radixrt.attention.cpu_backend import CpuAttentionBackend

    if lib is None:
        return "no CPU kernels' library"
    if model.compiled is not None:
        return "the model runs under torch.compile"
    if not isinstance(backend, CpuAttentionBackend):
        return "attention is not the CPU kernel's"
    if getattr(backend.pool, "sliding", None) is not None:
        return "sliding-window layers keep their own KV slots (a chain replays one slot table)"
    return None


def decode_chain_for(model, backend, lib) -> tuple[DecodeChain | None, str]:
    """(a chain for the model, its description), or (None, why not)."""
    why = unavailable_reason(model, backend, lib)
    if why is not None:
        return None, f"off: {why}"
    try:
        chain = DecodeChain(model, backend, lib)
    except (cpu_capture.ChainRefused, ValueError) as e:
        return None, f"off: {e}"
    return chain, chain.describe()


class DecodeChain:
    """The model's forwards of up to ``max_rows`` tokens, replayed (see the module's text).

    Row counts that make the same choices (``capture.small_side``: a decode-sized kernel or
    path, or the larger one) form a class, and one capture serves a class: it is made at the
    most rows the class has (up to ``max_rows``), so its buffers hold any of them. The
    constructor captures every class, from ``max_rows`` down, and raises
    ``capture.ChainRefused`` where the class of ``THRESHOLD`` rows (decode batches) cannot be
    replayed; another class may be refused on its own (a kernel without a chain step on its
    side of a threshold), and its forwards run layer by layer."""

    def __init__(self, model, backend, lib, max_rows: int = MAX_ROWS) -> None:
        self.model, self.backend, self.lib, self.max_rows = model, backend, lib, max_rows
        ids = torch.zeros(max_rows, dtype=torch.int64)
        self.hidden = model.embed(ids).clone()  # the body's input, [max_rows, hidden]
        self.positions = torch.zeros(max_rows, dtype=torch.int64)
        # (first row count, last row count, its replay or why that class is refused)
        self.classes: list[tuple[int, int, cpu_chain.Replay | str]] = []
        plan = self._class_of(min(THRESHOLD, max_rows))
        if isinstance(plan, str):
            raise cpu_capture.ChainRefused(plan)
        self._class_of(1)  # and the classes below

    @property
    def plans(self) -> list[cpu_chain.Replay]:
        """The replays captured so far, fewest rows first."""
        replays = (p for _, _, p in self.classes if not isinstance(p, str))
        return sorted(replays, key=attrgetter("rows"))

    @property
    def kernels(self) -> list[str]:
        return sorted({k for p in self.plans for k in p.kernels})

    def rows_from_one(self) -> int:
        """The most tokens such that every forward of 1 .. that many runs here."""
        top = 0
        for low, high, plan in sorted(self.classes, key=lambda c: c[0]):
            if low > top + 1 or isinstance(plan, str):
                break
            top = high
        return min(top, self.max_rows)

    def describe(self) -> str:
        return f"{', '.join(self.kernels)}, forwards of up to {self.rows_from_one()} tokens"

    def _capture(self, m: int) -> tuple[int, int, cpu_chain.Replay | str]:
        """The class of m rows captured at m: (its first row count, its last, its replay or
        why it is refused)."""
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(m, dtype=torch.int64),
            positions=self.positions[:m],
            out_cache_loc=torch.zeros(m, dtype=torch.int64),  # each run gives its own
            req_rows=torch.zeros(m, dtype=torch.int64),
            seq_lens=[1] * m,
            extend_lens=[1] * m,
            attn_backend=self.backend,
        )
        recorder = None
        try:
            with cpu_capture.capture() as recorder:
                outputs = self.model.body(self.hidden[:m], self.positions[:m], batch)
            plan = cpu_chain.replay(self.lib, recorder, outputs, m)
        except (cpu_capture.ChainRefused, ValueError) as e:
            # the choices made up to the refusal are the ones that led to it
            low, high = recorder.rows if recorder is not None else (m, m)
            return low, m if high is None else high, str(e)
        return (*plan.serves, plan)

    def _class_of(self, m: int) -> cpu_chain.Replay | str:
        """The replay for m rows (or why m's class is refused), captured at the most rows of
        its class if no capture holds m yet."""
        for low, high, plan in self.classes:
            if low <= m <= high:
                return plan
        # The classes captured so far cover ranges from the top down; capture at the row count
        # just below the nearest one above m (the most rows m's class can have).
        above = [low for low, _, _ in self.classes if low > m]
        at = min(above) - 1 if above else self.max_rows
        while True:
            low, high, plan = self._capture(at)
            self.classes.append((low, min(high, at), plan))
            if low <= m:
                return plan
            at = low - 1

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this forward runs here: up to ``max_rows`` tokens whose body replays."""
        m = batch.input_ids.shape[0]
        return 0 < m <= self.max_rows and not isinstance(self._class_of(m), str)

    @torch.inference_mode()
    def body(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``body`` over the batch's embedded tokens, replayed: (the last layer's
        output, the residual before it), in the chain's arena (read before the next replay)."""
        m = batch.input_ids.shape[0]
        plan = self._class_of(m)
        self.hidden[:m].copy_(self.model.embed(batch.input_ids))
        self.positions[:m].copy_(batch.positions)
        plan.run(batch.attn_metadata, batch.out_cache_loc, m)
        return tuple(t[:m] for t in plan.outputs)

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's float32 logits for the batch (as ``model(batch)`` gives them)."""
        h, residual = self.body(batch)
        idx = batch.logits_indices
        if idx is None:  # a decode batch: every row's, no gather
            idx = slice(None) if batch.mode is ForwardMode.DECODE else batch.last_token_indices()
        return self.model.head(h, residual, idx)
