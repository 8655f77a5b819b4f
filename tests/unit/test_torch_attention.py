"""TorchAttentionBackend vs a naive float64 per-request reference: decode (plain and cascade)
and extend, with GQA ratios 1 and 3. Decode here runs on PyTorch's kernels; the C decode
kernel has its own tests (test_cpu_decode_kernel.py)."""

from __future__ import annotations

import pytest
import torch

import radixrt.attention.torch_backend as torch_backend
from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.cache.kv_pool import KVPool

D = 16
SCALE = D ** -0.5
PREFIX = 40  # length of every shared prefix


@pytest.fixture
def always_cascade(monkeypatch):
    """Take the cascade for every qualifying group, whatever the cost model says."""
    monkeypatch.setattr(torch_backend, "TAIL_COST", 0.0)
    monkeypatch.setattr(torch_backend, "PREFIX_COST", 0.0)


def _reference(q: torch.Tensor, pool: KVPool, row: int, seq_len: int) -> torch.Tensor:
    """q [n, H, D]: the request's last n tokens → [n, H, D] float64, causal."""
    slots = pool.req_to_token[row, :seq_len]
    g = q.shape[1] // pool.kv_heads
    k = pool.k_buffers[0][slots].double().repeat_interleave(g, 1).transpose(0, 1)  # [H, L, D]
    v = pool.v_buffers[0][slots].double().repeat_interleave(g, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * SCALE  # [H, n, L]
    n = q.shape[0]
    causal = torch.arange(seq_len)[None, :] <= torch.arange(n)[:, None] + seq_len - n
    return (s.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def _setup(kh: int, spec: list[tuple[int, int | None]], dtype: torch.dtype = torch.float32,
           consecutive: tuple[int, ...] = ()):
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
            new = (list(range(2100 + 100 * pid, 2100 + 100 * pid + PREFIX)) if pid in consecutive
                   else [next(free) for _ in range(PREFIX)])
        shared = [] if pid is None else prefixes.setdefault(pid, new)
        slots = shared[:seq_len] + [next(free) for _ in range(seq_len - len(shared))]
        pool.req_to_token[row, :seq_len] = torch.tensor(slots)
    return pool, torch.arange(len(spec))


def _run_decode(pool: KVPool, rows: torch.Tensor, seq_lens: list[int], h: int, tol: float = 1e-5):
    b, dtype = len(seq_lens), pool.dtype
    out_loc = pool.req_to_token[rows, torch.tensor(seq_lens) - 1]
    q = torch.randn(b, h, D, dtype=dtype)
    k, v = (torch.randn(b, pool.kv_heads, D, dtype=dtype) for _ in range(2))
    batch = ForwardBatch(ForwardMode.DECODE, torch.zeros(b, dtype=torch.int64),
                         torch.tensor(seq_lens) - 1, out_loc, rows, seq_lens, [1] * b)
    backend = TorchAttentionBackend(pool, use_kernel=False)  # PyTorch's kernels
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch, SCALE)
    ref = torch.cat([_reference(q[i:i + 1], pool, int(rows[i]), s) for i, s in enumerate(seq_lens)])
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return batch.attn_metadata


@pytest.mark.parametrize("kh,h", [(4, 4), (2, 6)])
def test_cascade_decode_matches_reference(kh: int, h: int, always_cascade) -> None:
    # Interleaved in the batch: group 0 (rows 0, 3, 6: different lengths, row 3 is the prefix
    # + 1 token), group 1 (rows 1, 4), a request without prefix, one with a prefix of its own.
    spec = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1), (50, 2), (73, 0)]
    pool, rows = _setup(kh, spec)
    pool.req_to_token[4, 25:90] = torch.arange(3000, 3065)  # group 1 shares only 25 tokens
    meta = _run_decode(pool, rows, [s for s, _ in spec], h)
    groups = sorted((m.tolist(), c) for m, c in meta.groups)
    assert groups == [([0, 3, 6], PREFIX), ([1, 4], 25)]  # cascade used, singletons not


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cascade_decode_reads_consecutive_prefixes_in_place(dtype: torch.dtype, tol: float,
                                                            always_cascade) -> None:
    # One group, its prefix in a run of consecutive slots: attended straight from the buffers.
    spec = [(57, 0), (33, None), (41, 0), (73, 0)]
    pool, rows = _setup(2, spec, dtype, consecutive=(0,))
    meta = _run_decode(pool, rows, [s for s, _ in spec], 6, tol)
    assert meta.prefix.runs == [(2100, PREFIX)]
    # Two groups, both in runs: gathered all the same (one SDPA for both), and still exact.
    spec = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1), (73, 0)]
    pool, rows = _setup(2, spec, dtype, consecutive=(0, 1))
    meta = _run_decode(pool, rows, [s for s, _ in spec], 6, tol)
    assert meta.prefix.runs is None and len(meta.groups) == 2


def test_cascade_decode_bfloat16(always_cascade) -> None:
    spec = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1)]
    pool, rows = _setup(2, spec, torch.bfloat16)
    meta = _run_decode(pool, rows, [s for s, _ in spec], 6, tol=2e-2)
    assert len(meta.groups) == 2


def test_cascade_group_prefix_is_common_part(always_cascade) -> None:
    # Same first slot, but request 2 diverges after 20 tokens: the group's prefix shrinks to 20.
    pool, rows = _setup(2, [(60, 0), (50, 0), (55, 0)])
    pool.req_to_token[2, 20:55] = torch.arange(3000, 3035)
    meta = _run_decode(pool, rows, [60, 50, 55], 6)
    assert [(m.tolist(), c) for m, c in meta.groups] == [([0, 1, 2], 20)]


@pytest.mark.parametrize("spec", [[(40, 0), (40, 0)], [(40, 0), (40, 0), (47, 0)]])
def test_cascade_decode_fully_shared_rows(spec: list, always_cascade) -> None:
    # Rows equal up to seq_len: the prefix is capped at seq_len - 1, so no tail is empty.
    pool, rows = _setup(2, spec)
    meta = _run_decode(pool, rows, [s for s, _ in spec], 6)
    assert [c for _, c in meta.groups] == [PREFIX - 1]
    assert meta.tail.slots.shape[-1] == max(s for s, _ in spec) - (PREFIX - 1)


def test_short_shared_prefix_uses_padded_decode(always_cascade) -> None:
    pool, rows = _setup(2, [(12, 0), (10, 0), (30, None)])  # shares 9 < MIN_SHARED_PREFIX tokens
    meta = _run_decode(pool, rows, [12, 10, 30], 6)
    assert not hasattr(meta, "groups")  # the plain padded path


def test_cost_model_picks_the_path() -> None:
    pool, rows = _setup(2, [(PREFIX + 1, 0)] * 8)  # 8 × (40 shared + 1 private): cascade
    assert hasattr(_run_decode(pool, rows, [PREFIX + 1] * 8, 6), "groups")
    pool, rows = _setup(2, [(250, 0), (240, 0)])  # long private tails: padded SDPA is cheaper
    assert not hasattr(_run_decode(pool, rows, [250, 240], 6), "groups")


def _run_extend(pool: KVPool, seq_lens: list[int], extend_lens: list[int], h: int,
                tol: float = 1e-5):
    rows = torch.arange(len(seq_lens))
    out_loc = torch.cat([pool.req_to_token[r, s - e:s]
                         for r, s, e in zip(range(len(seq_lens)), seq_lens, extend_lens)])
    t, dtype = len(out_loc), pool.dtype
    q = torch.randn(t, h, D, dtype=dtype)
    k, v = (torch.randn(t, pool.kv_heads, D, dtype=dtype) for _ in range(2))
    batch = ForwardBatch(ForwardMode.EXTEND, torch.zeros(t, dtype=torch.int64),
                         torch.zeros(t, dtype=torch.int64), out_loc, rows, seq_lens, extend_lens)
    backend = TorchAttentionBackend(pool)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch, SCALE)
    starts = torch.tensor([0] + extend_lens).cumsum(0).tolist()
    ref = torch.cat([_reference(q[s:s + e], pool, r, n)
                     for s, e, r, n in zip(starts, extend_lens, range(len(seq_lens)), seq_lens)])
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return batch.attn_metadata


@pytest.mark.parametrize("kh,h", [(4, 4), (2, 6)])
def test_extend_matches_reference(kh: int, h: int) -> None:
    pool, _ = _setup(kh, [(30, 0), (45, 0), (17, None)])
    _run_extend(pool, [30, 45, 17], [30, 5, 17], h)  # row 1: a cached prefix


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_shares_identical_cached_prefixes(dtype: torch.dtype, tol: float) -> None:
    """Requests 0, 1 and 5 have the very same cached prefix: one group; 2 (a longer cached
    prefix) and 3 (another prefix) are groups of their own; 4 has none. Runs of equal
    extend lengths: requests 0-3, 4, 5."""
    spec = [(PREFIX + 5, 0), (PREFIX + 5, 0), (PREFIX + 8, 0), (PREFIX + 5, 1), (12, None),
            (PREFIX + 5, 0)]
    pool, _ = _setup(2, spec, dtype)
    meta = _run_extend(pool, [s for s, _ in spec], [5, 5, 5, 5, 12, 5], 6, tol)
    assert meta.runs == [(0, 4, 5), (20, 1, 12), (32, 1, 5)]
    assert sorted(len(tokens) for tokens, _ in meta.prefix_groups) == [5, 5, 15]
    assert sorted(len(slots) for _, slots in meta.prefix_groups) == [PREFIX, PREFIX, PREFIX + 3]


def test_extend_reads_a_consecutive_prefix_in_place() -> None:
    # Prefix 0 in consecutive slots (read in place), prefix 1 scattered (gathered).
    spec = [(PREFIX + 5, 0), (PREFIX + 5, 0), (PREFIX + 7, 1), (9, None)]
    pool, _ = _setup(2, spec, consecutive=(0,))
    meta = _run_extend(pool, [s for s, _ in spec], [5, 5, 7, 9], 6)
    slots = sorted((s if isinstance(s, tuple) else len(s) for _, s in meta.prefix_groups), key=str)
    assert slots == [(2100, PREFIX), PREFIX]


@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True)])
def test_sdpa_lse_math_matches_the_cpu_kernel(causal: bool, masked: bool) -> None:
    """The float32 fallback (the torch backend on other devices) agrees with the flash kernel."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 7, D), torch.randn(2, 2, 7, D), torch.randn(2, 2, 7, D)
    bias = None
    if masked:
        bias = torch.zeros(2, 1, 1, 7)
        bias[0, ..., 5:] = float("-inf")
    o, lse = torch_backend._sdpa_lse(q, k, v, SCALE, causal, bias)
    o_ref, lse_ref = torch_backend._sdpa_lse_math(q, k, v, SCALE, causal, bias)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_attention_op_needs_a_forward_context():
    # A compiled model reaches attention only through radixrt::attention, which reads the
    # step's batch from forward_context; outside one it names the problem.
    from radixrt.attention.base import attention
    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="forward_context"):
        attention(q, q[:, :2], q[:, :2], 0, None, 1.0)
