"""A mixture-of-experts block's routed experts in one C call (``moe.c``), on bf16 weights packed
by ``linear.pack`` (gate_up ``gated``).

``Experts(lib, gate_up, down, intermediate, gate_up_kernels, down_kernels, threshold)`` holds
each expert's packed [gate; up] weight [2I, H] and down weight [H, I] and the linear kernels
(``linear.KERNELS``) each runs: ``(small, large)``, the first for an expert's calls of up to
``threshold`` rows. ``experts(x, ids, weights)`` gives, for x [T, H] (bf16), each token's experts
ids [T, k] (int64, rank order) and weights [T, k] (bf16 or float32), [T, H] bf16:
Σ_r weights[t, r] · down(silu(x·gateᵀ)·(x·upᵀ)) of expert ids[t, r], with the bits of one
``linear.linear`` call per expert over its tokens (gated, then plain), each token's products
``outputs · weights`` in PyTorch's promoted dtype, added in float32 in rank order and rounded
to bf16 once. H and I must be multiples of 32.
"""

from __future__ import annotations

import ctypes

import torch

from radixrt_kernels.cpu import capture as cpu_capture
from radixrt_kernels.cpu import linear as cpu_linear

KERNEL_IDS = {"fma": 0, "avx512_bf16": 1, "amx": 2}  # moe.c's kernel numbers


class Experts:
    """The experts' weights and kernels, fixed when built (see the module's text)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        gate_up: list[torch.Tensor],
        down: list[torch.Tensor],
        intermediate: int,
        gate_up_kernels: tuple[str, str],
        down_kernels: tuple[str, str],
        threshold: int,
    ) -> None:
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError("moe: one gate_up and one down weight per expert")
        self.hidden = gate_up[0].numel() // (2 * intermediate)
        h, i = self.hidden, intermediate
        if h % 32 or i % 32 or h * 2 * i != gate_up[0].numel():
            raise ValueError(f"moe: hidden {h} and intermediate {i} must be multiples of 32")
        for g, d in zip(gate_up, down):
            if g.numel() != 2 * i * h or d.numel() != h * i or g.dtype != torch.bfloat16:
                raise ValueError(
                    f"moe: expert weights must be packed bf16 [{2 * i}, {h}], [{h}, {i}]"
                )
        for name in (*gate_up_kernels, *down_kernels):
            if not cpu_linear.kernel_available(lib, name):
                raise ValueError(f"moe: the {name!r} linear kernel does not run here")
        self.lib, self.intermediate, self.threshold = lib, i, threshold
        self.weights = (gate_up, down)  # kept alive: the tables hold their addresses
        self.gate_up = torch.tensor([w.data_ptr() for w in gate_up], dtype=torch.int64)
        self.down = torch.tensor([w.data_ptr() for w in down], dtype=torch.int64)
        ids = [KERNEL_IDS[n] for n in (*gate_up_kernels, *down_kernels)]
        self.kernels = torch.tensor(ids, dtype=torch.int32)
        # radixrt_moe's arguments from the experts' count on, but the thread count
        self.fixed = (len(gate_up), self.gate_up.data_ptr(), self.down.data_ptr(), h, i)
        self.fixed += (self.kernels.data_ptr(), threshold)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if (recorder := cpu_capture.capturing()) is not None:
            recorder.refuse("the mixture-of-experts block's experts")
        t, h = x.shape
        if (
            x.dtype != torch.bfloat16
            or h != self.hidden
            or x.stride(1) != 1
            or ids.dtype != torch.int64
            or ids.dim() != 2
            or ids.shape[0] != t
            or weights.shape != ids.shape
            or weights.dtype not in (torch.bfloat16, torch.float32)
        ):
            raise ValueError(
                f"moe: needs bf16 x [T, {self.hidden}] with contiguous rows, int64 ids [T, k] and "
                f"bf16 or float32 weights [T, k]; got x {x.dtype} {tuple(x.shape)}, ids "
                f"{ids.dtype} {tuple(ids.shape)}, weights {weights.dtype} {tuple(weights.shape)}"
            )
        ids, weights = ids.contiguous(), weights.contiguous()
        if x.stride(0) < h:
            x = x.contiguous()
        out = torch.empty(t, h, dtype=torch.bfloat16)
        rc = self.lib.radixrt_moe(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            h,
            t,
            ids.shape[1],
            ids.data_ptr(),
            weights.data_ptr(),
            weights.dtype == torch.float32,
            *self.fixed,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"moe: the kernel does not take x {tuple(x.shape)}, ids {tuple(ids.shape)} "
                f"(an expert id out of range of {len(self.gate_up)}?)"
            )
        return out
