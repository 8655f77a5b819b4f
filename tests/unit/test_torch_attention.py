"""The reference backend (TorchAttentionBackend: gather + SDPA) vs a naive float64 per-request
reference: decode and extend, over shared and private prefixes, GQA ratios 1 and 3, float32 and
bf16, with and without a sliding window and a logit soft cap (and NaN in the slots a window
dropped). The C kernel's backend has its own tests (test_cpu_attention_kernel.py)."""

from __future__ import annotations

import pytest
import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.cache.kv_pool import KVPool

D = 16
SCALE = D**-0.5
PREFIX = 40  # length of every shared prefix


def _reference(
    q: torch.Tensor,
    pool: KVPool,
    row: int,
    seq_len: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [n, H, D]: the request's last n tokens → [n, H, D] float64, causal, each token within
    ``window`` keys of itself, scores soft-capped at ``softcap``."""
    slots = pool.req_to_token[row, :seq_len]
    g = q.shape[1] // pool.kv_heads
    k = pool.k_buffers[0][slots].double().repeat_interleave(g, 1).transpose(0, 1)  # [H, L, D]
    v = pool.v_buffers[0][slots].double().repeat_interleave(g, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * SCALE  # [H, n, L]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[0]
    keys, pos = torch.arange(seq_len)[None, :], torch.arange(n)[:, None] + seq_len - n
    seen = (keys <= pos) & (keys > pos - (window or seq_len))
    return (s.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def _setup(
    kh: int,
    spec: list[tuple[int, int | None]],
    dtype: torch.dtype = torch.float32,
    consecutive: tuple[int, ...] = (),
):
    """spec: per request (seq_len, id of its shared PREFIX-token prefix or None) → pool, rows.
    Slots are scattered, except that the prefixes named in ``consecutive`` take a run of
    consecutive slots (as a prefix prefilled in one piece does)."""
    torch.manual_seed(0)
    pool = KVPool(4096, 1, kh, D, dtype, 16, 256)  # slots >= 2048: free for the tests' own use
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    free = iter(torch.randperm(2047).add(1).tolist())  # scattered slots, never slot 0
    prefixes: dict[int, list[int]] = {}
    for row, (seq_len, pid) in enumerate(spec):
        new = None
        if pid not in prefixes:
            new = (
                list(range(2100 + 100 * pid, 2100 + 100 * pid + PREFIX))
                if pid in consecutive
                else [next(free) for _ in range(PREFIX)]
            )
        shared = [] if pid is None else prefixes.setdefault(pid, new)
        slots = shared[:seq_len] + [next(free) for _ in range(seq_len - len(shared))]
        pool.req_to_token[row, :seq_len] = torch.tensor(slots)
    return pool, torch.arange(len(spec))


def _run_decode(
    pool: KVPool,
    rows: torch.Tensor,
    seq_lens: list[int],
    h: int,
    tol: float = 1e-5,
    window: int | None = None,
    softcap: float | None = None,
):
    """One decode step against the reference (q drawn 4 times wider under a soft cap)."""
    b, dtype = len(seq_lens), pool.dtype
    out_loc = pool.req_to_token[rows, torch.tensor(seq_lens) - 1]
    q = (torch.randn(b, h, D) * (4 if softcap else 1)).to(dtype)
    k, v = (torch.randn(b, pool.kv_heads, D, dtype=dtype) for _ in range(2))
    batch = ForwardBatch(
        ForwardMode.DECODE,
        torch.zeros(b, dtype=torch.int64),
        torch.tensor(seq_lens) - 1,
        out_loc,
        rows,
        seq_lens,
        [1] * b,
    )
    backend = TorchAttentionBackend(pool)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch, SCALE, window, softcap)
    ref = torch.cat(
        [
            _reference(q[i : i + 1], pool, int(rows[i]), s, window, softcap)
            for i, s in enumerate(seq_lens)
        ]
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return batch.attn_metadata


@pytest.mark.parametrize("kh,h", [(4, 4), (2, 6)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_matches_reference(kh: int, h: int, dtype: torch.dtype, tol: float) -> None:
    # Shared prefixes (0: rows 0, 3, 6; 1: rows 1, 4), a request without one, a prefix of its
    # own, a one-token request, sequences of different lengths.
    spec = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1), (50, 2), (73, 0), (1, None)]
    pool, rows = _setup(kh, spec, dtype)
    _run_decode(pool, rows, [s for s, _ in spec], h, tol)


def _run_extend(
    pool: KVPool,
    seq_lens: list[int],
    extend_lens: list[int],
    h: int,
    tol: float = 1e-5,
    window: int | None = None,
    softcap: float | None = None,
):
    """One extend step against the reference (q drawn 4 times wider under a soft cap)."""
    rows = torch.arange(len(seq_lens))
    out_loc = torch.cat(
        [
            pool.req_to_token[r, s - e : s]
            for r, s, e in zip(range(len(seq_lens)), seq_lens, extend_lens)
        ]
    )
    t, dtype = len(out_loc), pool.dtype
    q = (torch.randn(t, h, D) * (4 if softcap else 1)).to(dtype)
    k, v = (torch.randn(t, pool.kv_heads, D, dtype=dtype) for _ in range(2))
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        torch.zeros(t, dtype=torch.int64),
        torch.zeros(t, dtype=torch.int64),
        out_loc,
        rows,
        seq_lens,
        extend_lens,
    )
    backend = TorchAttentionBackend(pool)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch, SCALE, window, softcap)
    starts = torch.tensor([0] + extend_lens).cumsum(0).tolist()
    ref = torch.cat(
        [
            _reference(q[s : s + e], pool, r, n, window, softcap)
            for s, e, r, n in zip(starts, extend_lens, range(len(seq_lens)), seq_lens)
        ]
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return batch.attn_metadata


@pytest.mark.parametrize("kh,h", [(4, 4), (2, 6)])
def test_extend_matches_reference(kh: int, h: int) -> None:
    pool, _ = _setup(kh, [(30, 0), (45, 0), (17, None)])
    _run_extend(pool, [30, 45, 17], [30, 5, 17], h)  # row 1: a cached prefix


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_over_shared_and_private_prefixes(dtype: torch.dtype, tol: float) -> None:
    """Requests 0, 1 and 5 share a cached prefix, 2 caches a longer one, 3 another; 4 has none;
    one request extends by a single token."""
    spec = [
        (PREFIX + 5, 0),
        (PREFIX + 5, 0),
        (PREFIX + 8, 0),
        (PREFIX + 5, 1),
        (12, None),
        (PREFIX + 1, 0),
    ]
    pool, _ = _setup(2, spec, dtype, consecutive=(1,))
    _run_extend(pool, [s for s, _ in spec], [5, 5, 5, 5, 12, 1], 6, tol)


DECODE_SPEC = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1), (50, 2), (73, 0), (1, None)]
EXTEND_SPEC = [(PREFIX + 5, 0), (PREFIX + 30, 0), (PREFIX + 8, 1), (12, None), (PREFIX + 1, 0)]
EXTEND_LENS = [5, 25, 8, 12, 1]


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 5, 16, 33, 1000])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_windowed_steps_match_reference(dtype, tol, window, softcap) -> None:
    """Decode and extend under windows shorter than the cached prefixes and longer than the
    sequences, with and without a soft cap."""
    pool, rows = _setup(2, DECODE_SPEC, dtype)
    _run_decode(pool, rows, [s for s, _ in DECODE_SPEC], 6, tol, window, softcap)
    pool, _ = _setup(2, EXTEND_SPEC, dtype)
    _run_extend(pool, [s for s, _ in EXTEND_SPEC], EXTEND_LENS, 6, tol, window, softcap)


def test_a_windows_dropped_slots_do_not_reach_the_output() -> None:
    """NaN in the K/V of every slot no token of the step sees under its window: the outputs
    are finite and as they were."""
    pool, rows = _setup(2, EXTEND_SPEC)
    seq_lens = [s for s, _ in EXTEND_SPEC]
    out_loc = torch.cat(
        [pool.req_to_token[r, s - e : s] for r, (s, e) in enumerate(zip(seq_lens, EXTEND_LENS))]
    )
    t = out_loc.numel()
    q, k, v = torch.randn(t, 6, D), torch.randn(t, 2, D), torch.randn(t, 2, D)
    zeros = torch.zeros(t, dtype=torch.int64)
    batch = ForwardBatch(ForwardMode.EXTEND, zeros, zeros, out_loc, rows, seq_lens, EXTEND_LENS)
    backend = TorchAttentionBackend(pool)
    backend.init_forward_metadata(batch)
    want = backend.forward(q, k, v, 0, batch, SCALE, 6, 30.0)
    seen, held = set(), set()
    for r, (n, e) in enumerate(zip(seq_lens, EXTEND_LENS)):
        slots = pool.req_to_token[r, :n].tolist()
        held.update(slots)
        seen.update(slots[max(0, n - e - 5) :])
    dropped = torch.tensor(sorted(held - seen))
    assert dropped.numel() > 20
    pool.k_buffers[0][dropped] = float("nan")
    pool.v_buffers[0][dropped] = float("nan")
    got = backend.forward(q, k, v, 0, batch, SCALE, 6, 30.0)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_attention_op_needs_a_forward_context():
    # A compiled model reaches attention only through radixrt::attention, which reads the
    # step's batch from forward_context; outside one it names the problem.
    from radixrt.attention.base import attention

    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="forward_context"):
        attention(q, q[:, :2], q[:, :2], 0, None, 1.0)
