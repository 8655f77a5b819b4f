"""Exact mode of the C attention kernel (radixrt_kernels.cpu.attention, ``Segments.exact``): a
query token's output has the same bits alone (its request decoded by itself) as in any decode
batch around it (groups sharing a prefix of any length with it or among themselves, a split
asked for), and as the j-th new token of an extend after any number of cached keys, in a batch
of extends. float32 and bf16 on each bf16 path: AMX where the native build has it, a build
without AMX for AVX512-BF16 dot products and float32 FMA, and a build without AVX-512 (FMA on
8-lane vectors). Bits compared with torch.equal. The same under a sliding window (and a soft
cap): a token alone, in any decode batch, in an extend chunked any way, and with its window's
dropped slots full of NaN."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.attention.cpu_backend import (
    MIN_GROUP_SIZE,
    MIN_SHARED_PREFIX,
    CpuAttentionBackend,
    extend_segments,
)
from radixrt.cache.kv_pool import KVPool
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import capture as cpu_capture
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import library as cpu_library

H, KH, D = 9, 3, 64  # SmolLM2's attention: 3 query heads per KV head
N_SLOTS = 8192
SCALING = D**-0.5

pytestmark = pytest.mark.skipif(
    cpu_library.compiler() is None,
    reason="no C compiler: the CPU attention kernel cannot be built here",
)


@pytest.fixture(scope="module", params=["native", "-mno-amx-tile", "-mno-avx512f"])
def lib(request, tmp_path_factory):
    """The library as built here, as built for a CPU without AMX (its bf16 paths), and as built
    for an AVX2 CPU (float32 FMA on 8-lane vectors)."""
    if request.param == "native":
        built = cpu_library.load(cache_dir())
    else:
        mp = pytest.MonkeyPatch()
        mp.setattr(cpu_library, "CFLAGS", [*cpu_library.CFLAGS, request.param])
        try:
            built = cpu_library._build_and_load(tmp_path_factory.mktemp("no_amx"))
        finally:
            mp.undo()
    if built is None:
        pytest.skip(f"the CPU kernels' library is unavailable: {cpu_library.why_unavailable()}")
    return built


# dtype, bf16_dots (bf16: on and off; where AMX runs exact bf16 items, it takes both)
PATHS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]


class World:
    """K/V buffers [N_SLOTS, KH, D] of random values, handing out scattered slots (drawn at
    random: requests may meet on a slot, as a pool's rows never do; the kernel reads either)."""

    def __init__(self, dtype: torch.dtype, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.k_buf = torch.randn(N_SLOTS, KH, D, generator=self.gen).to(dtype)
        self.v_buf = torch.randn(N_SLOTS, KH, D, generator=self.gen).to(dtype)

    def slots(self, n: int) -> list[int]:
        return torch.randperm(N_SLOTS - 1, generator=self.gen)[:n].add(1).tolist()

    def q(self, *rows: int) -> torch.Tensor:
        return torch.randn(*rows, H, D, generator=self.gen).to(self.dtype)

    def randint(self, lo: int, hi: int) -> int:
        """Uniform in [lo, hi]."""
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))


def _table(reqs: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(len(reqs), max(map(len, reqs)), dtype=torch.int64)
    for i, slots in enumerate(reqs):
        table[i, : len(slots)] = torch.tensor(slots)
    return table


def decode(
    lib, w: World, reqs, dots: bool, exact: bool = True, split_from: int = 0, **window
) -> tuple[torch.Tensor, cpu_attention.Segments]:
    """reqs: per request (its slots, its token's q [H, D]) → (out [B, H, D], segments);
    ``window``: the call's window and softcap."""
    lens = [len(s) for s, _ in reqs]
    seg = cpu_attention.decode_segments(
        lib,
        _table([s for s, _ in reqs]),
        torch.arange(len(reqs)),
        lens,
        MIN_SHARED_PREFIX,
        MIN_GROUP_SIZE,
        split_from,
        exact=exact,
    )
    q = torch.stack([q for _, q in reqs])
    out = cpu_attention.attention(lib, q, w.k_buf, w.v_buf, seg, SCALING, bf16_dots=dots, **window)
    return out, seg


def extend(lib, w: World, reqs, dots: bool, **window) -> torch.Tensor:
    """reqs: per request (its slots, q [n, H, D] of its last n tokens, the new ones) → out
    [sum n, H, D]; ``window``: the call's window and softcap."""
    seg = extend_segments(
        _table([s for s, _ in reqs]),
        torch.arange(len(reqs)),
        [len(s) for s, _ in reqs],
        [q.shape[0] for _, q in reqs],
        exact=True,
    )
    q = torch.cat([q for _, q in reqs])
    return cpu_attention.attention(lib, q, w.k_buf, w.v_buf, seg, SCALING, bf16_dots=dots, **window)


def batch_around(w: World, target: list[int], b: int) -> tuple[list[list[int]], int]:
    """b requests' slots with `target` among them (→ and its index): some share a prefix of
    1..300 of its slots with it, some a prefix of their own with each other, others none."""
    prefix = w.randint(1, min(300, len(target)))
    other = w.slots(w.randint(1, 300))  # another group's prefix
    reqs = []
    for i in range(b - 1):
        kind = i % 3
        if kind == 0:
            reqs.append(target[:prefix] + w.slots(w.randint(1, 40)))
        elif kind == 1:
            reqs.append(other[: w.randint(1, len(other))] + w.slots(w.randint(1, 40)))
        else:
            reqs.append(w.slots(w.randint(1, 300)))
    at = w.randint(0, b - 1)
    reqs.insert(at, target)
    return reqs, at


@pytest.mark.parametrize("dtype,dots", PATHS)
def test_a_decode_token_has_the_same_bits_in_any_batch(lib, dtype, dots) -> None:
    """A request of 1..400 keys decoded alone, then among 0..39 others (batch_around), with
    split_from asking for every lone request to be split: the same bits."""
    w = World(dtype, seed=1)
    continued = 0  # cases where the target's tail continued a shared prefix
    for b in range(1, 41):
        target = w.slots(w.randint(1, 400))
        q = w.q()
        want, _ = decode(lib, w, [(target, q)], dots)
        reqs, at = batch_around(w, target, b)
        qs = [q if i == at else w.q() for i in range(b)]
        got, seg = decode(lib, w, list(zip(reqs, qs)), dots, split_from=1)
        assert torch.equal(got[at], want[0]), f"batch of {b}, target at {at}"
        continued += int(seg.num_parts[at]) == 2
    assert continued >= 10


def test_exact_segments_round_the_prefix_and_split_nothing() -> None:
    lib = cpu_library.load(cache_dir())
    w = World(torch.float32, seed=2)
    shared = w.slots(150)
    reqs = [shared + w.slots(5), shared + w.slots(9), w.slots(300)]
    for exact, prefix in ((False, 150), (True, 128)):
        _, seg = decode(lib, w, [(s, w.q()) for s in reqs], False, exact=exact, split_from=256)
        assert seg.exact is exact
        assert int(seg.slot_start[1]) == prefix  # the group's prefix segment
        assert seg.num_parts.tolist() == [2, 2, 1 if exact else 2]  # the lone request: split?


@pytest.mark.parametrize("dtype,dots", PATHS)
def test_an_extend_token_has_its_decode_bits(lib, dtype, dots) -> None:
    """Token j of n new ones after c cached keys, in a batch of extends, equals its decode
    alone, and in a decode batch of its request's other tokens (one group, its prefix the
    shortest's)."""
    w = World(dtype, seed=3)
    shapes = [(0, 1), (0, 70), (1, 5), (63, 2), (64, 37), (65, 1), (130, 20), (200, 64)]
    shapes += [(w.randint(0, 300), w.randint(1, 40)) for _ in range(4)]
    reqs = [(w.slots(c + n), w.q(n)) for c, n in shapes]
    got = extend(lib, w, reqs, dots)
    row = 0
    for (c, n), (slots, q) in zip(shapes, reqs):
        tokens = [(slots[: c + j + 1], q[j]) for j in range(n)]
        together, _ = decode(lib, w, tokens, dots)
        for j in range(n):
            alone, _ = decode(lib, w, [tokens[j]], dots)
            assert torch.equal(got[row + j], alone[0]), f"{c} cached, token {j} of {n}"
            assert torch.equal(together[j], alone[0]), f"{c} cached, token {j} of {n}"
        row += n


@pytest.mark.parametrize("dtype,dots", PATHS)
def test_a_mixed_steps_rows_have_their_own_bits(lib, dtype, dots) -> None:
    """A mixed step (concat_segments): decode rows grouped by shared prefixes, then extends
    after cached keys, in one call: each decode row's bits are its decode alone, each extend
    token's its extend alone."""
    w = World(dtype, seed=11)
    grouped = 0  # steps whose decode rows shared a prefix segment
    for b in (1, 5, 17, 30):
        target = w.slots(w.randint(100, 400))
        decodes, _ = batch_around(w, target, b)
        decodes = [(slots, w.q()) for slots in decodes]
        extends = [(w.slots(c + n), w.q(n)) for c, n in ((0, 33), (w.randint(1, 300), 7), (64, 1))]
        seg = cpu_attention.concat_segments(
            decode(lib, w, decodes, dots)[1],
            extend_segments(
                _table([s for s, _ in extends]),
                torch.arange(len(extends)),
                [len(s) for s, _ in extends],
                [q.shape[0] for _, q in extends],
                exact=True,
            ),
        )
        q = torch.cat([torch.stack([q for _, q in decodes]), *[q for _, q in extends]])
        got = cpu_attention.attention(lib, q, w.k_buf, w.v_buf, seg, SCALING, bf16_dots=dots)
        for i, one in enumerate(decodes):
            assert torch.equal(got[i], decode(lib, w, [one], dots)[0][0]), f"decode row {i}"
        row = len(decodes)
        for one in extends:
            n = one[1].shape[0]
            assert torch.equal(got[row : row + n], extend(lib, w, [one], dots)), f"row {row}"
            row += n
        grouped += seg.two_parts
    assert grouped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_exact_a_shared_prefix_changes_the_bits(dtype) -> None:
    """The harness above sees a difference where there is one: without exact mode, a token's
    prefix merged by log-sum-exp with its tail does not give its lone decode's bits."""
    lib = cpu_library.load(cache_dir())
    w = World(dtype, seed=4)
    differ = 0
    for _ in range(10):
        target = w.slots(w.randint(100, 400))
        q = w.q()
        want, _ = decode(lib, w, [(target, q)], False, exact=False)
        reqs = [target] + [target[:90] + w.slots(w.randint(1, 40)) for _ in range(5)]
        got, seg = decode(lib, w, [(s, q) for s in reqs], False, exact=False)
        assert int(seg.num_parts[0]) == 2
        differ += not torch.equal(got[0], want[0])
    assert differ > 0


def test_segments_exact_mode_cannot_continue_are_refused() -> None:
    lib = cpu_library.load(cache_dir())
    w = World(torch.bfloat16, seed=5)
    shared = w.slots(100)
    reqs = [(shared + w.slots(3), w.q()), (shared + w.slots(7), w.q()), (w.slots(300), w.q())]
    q = torch.stack([q for _, q in reqs])
    for split_from in (0, 256):  # a 100-key prefix; a lone request's halves
        _, seg = decode(lib, w, reqs, False, exact=False, split_from=split_from)
        seg = dataclasses.replace(seg, exact=True)
        with pytest.raises(ValueError, match="exact mode needs"):
            cpu_attention.attention(lib, q, w.k_buf, w.v_buf, seg, SCALING)


def test_an_exact_chain_step_gives_the_calls_bits() -> None:
    """A decode chain's attention step runs an exact call's two phases (the prefix, then the
    tails continuing it) as the call does."""
    lib = cpu_library.load(cache_dir())
    w = World(torch.bfloat16, seed=6)
    shared = w.slots(200)
    reqs = [(shared + w.slots(w.randint(1, 30)), w.q()) for _ in range(5)] + [(w.slots(90), w.q())]
    want, seg = decode(lib, w, reqs, True)
    assert seg.two_parts and seg.exact
    q = torch.stack([q for _, q in reqs])
    out = torch.empty_like(q)
    call = cpu_attention.AttentionCall(lib, q, w.k_buf, seg, SCALING, None, True, out)
    args = torch.tensor(call.fields, dtype=torch.int64)
    chain = cpu_chain.Chain(lib)
    chain.attention(args, w.k_buf, w.v_buf)
    chain.run()
    assert torch.equal(out, want)


def test_the_backend_builds_exact_segments() -> None:
    """CpuAttentionBackend(exact=True): decode and extend segments in exact mode, no split of a
    lone request however few the work items, and a decode's bits as the extend's."""
    pool = KVPool(N_SLOTS, 1, KH, D, torch.bfloat16, 4, 512)
    w = World(torch.bfloat16, seed=7)
    pool.k_buffers[0].copy_(w.k_buf)
    pool.v_buffers[0].copy_(w.v_buf)
    slots = w.slots(300)
    pool.req_to_token[0, :300] = torch.tensor(slots)
    backend = CpuAttentionBackend(pool, num_heads=H, bf16_dots=False, exact=True)
    assert "exact" in backend.describe()
    q = w.q(10)
    outs = []
    for mode, n in ((ForwardMode.EXTEND, 10), (ForwardMode.DECODE, 1)):
        loc = torch.tensor(slots[300 - n :])
        batch = ForwardBatch(
            mode,
            torch.zeros(n, dtype=torch.int64),
            loc * 0,
            loc,
            torch.zeros(1, dtype=torch.int64),
            [300],
            [n],
        )
        backend.init_forward_metadata(batch)
        assert batch.attn_metadata.exact and not batch.attn_metadata.two_parts
        k, v = w.k_buf[loc], w.v_buf[loc]  # the K/V the slots hold already
        outs.append(backend.forward(q[10 - n :], k, v, 0, batch, SCALING))
    assert torch.equal(outs[0][-1], outs[1][0])


# (window, softcap): windows shorter than most sequences, one not a multiple of a block, one
# longer than a block step; a soft cap with each
WINDOWED = [(5, None), (16, 30.0), (33, None), (100, 30.0)]


@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("dtype,dots", PATHS)
def test_a_windowed_decode_token_has_the_same_bits_in_any_batch(
    lib, dtype, dots, window, softcap
) -> None:
    """As test_a_decode_token_has_the_same_bits_in_any_batch, under a window: the token alone,
    then among others that share a prefix with it or not (its window may start in the shared
    prefix or in its tail; a group's rows have windows of their own)."""
    w = World(dtype, seed=21)
    kw = dict(window=window, softcap=softcap)
    continued = 0
    for b in range(1, 41, 3):
        target = w.slots(w.randint(1, 400))
        q = w.q() * 4
        want, _ = decode(lib, w, [(target, q)], dots, **kw)
        reqs, at = batch_around(w, target, b)
        qs = [q if i == at else w.q() * 4 for i in range(b)]
        got, seg = decode(lib, w, list(zip(reqs, qs)), dots, split_from=1, **kw)
        assert torch.equal(got[at], want[0]), f"batch of {b}, target at {at}"
        continued += int(seg.num_parts[at]) == 2
    assert continued >= 3


def _chunks(w: World, n: int) -> list[int]:
    """n split into random chunks."""
    sizes = []
    while n:
        sizes.append(w.randint(1, n))
        n -= sizes[-1]
    return sizes


@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("dtype,dots", PATHS)
def test_a_windowed_extend_token_has_its_decode_bits_however_chunked(
    lib, dtype, dots, window, softcap
) -> None:
    """Token j of n new ones after c cached keys, under a window: in a batch of extends, in an
    extend chunked another way (each chunk after the ones before it, cached), and decoded
    alone, the same bits."""
    w = World(dtype, seed=23)
    kw = dict(window=window, softcap=softcap)
    shapes = [(0, 70), (1, 5), (63, 2), (64, 37), (130, 20), (200, 64)]
    shapes += [(w.randint(0, 300), w.randint(1, 70)) for _ in range(3)]
    reqs = [(w.slots(c + n), w.q(n) * 4) for c, n in shapes]
    got = extend(lib, w, reqs, dots, **kw)
    row = 0
    for (c, n), (slots, q) in zip(shapes, reqs):
        done, chunked = c, []
        for size in _chunks(w, n):
            chunked.append(
                extend(lib, w, [(slots[: done + size], q[done - c :][:size])], dots, **kw)
            )
            done += size
        assert torch.equal(torch.cat(chunked), got[row : row + n]), f"{c} cached, {n} new"
        for j in (0, n // 2, n - 1):
            alone, _ = decode(lib, w, [(slots[: c + j + 1], q[j])], dots, **kw)
            assert torch.equal(got[row + j], alone[0]), f"{c} cached, token {j} of {n}"
        row += n


@pytest.mark.parametrize("dtype,dots", PATHS)
def test_a_windowed_mixed_step_ignores_dropped_slots(lib, dtype, dots) -> None:
    """A mixed step under a window of 40 with NaN in every slot no token's window holds:
    finite, and each decode row's bits are its decode alone (on slots that hold values)."""
    w = World(dtype, seed=25)
    kw = dict(window=40, softcap=30.0)
    target = w.slots(300)
    decodes, _ = batch_around(w, target, 12)
    decodes = [(slots, w.q()) for slots in decodes]
    extends = [(w.slots(c + n), w.q(n)) for c, n in ((0, 33), (200, 7), (64, 1))]
    want = [decode(lib, w, [one], dots, **kw)[0][0] for one in decodes]
    seen = {s for slots, _ in decodes for s in slots[-40:]}
    seen |= {s for slots, q in extends for s in slots[max(0, len(slots) - q.shape[0] - 39) :]}
    dropped = torch.tensor(sorted({s for slots, _ in decodes + extends for s in slots} - seen))
    w.k_buf[dropped] = float("nan")
    w.v_buf[dropped] = float("nan")
    seg = cpu_attention.concat_segments(
        decode(lib, w, decodes, dots)[1],
        extend_segments(
            _table([s for s, _ in extends]),
            torch.arange(len(extends)),
            [len(s) for s, _ in extends],
            [q.shape[0] for _, q in extends],
            exact=True,
        ),
    )
    q = torch.cat([torch.stack([q for _, q in decodes]), *[q for _, q in extends]])
    got = cpu_attention.attention(lib, q, w.k_buf, w.v_buf, seg, SCALING, bf16_dots=dots, **kw)
    assert torch.isfinite(got).all() and seg.two_parts
    for i in range(len(decodes)):
        assert torch.equal(got[i], want[i]), f"decode row {i}"


def test_a_windowed_chain_step_gives_the_calls_bits() -> None:
    """A decode chain's attention step carries the window and the soft cap."""
    lib = cpu_library.load(cache_dir())
    w = World(torch.bfloat16, seed=26)
    shared = w.slots(200)
    reqs = [(shared + w.slots(w.randint(1, 30)), w.q()) for _ in range(5)] + [(w.slots(90), w.q())]
    want, seg = decode(lib, w, reqs, True, window=33, softcap=30.0)
    plain, _ = decode(lib, w, reqs, True)
    assert not torch.equal(want, plain)
    q = torch.stack([q for _, q in reqs])
    out = torch.empty_like(q)
    call = cpu_attention.AttentionCall(lib, q, w.k_buf, seg, SCALING, None, True, out, 33, 30.0)
    chain = cpu_chain.Chain(lib)
    chain.attention(torch.tensor(call.fields, dtype=torch.int64), w.k_buf, w.v_buf)
    chain.run()
    assert torch.equal(out, want)


def test_a_captured_windowed_attention_replays_with_its_window() -> None:
    """A capture records the call's window and soft cap, and its replay runs them."""
    lib = cpu_library.load(cache_dir())
    w = World(torch.bfloat16, seed=27)
    reqs = [(w.slots(w.randint(50, 200)), w.q()) for _ in range(4)]
    want, seg = decode(lib, w, reqs, True, window=16, softcap=30.0)
    q = torch.stack([q for _, q in reqs])
    slots = torch.tensor([s[-1] for s, _ in reqs])
    new_kv = (w.k_buf[slots].clone(), w.v_buf[slots].clone(), slots)
    with cpu_capture.capture() as recorder:
        out = cpu_attention.attention(
            lib, q, w.k_buf, w.v_buf, None, SCALING, new_kv, True, window=16, softcap=30.0
        )
    plan = cpu_chain.replay(lib, recorder, (out,), len(reqs))
    plan.run(seg, slots, len(reqs))
    assert torch.equal(plan.outputs[0], want)
