"""Small forwards as one C call: the model's decoder layers captured and replayed as a chain.

In eager mode a decoder layer makes several kernel calls (norms, linears,
rotary, attention), each through a Python wrapper, ctypes and an OpenMP team of
its own; for a forward of a few rows those fixed costs are of the order of
streaming a small layer's weights. A ``DecodeChain`` runs the model's ``body``
(its decoder layers, exactly as the model file writes them) once per row count
under ``capture.capture``: the CPU kernels' wrappers note their calls
instead of computing, and ``chain.replay`` turns the notes into one chain,
one call and one thread team with a barrier between steps. A forward of up to
``max_rows`` tokens (a decode batch, or a few new tokens after a cached prefix)
is then the model's ``embed``, the replay, and the model's ``head``.

Nothing here knows what a layer computes. The replay runs the calls the
layers made, with the kernels they chose for that row count, so its logits
equal the layer-by-layer forward's bit for bit. A body that does anything a
chain cannot replay (an operation on PyTorch's kernels, a kernel without a
chain step) is refused when captured, with the reason; those forwards run
layer by layer.
"""

from __future__ import annotations

import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.model.calibrate import THRESHOLD
from radixrt_kernels.cpu import capture as cpu_capture
from radixrt_kernels.cpu import chain as cpu_chain


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
    """The model's forwards of up to ``max_rows`` tokens, each row count's body captured once
    and replayed (see the module's text). The constructor captures ``max_rows`` rows and
    raises ``capture.ChainRefused`` where the body cannot be replayed."""

    def __init__(self, model, backend, lib, max_rows: int = THRESHOLD) -> None:
        self.model, self.backend, self.lib, self.max_rows = model, backend, lib, max_rows
        ids = torch.zeros(max_rows, dtype=torch.int64)
        self.hidden = model.embed(ids).clone()  # the body's input, [max_rows, hidden]
        self.positions = torch.zeros(max_rows, dtype=torch.int64)
        self.plans: dict[int, cpu_chain.Replay | str] = {}  # str: why that row count is refused
        self.kernels = self._capture(max_rows).kernels

    def describe(self) -> str:
        return f"{', '.join(self.kernels)}, forwards of up to {self.max_rows} tokens"

    def _capture(self, m: int) -> cpu_chain.Replay:
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
        with cpu_capture.capture() as recorder:
            outputs = self.model.body(self.hidden[:m], self.positions[:m], batch)
        self.plans[m] = plan = cpu_chain.replay(self.lib, recorder, outputs)
        return plan

    def _plan(self, m: int) -> cpu_chain.Replay | None:
        if m not in self.plans:
            try:
                self._capture(m)
            except (cpu_capture.ChainRefused, ValueError) as e:
                self.plans[m] = str(e)
        plan = self.plans[m]
        return None if isinstance(plan, str) else plan

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this forward runs here: up to ``max_rows`` tokens whose body replays."""
        m = batch.input_ids.shape[0]
        return m <= self.max_rows and self._plan(m) is not None

    @torch.inference_mode()
    def body(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``body`` over the batch's embedded tokens, replayed: (the last layer's
        output, the residual before it), in the chain's arena (read before the next replay)."""
        m = batch.input_ids.shape[0]
        plan = self._plan(m)
        self.hidden[:m].copy_(self.model.embed(batch.input_ids))
        self.positions[:m].copy_(batch.positions)
        plan.run(batch.attn_metadata, batch.out_cache_loc)
        return plan.outputs

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's float32 logits for the batch (as ``model(batch)`` gives them)."""
        h, residual = self.body(batch)
        idx = batch.logits_indices
        if idx is None:  # a decode batch: every row's, no gather
            idx = slice(None) if batch.mode is ForwardMode.DECODE else batch.last_token_indices()
        return self.model.head(h, residual, idx)
