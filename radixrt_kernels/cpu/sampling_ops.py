"""The sampling steps on the CPU, one C call each (``sampling.c``).

``argmax`` (greedy sampling): PyTorch's CPU argmax over a decode step's logits
costs many times what reading them does. ``apply_token_bitmask`` (structured
outputs) sets the logits a grammar forbids to -inf from xgrammar's bitmask.
Tensors are on the CPU (``usable``: float32 or bfloat16 for ``argmax``); the
library comes from ``library.load``.
"""

from __future__ import annotations

import ctypes

import torch

from radixrt_kernels.cpu.elementwise import check_rc, dtype_flag, usable

__all__ = ["apply_token_bitmask", "argmax", "usable"]


def argmax(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [B, N] (rows may be strided): int64 [B], the first index on ties and
    the first NaN where there is one, as PyTorch's."""
    b, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(b, dtype=torch.int64)
    check_rc(
        lib.radixrt_argmax(
            x.data_ptr(),
            b,
            n,
            x.stride(0),
            dtype_flag(x, "argmax"),
            out.data_ptr(),
            torch.get_num_threads(),
        ),
        "argmax",
    )
    return out


def apply_token_bitmask(
    lib: ctypes.CDLL, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[rows[i]] is 0 (logits [B, V]
    float32 with unit column stride; bitmask int32 [B, ceil(V / 32)], xgrammar's layout; rows
    int64). The other rows are not touched."""
    b, vocab = logits.shape
    if not (
        logits.dtype == torch.float32
        and logits.stride(1) == 1
        and bitmask.dtype == torch.int32
        and bitmask.is_contiguous()
        and bitmask.shape[0] >= b
        and rows.dtype == torch.int64
        and rows.is_contiguous()
        and (rows.numel() == 0 or 0 <= int(rows.min()) and int(rows.max()) < b)
    ):
        raise ValueError(
            "apply_token_bitmask: float32 logits [B, V], int32 bitmask [B, W], int64 rows < B"
        )
    check_rc(
        lib.radixrt_apply_token_bitmask(
            logits.data_ptr(),
            logits.stride(0),
            bitmask.data_ptr(),
            bitmask.shape[1],
            rows.data_ptr(),
            rows.numel(),
            vocab,
            torch.get_num_threads(),
        ),
        "apply_token_bitmask",
    )
