"""The C attention kernel (radixrt_kernels.cpu.attention) through the cpu backend, against a
float64 per-request reference. Decode: shared prefixes read once per group, private tails,
requests in no group, row blocks over 32 rows. Extend: causal segments over cached prefixes and
new tokens, with row blocks that end inside a key block. GQA ratios, head dims, fp32 and bf16.
Sliding windows (shorter than the cached prefixes, longer than the sequences) and logit
soft-capping on every path, and a window's dropped slots never read (NaN there changes
nothing)."""

from __future__ import annotations

import pytest
import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.attention.cpu_backend import (
    MIN_GROUP_SIZE,
    MIN_SHARED_PREFIX,
    SPLIT_MIN_KEYS,
    CpuAttentionBackend,
)
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.cache.kv_pool import KVPool
from radixrt.model.runner import make_attention_backend
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import attention as cpu_kernel
from radixrt_kernels.cpu import library as cpu_library

PREFIX = 40

pytestmark = pytest.mark.skipif(
    cpu_library.compiler() is None,
    reason="no C compiler: the CPU attention kernel cannot be built here",
)


def _pool(kh: int, d: int, spec: list[tuple[int, int | None]], dtype: torch.dtype) -> KVPool:
    """spec: per request (seq_len, id of its shared PREFIX-token prefix or None); scattered
    slots."""
    torch.manual_seed(0)
    pool = KVPool(4096, 1, kh, d, dtype, len(spec), 512)
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    free = iter(torch.randperm(4095).add(1).tolist())
    prefixes: dict[int, list[int]] = {}
    for row, (seq_len, pid) in enumerate(spec):
        shared = (
            [] if pid is None else prefixes.setdefault(pid, [next(free) for _ in range(PREFIX)])
        )
        slots = shared[:seq_len] + [next(free) for _ in range(seq_len - len(shared[:seq_len]))]
        pool.req_to_token[row, :seq_len] = torch.tensor(slots)
    return pool


def _backend(pool: KVPool, use_kernel: bool | None, dots: bool | None = None):
    """True: the C kernel's backend (``dots``: its bf16 path, None: the measured one); False:
    the reference backend; None: as "auto" picks."""
    if use_kernel is None:
        return make_attention_backend("auto", pool)
    return CpuAttentionBackend(pool, bf16_dots=dots) if use_kernel else TorchAttentionBackend(pool)


def _reference(
    pool: KVPool,
    row: int,
    n: int,
    q: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Float64 attention of q [e, H, D], the last e tokens of request ``row`` (of n keys),
    causal, within ``window`` keys of each token, scores soft-capped at ``softcap`` → [e, H, D].
    Reads the pool after the forward stored the new K/V."""
    d, e, g = pool.head_dim, q.shape[0], q.shape[1] // pool.kv_heads
    slots = pool.req_to_token[row, :n]
    kk = pool.k_buffers[0][slots].double().repeat_interleave(g, 1).transpose(0, 1)  # [H, L, D]
    vv = pool.v_buffers[0][slots].double().repeat_interleave(g, 1).transpose(0, 1)
    s = (q.double().transpose(0, 1) @ kk.transpose(1, 2)) * d**-0.5  # [H, e, L]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    keys, pos = torch.arange(n)[None, :], torch.arange(n - e, n)[:, None]
    seen = (keys <= pos) & (keys > pos - (window or n))
    return (s.masked_fill(~seen, float("-inf")).softmax(-1) @ vv).transpose(0, 1)


def _decode(
    pool: KVPool,
    seq_lens: list[int],
    h: int,
    use_kernel: bool,
    dots: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """One decode step (``window``, ``softcap``: the layer's; ``q_scale``: q's spread) → (out,
    the float64 reference, the step's attention metadata)."""
    b, d = len(seq_lens), pool.head_dim
    rows = torch.arange(b)
    out_loc = pool.req_to_token[rows, torch.tensor(seq_lens) - 1]
    q = (torch.randn(b, h, d) * q_scale).to(pool.dtype)
    k, v = (torch.randn(b, pool.kv_heads, d, dtype=pool.dtype) for _ in range(2))
    batch = ForwardBatch(
        ForwardMode.DECODE,
        torch.zeros(b, dtype=torch.int64),
        torch.tensor(seq_lens) - 1,
        out_loc,
        rows,
        seq_lens,
        [1] * b,
    )
    backend = _backend(pool, use_kernel, dots)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch, d**-0.5, window, softcap)
    ref = [_reference(pool, i, n, q[i : i + 1], window, softcap) for i, n in enumerate(seq_lens)]
    return out, torch.cat(ref), batch.attn_metadata


def _extend(
    pool: KVPool,
    seq_lens: list[int],
    ext_lens: list[int],
    h: int,
    use_kernel: bool,
    dots: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """Each request's last ext_lens tokens are new; the rest is its cached prefix (the other
    arguments: as ``_decode``'s)."""
    d, t = pool.head_dim, sum(ext_lens)
    rows = torch.arange(len(seq_lens))
    out_loc = torch.cat(
        [pool.req_to_token[i, n - e : n] for i, (n, e) in enumerate(zip(seq_lens, ext_lens))]
    )
    q = (torch.randn(t, h, d) * q_scale).to(pool.dtype)
    k, v = (torch.randn(t, pool.kv_heads, d, dtype=pool.dtype) for _ in range(2))
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        torch.zeros(t, dtype=torch.int64),
        torch.zeros(t, dtype=torch.int64),
        out_loc,
        rows,
        seq_lens,
        ext_lens,
    )
    backend = _backend(pool, use_kernel, dots)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch, d**-0.5, window, softcap)
    starts = [0, *torch.tensor(ext_lens).cumsum(0).tolist()]
    ref = [
        _reference(pool, i, n, q[starts[i] : starts[i + 1]], window, softcap)
        for i, n in enumerate(seq_lens)
    ]
    return out, torch.cat(ref), batch.attn_metadata


# dtype, tolerance, the bf16 path (float32 FMA or AVX512-BF16 dot products, where built)
PATHS = [(torch.float32, 1e-5, None), (torch.bfloat16, 2e-2, False), (torch.bfloat16, 2e-2, True)]
SPEC = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1), (50, 2), (73, 0), (1 + PREFIX, 0)]
# Extend: (seq_len, prefix id) and new tokens; a prompt without prefix, one new token after a
# prefix, 37 new tokens (111 query rows per KV head at G 3: blocks of 32 rows ending mid-block).
EXTEND = [(57, 0), (45, 1), (33, None), (41, 0), (90, 1)]
EXTEND_LENS = [17, 5, 33, 1, 37]


@pytest.mark.parametrize("dtype,tol,dots", PATHS)
@pytest.mark.parametrize("kh,h,d", [(2, 6, 64), (4, 4, 32), (1, 8, 128), (3, 9, 96)])
def test_kernel_matches_reference(
    dtype: torch.dtype, tol: float, dots: bool | None, kh: int, h: int, d: int
) -> None:
    # Groups 0 (4 requests, one of them the prefix + 1 token) and 1 (2 requests), a request
    # without prefix and one alone with its prefix: all through the kernel, in one call.
    pool = _pool(kh, d, SPEC, dtype)
    out, ref, meta = _decode(pool, [s for s, _ in SPEC], h, use_kernel=True, dots=dots)
    assert isinstance(meta, cpu_kernel.Segments)
    assert meta.part.numel() == 2 + len(SPEC)  # two shared prefixes + every request's own keys
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol,dots", PATHS)
def test_a_lone_long_request_is_split_between_the_threads(
    dtype: torch.dtype, tol: float, dots: bool | None
) -> None:
    # One request, 2 KV heads: 2 work items for 2 threads, so a sequence of SPLIT_MIN_KEYS keys
    # or more has them in two halves (two parts, merged in the same call); a shorter one not.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        n = SPLIT_MIN_KEYS + 45
        pool = _pool(2, 64, [(n, None)], dtype)
        out, ref, meta = _decode(pool, [n], 6, use_kernel=True, dots=dots)
        assert meta.num_parts.tolist() == [2] and meta.part.tolist() == [0, 1]
        assert meta.slot_start.tolist() == [0, n // 2, n]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        pool = _pool(2, 64, [(SPLIT_MIN_KEYS - 1, None)] * 2, dtype)
        out, ref, meta = _decode(pool, [SPLIT_MIN_KEYS - 1] * 2, 6, use_kernel=True, dots=dots)
        assert meta.num_parts.tolist() == [1, 1]  # too short, and 4 work items already
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


def test_decode_segments_split_only_lone_requests_from_split_from() -> None:
    lib = cpu_library.load(cache_dir())
    table = torch.arange(4 * 128, dtype=torch.int64).view(4, 128) + 1000
    table[1, :40] = table[0, :40]  # requests 0 and 1 share 40 slots: a group
    lens = [60, 70, 100, 10]
    seg = cpu_kernel.decode_segments(
        lib, table, torch.arange(4), lens, MIN_SHARED_PREFIX, MIN_GROUP_SIZE, split_from=64
    )
    got = [
        (
            seg.slots[seg.slot_start[s] : seg.slot_start[s + 1]].tolist(),
            seg.members[seg.member_start[s] : seg.member_start[s + 1]].tolist(),
            int(seg.part[s]),
        )
        for s in range(seg.part.numel())
    ]
    rows = table.tolist()
    # the group's prefix is not split (it is over 64 slots with the tails); request 2 is alone
    # with 100 slots: two halves; request 3 alone, under split_from
    assert got == [
        (rows[0][:40], [0, 1], 0),
        (rows[0][40:60], [0], 1),
        (rows[1][40:70], [1], 1),
        (rows[2][:50], [2], 0),
        (rows[2][50:100], [2], 1),
        (rows[3][:10], [3], 0),
    ]
    assert seg.num_parts.tolist() == [2, 2, 2, 1] and seg.two_parts


@pytest.mark.parametrize("dtype,tol,dots", PATHS)
def test_kernel_large_group_and_single_request(
    dtype: torch.dtype, tol: float, dots: bool | None
) -> None:
    # 13 requests × 3 query heads per KV head = 39 rows: a block of 32 query rows (two AMX row
    # tiles in bf16) and one of 7; shared prefix and tails of 70+ keys: odd block ends.
    spec = [(PREFIX + 1 + 3 * i, 0) for i in range(13)]
    spec[0] = (PREFIX + 1 + 90, 0)
    pool = _pool(2, 64, spec, dtype)
    out, ref, meta = _decode(pool, [s for s, _ in spec], 6, use_kernel=True, dots=dots)
    assert meta.num_parts.tolist() == [2] * 13
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    pool = _pool(2, 64, [(3, None)], dtype)  # one request, three keys
    out, ref, _ = _decode(pool, [3], 6, use_kernel=True, dots=dots)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol,dots", PATHS)
@pytest.mark.parametrize("kh,h,d", [(3, 9, 64), (1, 8, 128), (4, 4, 32)])
def test_extend_kernel_matches_reference(
    dtype: torch.dtype, tol: float, dots: bool | None, kh: int, h: int, d: int
) -> None:
    pool = _pool(kh, d, EXTEND, dtype)
    out, ref, meta = _extend(
        pool, [s for s, _ in EXTEND], EXTEND_LENS, h, use_kernel=True, dots=dots
    )
    assert isinstance(meta, cpu_kernel.Segments) and meta.causal.tolist() == [1] * len(EXTEND)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_extend_kernel_agrees_with_pytorch_kernels() -> None:
    pool = _pool(3, 64, EXTEND, torch.float32)
    torch.manual_seed(1)
    kernel, _, _ = _extend(pool, [s for s, _ in EXTEND], EXTEND_LENS, 9, use_kernel=True)
    torch.manual_seed(1)
    plain, _, meta = _extend(pool, [s for s, _ in EXTEND], EXTEND_LENS, 9, use_kernel=False)
    assert not isinstance(meta, cpu_kernel.Segments)
    torch.testing.assert_close(kernel, plain, atol=1e-5, rtol=1e-5)


def test_kernel_agrees_with_pytorch_kernels() -> None:
    pool = _pool(2, 64, SPEC, torch.float32)
    torch.manual_seed(1)
    kernel, _, _ = _decode(pool, [s for s, _ in SPEC], 6, use_kernel=True)
    torch.manual_seed(1)
    plain, _, meta = _decode(pool, [s for s, _ in SPEC], 6, use_kernel=False)
    assert not isinstance(meta, cpu_kernel.Segments)
    torch.testing.assert_close(kernel, plain, atol=1e-5, rtol=1e-5)


def test_unsupported_head_dim_falls_back() -> None:
    pool = _pool(2, 16, SPEC, torch.float32)  # head_dim 16: not a multiple of 32
    out, ref, meta = _decode(pool, [s for s, _ in SPEC], 6, use_kernel=None)
    assert not isinstance(meta, cpu_kernel.Segments)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_build_failure_is_reported_and_falls_back(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cpu_library, "_tried", False)
    monkeypatch.setattr(cpu_library, "_lib", None)
    monkeypatch.setattr(cpu_library, "_why", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_library.load(str(tmp_path / "cache")) is None
    assert "no-such-compiler" in cpu_library.why_unavailable()
    pool = _pool(2, 64, SPEC, torch.float32)
    with pytest.raises(RuntimeError, match="attention_backend='cpu' cannot run.*no-such-compiler"):
        CpuAttentionBackend(pool)
    out, ref, meta = _decode(pool, [s for s, _ in SPEC], 6, use_kernel=None)  # PyTorch's kernels
    assert not isinstance(meta, cpu_kernel.Segments)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _same_in_both_builds(lib, q: torch.Tensor, pool: KVPool, seg) -> None:
    """lib's results, on either bf16 path, equal this machine's build's (within bf16)."""
    want = cpu_kernel.attention(
        cpu_library.load(cache_dir()), q, pool.k_buffers[0], pool.v_buffers[0], seg, 0.125
    )
    for dots in (False, True):
        got = cpu_kernel.attention(
            lib, q, pool.k_buffers[0], pool.v_buffers[0], seg, 0.125, bf16_dots=dots
        )
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "flags", [["-mno-amx-tile"], ["-mno-avx512bf16"], ["-mno-avx512f"], ["-mno-avx"]]
)
def test_kernel_builds_for_cpus_without_amx_or_avx512(
    flags: list[str], monkeypatch, tmp_path
) -> None:
    """The other paths, as built on CPUs without AMX (AVX512-BF16 for every item), without
    AVX512-BF16 (bf16 converted to float32), without AVX-512 or without AVX: same results."""
    monkeypatch.setattr(cpu_library, "CFLAGS", [*cpu_library.CFLAGS, *flags])
    lib = cpu_library._build_and_load(tmp_path)
    pool = _pool(2, 64, SPEC, torch.bfloat16)
    seq_lens = [s for s, _ in SPEC]
    *_, seg = _decode(pool, seq_lens, 6, use_kernel=True)  # the batch's segments
    torch.manual_seed(2)
    q = torch.randn(len(SPEC), 6, 64).bfloat16()
    _same_in_both_builds(lib, q, pool, seg)
    # extend: causal segments (masked per row in every path)
    pool = _pool(3, 64, EXTEND, torch.bfloat16)
    *_, seg = _extend(pool, [s for s, _ in EXTEND], EXTEND_LENS, 9, use_kernel=True)
    q = torch.randn(sum(EXTEND_LENS), 9, 64).bfloat16()
    _same_in_both_builds(lib, q, pool, seg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_q_k_v_as_views_of_a_fused_qkv(dtype: torch.dtype) -> None:
    """q, k and v as the model passes them (views into one [T, (H + 2·KH)·D] tensor, token rows
    strided) give what contiguous copies give, and store the same K/V."""
    seq_lens = [s for s, _ in EXTEND]
    runs = []
    for views in (True, False):
        pool = _pool(3, 64, EXTEND, dtype)
        torch.manual_seed(3)
        t = sum(EXTEND_LENS)
        qkv = torch.randn(t, 15 * 64).to(dtype)
        q, k, v = (x.view(t, -1, 64) for x in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
        if not views:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out_loc = torch.cat(
            [pool.req_to_token[i, n - e : n] for i, (n, e) in enumerate(zip(seq_lens, EXTEND_LENS))]
        )
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            torch.zeros(t, dtype=torch.int64),
            torch.zeros(t, dtype=torch.int64),
            out_loc,
            torch.arange(len(seq_lens)),
            seq_lens,
            EXTEND_LENS,
        )
        backend = CpuAttentionBackend(pool)
        backend.init_forward_metadata(batch)
        runs.append(
            (
                backend.forward(q, k, v, 0, batch, 0.125),
                pool.k_buffers[0].clone(),
                pool.v_buffers[0].clone(),
            )
        )
    for got, want in zip(*runs):
        assert torch.equal(got, want)


# Sliding windows: shorter than every cached prefix (and than the 40-key shared prefixes), and
# longer than every sequence; soft caps: none and 30 (q drawn 8 times wider, so it bites).
WINDOWS = [None, 5, 16, 33, 1000]
SOFTCAPS = [None, 30.0]
LONG = [(300, None), (57, 0), (45, 1), (41, 0), (90, 1), (73, 0), (41, 1)]  # decode, with groups


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype,tol,dots", PATHS)
def test_windowed_decode_matches_reference(dtype, tol, dots, window, softcap) -> None:
    """Decode rows in groups sharing a prefix (AMX takes a group's rows in bf16 here) and alone,
    under a window and a soft cap: the reference's results."""
    pool = _pool(2, 64, LONG, dtype)
    out, ref, meta = _decode(pool, [s for s, _ in LONG], 6, True, dots, window, softcap, 8.0)
    assert meta.two_parts  # shared prefixes: a window starts in a prefix or in a tail
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype,tol,dots", PATHS)
def test_windowed_extend_matches_reference(dtype, tol, dots, window, softcap) -> None:
    """Extends after cached prefixes longer than the window, in row blocks (32 rows; 64 with
    AMX) whose rows' windows start in different key blocks."""
    pool = _pool(3, 64, EXTEND, dtype)
    seq_lens = [s for s, _ in EXTEND]
    out, ref, _ = _extend(pool, seq_lens, EXTEND_LENS, 9, True, dots, window, softcap, 8.0)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_the_window_and_the_soft_cap_change_the_reference() -> None:
    """The cases above can fail: the reference with a window or a soft cap is not without."""
    pool = _pool(2, 64, LONG, torch.float32)
    lens = [s for s, _ in LONG]
    runs = {}
    for window, softcap in ((None, None), (16, None), (None, 30.0)):
        torch.manual_seed(5)
        runs[window, softcap] = _decode(pool, lens, 6, True, None, window, softcap, 8.0)[1]
    base = runs[None, None]
    assert (runs[16, None] - base).abs().max() > 0.1
    assert (runs[None, 30.0] - base).abs().max() > 0.1


@pytest.mark.parametrize("window", [16, 200])
@pytest.mark.parametrize("dtype,tol,dots", PATHS)
def test_a_windowed_lone_request_split_between_the_threads(dtype, tol, dots, window) -> None:
    """A lone long request's keys in two halves (two parts, merged): a window inside the second
    half leaves the first without a visible key; a longer one spans both."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        n = SPLIT_MIN_KEYS + 45
        pool = _pool(2, 64, [(n, None)], dtype)
        out, ref, meta = _decode(pool, [n], 6, True, dots, window, 30.0, 8.0)
        assert meta.num_parts.tolist() == [2] and meta.key_start.tolist() == [0, n // 2]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


def _dropped_slots(pool: KVPool, seq_lens: list[int], ext_lens: list[int], window: int) -> list:
    """The slots of the batch's requests that no token of the step sees under the window (a
    slot shared by several requests only where none sees it)."""
    seen, held = set(), set()
    for row, (n, e) in enumerate(zip(seq_lens, ext_lens)):
        slots = pool.req_to_token[row, :n].tolist()
        held.update(slots)
        seen.update(slots[max(0, n - e + 1 - window) :])
    return sorted(held - seen)


def _step(backend, pool, seq_lens, ext_lens, q, kv, window):
    """One step (extend, or decode when every extend_len is 1) with the given q and new k, v."""
    rows = torch.arange(len(seq_lens))
    mode = ForwardMode.DECODE if set(ext_lens) == {1} else ForwardMode.EXTEND
    out_loc = torch.cat(
        [pool.req_to_token[i, n - e : n] for i, (n, e) in enumerate(zip(seq_lens, ext_lens))]
    )
    t = out_loc.numel()
    zeros = torch.zeros(t, dtype=torch.int64)
    batch = ForwardBatch(mode, zeros, zeros, out_loc, rows, seq_lens, ext_lens)
    backend.init_forward_metadata(batch)
    return backend.forward(q, *kv, 0, batch, 0.125, window, 30.0)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize(
    "dtype,dots", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_a_windows_dropped_slots_are_never_read(dtype, dots, exact) -> None:
    """NaN in the K/V of every slot outside the step's windows (as a sliding-window cache may
    leave a dropped slot: reused, or garbage) leaves every output finite and its bits as they
    were: decode with shared prefixes, extends after long cached prefixes."""
    window = 16
    for spec, ext_lens in ((LONG, [1] * len(LONG)), (EXTEND, EXTEND_LENS)):
        pool = _pool(3, 64, spec, dtype)
        seq_lens = [s for s, _ in spec]
        backend = CpuAttentionBackend(pool, num_heads=9, bf16_dots=dots, exact=exact)
        torch.manual_seed(6)
        t = sum(ext_lens)
        q = torch.randn(t, 9, 64).to(dtype)
        kv = [torch.randn(t, 3, 64).to(dtype) for _ in range(2)]
        want = _step(backend, pool, seq_lens, ext_lens, q, kv, window)
        dropped = torch.tensor(_dropped_slots(pool, seq_lens, ext_lens, window))
        assert dropped.numel() > 30
        pool.k_buffers[0][dropped] = float("nan")
        pool.v_buffers[0][dropped] = float("nan")
        got = _step(backend, pool, seq_lens, ext_lens, q, kv, window)
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)


def test_window_and_softcap_arguments_are_checked() -> None:
    pool = _pool(2, 64, SPEC, torch.float32)
    for window, softcap in ((0, None), (-3, None), (2.5, None), (None, 0.0), (None, float("inf"))):
        with pytest.raises(ValueError, match="attention: a (sliding window|soft cap)"):
            _decode(pool, [s for s, _ in SPEC], 6, True, None, window, softcap)


def _shared_groups(
    rows: torch.Tensor, lens: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The grouping's specification. rows int64 [B, Lmax] (pad -1), lens [B] → the qualifying
    groups: their requests (NG × int64 [n_g], ascending) and prefix lengths c [NG]. Requests are
    grouped by their first slot; a group's prefix is the longest run slots[:c] equal in all its
    rows, capped at seq_len - 1 of each; kept from MIN_GROUP_SIZE requests and MIN_SHARED_PREFIX
    slots."""
    b, lmax = rows.shape
    _, gid = torch.unique(rows[:, 0], return_inverse=True)
    ng = int(gid.max()) + 1
    first = torch.full((ng,), b).scatter_reduce(0, gid, torch.arange(b), "amin")
    differs = rows != rows.index_select(0, first[gid])
    run = torch.minimum(torch.where(differs.any(1), differs.int().argmax(1), lmax), lens - 1)
    c = torch.full((ng,), lmax).scatter_reduce(0, gid, run, "amin")
    size = torch.bincount(gid, minlength=ng)
    keep = ((c >= MIN_SHARED_PREFIX) & (size >= MIN_GROUP_SIZE)).nonzero().squeeze(1)
    return [(gid == g).nonzero().squeeze(1) for g in keep.tolist()], c[keep]


def _reference_segments(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: list[int]) -> list:
    """The decode segments the specification's grouping gives: [(slots, members, part)] per
    segment, and num_parts."""
    lens = torch.tensor(seq_lens)
    valid = torch.arange(max(seq_lens))[None, :] < lens[:, None]
    rows = torch.where(valid, table[:, : max(seq_lens)].index_select(0, req_rows), -1)
    groups, prefix_lens = _shared_groups(rows, lens)
    start = torch.zeros_like(lens)
    for members, c in zip(groups, prefix_lens.tolist()):
        start.index_fill_(0, members, c)
    segs = [(rows[m[0], :c].tolist(), m.tolist(), 0) for m, c in zip(groups, prefix_lens.tolist())]
    for i, n in enumerate(seq_lens):
        segs.append((rows[i, int(start[i]) : n].tolist(), [i], int(start[i] > 0)))
    return segs, (start > 0).long().add(1).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_decode_segments_group_as_specified(seed: int) -> None:
    """radixrt_decode_segments (one C call per decode step) groups requests as _shared_groups
    specifies."""
    lib = cpu_library.load(cache_dir())
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1000, 100000, (24, 300), generator=gen)
    next_slot = 200000
    for row in range(24):  # some rows copy a prefix of an earlier row: groups of several lengths
        if row > 4 and torch.rand(1, generator=gen).item() < 0.7:  # rows 0-2: their own group
            src = int(torch.randint(3, row, (1,), generator=gen))
            n = int(torch.randint(1, 120, (1,), generator=gen))
            table[row, :n] = table[src, :n]
        table[row, 250:] = torch.arange(next_slot, next_slot + 50)  # never read
        next_slot += 50
    table[1:3, :60] = table[0, :60]  # rows 0-2 share 60 slots at least
    b = int(torch.randint(5, 20, (1,), generator=gen))
    req_rows = torch.cat([torch.tensor([2, 0, 1]), 3 + torch.randperm(21, generator=gen)[: b - 3]])
    seq_lens = torch.randint(1, 240, (b,), generator=gen).tolist()
    seq_lens[:3] = [min(int(n) + 80, 250) for n in seq_lens[:3]]
    seq_lens[3] = 1  # a one-token request: it shares nothing (capped at len - 1 = 0)
    seg = cpu_kernel.decode_segments(
        lib, table, req_rows, seq_lens, MIN_SHARED_PREFIX, MIN_GROUP_SIZE
    )
    want, num_parts = _reference_segments(table, req_rows, seq_lens)
    got = [
        (
            seg.slots[seg.slot_start[s] : seg.slot_start[s + 1]].tolist(),
            seg.members[seg.member_start[s] : seg.member_start[s + 1]].tolist(),
            int(seg.part[s]),
        )
        for s in range(seg.part.numel())
    ]
    assert got == want
    assert seg.num_parts.tolist() == num_parts and seg.two_parts == (2 in num_parts)
    assert seg.key_start.tolist() == [  # a tail starts where its group's prefix ends
        0 if part == 0 else seq_lens[members[0]] - len(slots) for slots, members, part in want
    ]
    assert seg.position.tolist() == [n - 1 for n in seq_lens]
    assert any(part == 0 and {0, 1, 2} <= set(members) for _, members, part in got)


def test_attention_call_outlives_the_callers_segments() -> None:
    # A decode chain builds its attention arguments once and runs them later: the call must
    # keep the segments (and their merge scratch) its addresses point into.
    import gc

    lib = cpu_library.load(cache_dir())
    torch.manual_seed(0)
    kh, h, d, b, n = 3, 9, 64, 4, 300
    k_buf, v_buf = (torch.randn(b * n + 1, kh, d) for _ in range(2))
    q = torch.randn(b, h, d)
    table = torch.arange(1, b * n + 1).reshape(b, n)
    seg = cpu_kernel.decode_segments(lib, table, torch.arange(b), [n] * b, 64, 2)
    expected = cpu_kernel.attention(lib, q, k_buf, v_buf, seg, d**-0.5)
    call = cpu_kernel.AttentionCall(lib, q, k_buf, seg, d**-0.5)
    del seg
    gc.collect()
    litter = [
        torch.full((b * n,), 10**12, dtype=torch.int64) for _ in range(8)
    ]  # reuse freed memory
    call(k_buf.data_ptr(), v_buf.data_ptr())
    del litter
    assert torch.equal(call.out, expected)
