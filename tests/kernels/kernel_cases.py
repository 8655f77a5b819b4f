"""Random ragged batches for the kernel tests, and the comparison they share.

Inputs are drawn fresh in each test from a generator seeded by the test's node
id (plus ``RADIXRT_KERNEL_SEED``, default 0, to draw other inputs), so a run is
reproducible and every failure message names its seed. KV slots are a random
permutation of the buffer rows, so requests' slots are scattered and never
contiguous. Shapes are kept small: the interpreter is ~700x slower than torch.
"""

from __future__ import annotations

import os
import zlib
from typing import NamedTuple

import pytest
import torch

from radixrt_kernels.triton import INTERPRET

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) of a kernel against the fp32 reference rounded to the dtype.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def make_generator(request: pytest.FixtureRequest) -> tuple[torch.Generator, int]:
    seed = (
        zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("RADIXRT_KERNEL_SEED", "0"))
    ) % 2**31
    return torch.Generator().manual_seed(seed), seed


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


class PagedKV(NamedTuple):
    k_buffer: torch.Tensor  # [num_slots, KH, D]
    v_buffer: torch.Tensor
    indptr: torch.Tensor  # [B + 1]
    indices: torch.Tensor  # [sum(lens)] scattered slots


def paged_kv(
    gen: torch.Generator,
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int64,
    spare: int = 7,
) -> PagedKV:
    """Buffers with ``spare`` more rows than needed, and the slots of sequences of ``lens``."""
    num_slots = sum(lens) + spare
    k_buffer = randn(gen, num_slots, kv_heads, head_dim, dtype=dtype)
    v_buffer = randn(gen, num_slots, kv_heads, head_dim, dtype=dtype)
    indices = torch.randperm(num_slots, generator=gen)[: sum(lens)]
    return PagedKV(
        k_buffer, v_buffer, indptr(lens, index_dtype), indices.to(index_dtype).to(DEVICE)
    )


def indptr(lens: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0).to(dtype=dtype, device=DEVICE)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, seed: int) -> None:
    """Every element written (no NaN left from the poison) and within the dtype's tolerance."""
    assert out.dtype == ref.dtype
    unwritten = int(torch.isnan(out).sum())
    assert unwritten == 0, f"seed {seed}: {unwritten} of {out.numel()} output elements not written"
    atol, rtol = TOLERANCE[out.dtype]
    err = (out.float() - ref.float()).abs().max().item()
    rel = err / max(ref.float().abs().max().item(), 1e-6)
    torch.testing.assert_close(
        out.float(),
        ref.float(),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"seed {seed}: max abs err {err:.3g}, rel {rel:.3g}\n{m}",
    )


def assert_rejects(kernel, args: dict, name: str, replace, arg: str, checks_values: bool) -> None:
    """``kernel(**args)`` with ``args[name] = replace(args)`` raises a ValueError naming
    ``arg`` first. A case that only breaks index values (``checks_values``) runs on CPU only:
    the wrappers check values only there, where it costs no device sync."""
    if checks_values and DEVICE.type != "cpu":
        pytest.skip("index values are checked only for CPU tensors")
    args[name] = replace(args)
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        kernel(**args)
