"""deterministic_attention: a query's output bits whatever the batch around it, the grid's
split count, the cache hit (how its keys divide into prefix and new), or decode vs extend;
both kernels against the torch references; argument checks.

The invariance tests compare with ``torch.equal``. Under the interpreter the float32
arithmetic is numpy's, so equality there shows that the reduction order is canonical; on a
GPU the same tests check the hardware's bits. ``SMALL`` puts split and chunk boundaries
inside the short test sequences on either. The same under sliding windows (shorter than a
chunk, than a split, longer than both) and a soft cap.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from kernel_cases import (
    DEVICE,
    assert_matches,
    assert_rejects,
    indptr,
    make_generator,
    poisoned,
    randn,
)

from radixrt_kernels.triton.decode_attention import DecodeWorkspace, decode_attention
from radixrt_kernels.triton.deterministic_attention import (
    FixedSplitConfig,
    deterministic_decode_attention,
    deterministic_extend_attention,
    fixed_split_workspace,
    num_fixed_splits,
)
from radixrt_kernels.triton.reference import decode_attention_ref, extend_attention_ref

SMALL = FixedSplitConfig(split_len=32, block_n=16, num_warps=4, num_stages=1)
DTYPES = [torch.float32, torch.bfloat16]
SCALE = 0.3


class Sequences(NamedTuple):
    """Requests' keys in shared paged buffers, and a query for every token of each."""

    k_buffer: torch.Tensor  # [num_slots, KH, D]
    v_buffer: torch.Tensor
    slots: list[torch.Tensor]  # per sequence: int64 [L] slots in key order
    q: list[torch.Tensor]  # per sequence: [L, H, D], the query of each token


def make_sequences(gen, lens, heads, kv_heads, head_dim, dtype) -> Sequences:
    num_slots = sum(lens) + 5
    k_buffer = randn(gen, num_slots, kv_heads, head_dim, dtype=dtype)
    v_buffer = randn(gen, num_slots, kv_heads, head_dim, dtype=dtype)
    perm = torch.randperm(num_slots, generator=gen).to(DEVICE)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    slots = [perm[s : s + n] for s, n in zip(starts, lens)]
    q = [randn(gen, n, heads, head_dim, dtype=dtype) for n in lens]
    return Sequences(k_buffer, v_buffer, slots, q)


def decode(seqs: Sequences, tokens, max_seq_len=None, config=SMALL, **window) -> torch.Tensor:
    """[B, H, D]: token ``pos`` of sequence ``s`` over its keys 0..pos, for each (s, pos);
    ``window``: the kernel's window and softcap."""
    q = torch.stack([seqs.q[s][pos] for s, pos in tokens])
    kv_indptr = indptr([pos + 1 for _, pos in tokens])
    kv_indices = torch.cat([seqs.slots[s][: pos + 1] for s, pos in tokens])
    longest = max(pos + 1 for _, pos in tokens)
    max_seq_len = max_seq_len or longest
    splits = num_fixed_splits(max_seq_len, config)
    ws = DecodeWorkspace(
        poisoned((q.shape[0], q.shape[1], splits, q.shape[2]), torch.float32),
        poisoned((q.shape[0], q.shape[1], splits), torch.float32),
    )
    o = poisoned(q.shape, q.dtype)
    return deterministic_decode_attention(
        q,
        seqs.k_buffer,
        seqs.v_buffer,
        o,
        kv_indptr,
        kv_indices,
        SCALE,
        max_seq_len,
        ws,
        config,
        **window,
    )


def extend(seqs: Sequences, requests, config=SMALL, **window) -> torch.Tensor:
    """[T, H, D]: tokens prefix..end-1 of sequence ``s`` (keys 0..end-1, the first ``prefix``
    cached), for each (s, prefix, end), concatenated; ``window``: the kernel's window and
    softcap."""
    q = torch.cat([seqs.q[s][p:e] for s, p, e in requests])
    qo_indptr = indptr([e - p for _, p, e in requests])
    kv_indptr = indptr([e for _, _, e in requests])
    kv_indices = torch.cat([seqs.slots[s][:e] for s, _, e in requests])
    o = poisoned(q.shape, q.dtype)
    return deterministic_extend_attention(
        q,
        o,
        seqs.k_buffer,
        seqs.v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        SCALE,
        None,
        config,
        **window,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_bits_do_not_depend_on_the_batch_or_the_grid(dtype, request):
    """Every token decoded alone equals itself in batches of 2..8 other tokens, in any order,
    with a split axis far longer than any sequence."""
    gen, seed = make_generator(request)
    lens = [70, 1, 33, 64, 5, 96, 32, 17]
    seqs = make_sequences(gen, lens, 4, 2, 16, dtype)
    tokens = [(s, n - 1) for s, n in enumerate(lens)] + [(0, 31), (0, 32), (5, 40)]
    alone = {t: decode(seqs, [t])[0] for t in tokens}
    for size in (2, 3, 5, 8):
        picks = [tokens[int(i)] for i in torch.randperm(len(tokens), generator=gen)[:size]]
        out = decode(seqs, picks, max_seq_len=200)
        for row, t in enumerate(picks):
            assert torch.equal(out[row], alone[t]), f"seed {seed}: token {t} in batch {picks}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_extend_equals_decode_for_any_cache_hit(dtype, group, request):
    """Tokens computed by an extend, with any prefix cached and any chunk end, have the bits
    of the same tokens decoded one by one."""
    gen, seed = make_generator(request)
    length = 70
    seqs = make_sequences(gen, [length], 2 * group, 2, 32, dtype)
    decoded = decode(seqs, [(0, pos) for pos in range(length)])
    for prefix, end in [(0, 70), (1, 70), (15, 47), (16, 33), (31, 32), (32, 70), (50, 69)]:
        out = extend(seqs, [(0, prefix, end)])
        for i in range(end - prefix):
            assert torch.equal(out[i], decoded[prefix + i]), (
                f"seed {seed}: token {prefix + i} of an extend after {prefix} cached keys"
            )


def test_extend_bits_do_not_depend_on_the_batch(request):
    """A request's extend alone equals it among others: ragged, with and without a prefix,
    one with no new tokens, the request placed first, last and in the middle."""
    gen, seed = make_generator(request)
    seqs = make_sequences(gen, [60, 45, 20, 90], 4, 1, 16, torch.float32)
    target = (0, 13, 60)
    alone = extend(seqs, [target])
    others = [(1, 0, 45), (2, 20, 20), (3, 33, 90), (1, 44, 45)]
    for batch in ([target, *others], [*others[:2], target, *others[2:]], [*others, target]):
        out = extend(seqs, batch)
        start = sum(e - p for _, p, e in batch[: batch.index(target)])
        got = out[start : start + len(alone)]
        assert torch.equal(got, alone), f"seed {seed}: extend {target} in batch {batch}"


def test_split_count_kernel_is_not_deterministic(request):
    """The invariance tests can fail: the split-count kernel's bits move with the number of
    splits, where the fixed-split kernel's (above) do not move with the grid."""
    gen, _ = make_generator(request)
    seqs = make_sequences(gen, [96], 8, 2, 32, torch.float32)
    q = seqs.q[0][-1:]
    args = (seqs.k_buffer, seqs.v_buffer)
    outs = [
        decode_attention(q, *args, torch.empty_like(q), indptr([96]), seqs.slots[0], SCALE, n)
        for n in (1, 3)
    ]
    assert not torch.equal(*outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 80])
def test_kernels_match_references(dtype, group, head_dim, request):
    """Both kernels against the torch references on a ragged batch (80: padded BLOCK_D)."""
    gen, seed = make_generator(request)
    lens = [1, 40, 17, 75]
    seqs = make_sequences(gen, lens, 2 * group, 2, head_dim, dtype)
    tokens = [(s, n - 1) for s, n in enumerate(lens)]
    kv_indptr = indptr(lens)
    kv_indices = torch.cat(seqs.slots)
    q = torch.stack([seqs.q[s][pos] for s, pos in tokens])
    ref = decode_attention_ref(q, seqs.k_buffer, seqs.v_buffer, kv_indptr, kv_indices, SCALE)
    assert_matches(decode(seqs, tokens), ref, seed)
    requests = [(0, 0, 1), (1, 9, 40), (2, 0, 17), (3, 70, 75)]
    k_new = torch.cat([seqs.k_buffer[seqs.slots[s][p:e]] for s, p, e in requests])
    v_new = torch.cat([seqs.v_buffer[seqs.slots[s][p:e]] for s, p, e in requests])
    q = torch.cat([seqs.q[s][p:e] for s, p, e in requests])
    qo_indptr = indptr([e - p for _, p, e in requests])
    prefix_indptr = indptr([p for _, p, _ in requests])
    prefix_indices = torch.cat([seqs.slots[s][:p] for s, p, _ in requests])
    ref = extend_attention_ref(
        q,
        k_new,
        v_new,
        seqs.k_buffer,
        seqs.v_buffer,
        qo_indptr,
        prefix_indptr,
        prefix_indices,
        SCALE,
    )
    assert_matches(extend(seqs, requests), ref, seed)


def test_default_config_matches_reference(request):
    gen, seed = make_generator(request)
    seqs = make_sequences(gen, [50, 3], 4, 2, 32, torch.float16)
    tokens = [(0, 49), (1, 2)]
    q = torch.stack([seqs.q[s][pos] for s, pos in tokens])
    kv_indptr, kv_indices = indptr([50, 3]), torch.cat(seqs.slots)
    o = poisoned(q.shape, q.dtype)
    deterministic_decode_attention(
        q, seqs.k_buffer, seqs.v_buffer, o, kv_indptr, kv_indices, SCALE, 50
    )
    ref = decode_attention_ref(q, seqs.k_buffer, seqs.v_buffer, kv_indptr, kv_indices, SCALE)
    assert_matches(o, ref, seed)
    ws = fixed_split_workspace(q, 50)
    assert ws.partial_o.shape[:3] == (2, 4, ws.partial_lse.shape[2])


# (window, softcap): within a chunk, across chunks of a split, across splits
WINDOWED = [(5, None), (20, 30.0), (40, 30.0)]


@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("group", [1, 4])
def test_windowed_extend_equals_decode_for_any_cache_hit(window, softcap, group, request):
    """Under a window, tokens computed by an extend (any prefix cached, any chunk end: rows of
    a tile whose windows start in different chunks and splits) have their decode's bits, and
    the decodes of a batch theirs alone."""
    gen, seed = make_generator(request)
    length, kw = 70, dict(window=window, softcap=softcap)
    seqs = make_sequences(gen, [length], 2 * group, 2, 32, torch.float32)
    decoded = decode(seqs, [(0, pos) for pos in range(length)], **kw)
    for pos in (0, 33, 69):
        assert torch.equal(decode(seqs, [(0, pos)], max_seq_len=100, **kw)[0], decoded[pos])
    for prefix, end in [(0, 70), (15, 47), (31, 32), (32, 70), (50, 69)]:
        out = extend(seqs, [(0, prefix, end)], **kw)
        for i in range(end - prefix):
            assert torch.equal(out[i], decoded[prefix + i]), (
                f"seed {seed}: token {prefix + i} of an extend after {prefix} cached keys"
            )


@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_windowed_kernels_match_references(dtype, window, softcap, request):
    """Both kernels under a window and a soft cap against the torch references."""
    gen, seed = make_generator(request)
    lens, kw = [1, 40, 17, 75], dict(window=window, softcap=softcap)
    seqs = make_sequences(gen, lens, 4, 2, 32, dtype)
    seqs = seqs._replace(q=[q * 4 for q in seqs.q])  # scores wide enough for the cap to bite
    tokens = [(s, n - 1) for s, n in enumerate(lens)]
    q = torch.stack([seqs.q[s][pos] for s, pos in tokens])
    index = (indptr(lens), torch.cat(seqs.slots))
    ref = decode_attention_ref(q, seqs.k_buffer, seqs.v_buffer, *index, SCALE, **kw)
    assert_matches(decode(seqs, tokens, **kw), ref, seed)
    requests = [(0, 0, 1), (1, 9, 40), (2, 0, 17), (3, 50, 75)]
    k_new = torch.cat([seqs.k_buffer[seqs.slots[s][p:e]] for s, p, e in requests])
    v_new = torch.cat([seqs.v_buffer[seqs.slots[s][p:e]] for s, p, e in requests])
    q = torch.cat([seqs.q[s][p:e] for s, p, e in requests])
    prefix = (
        indptr([p for _, p, _ in requests]),
        torch.cat([seqs.slots[s][:p] for s, p, _ in requests]),
    )
    qo_indptr = indptr([e - p for _, p, e in requests])
    ref = extend_attention_ref(
        q, k_new, v_new, seqs.k_buffer, seqs.v_buffer, qo_indptr, *prefix, SCALE, **kw
    )
    assert_matches(extend(seqs, requests, **kw), ref, seed)


def test_config_rejects_misplaced_boundaries():
    with pytest.raises(ValueError, match="split_len"):
        FixedSplitConfig(split_len=40, block_n=16)
    with pytest.raises(ValueError, match="block_n"):
        FixedSplitConfig(split_len=48, block_n=24)


def _decode_args(gen):
    seqs = make_sequences(gen, [40, 5], 4, 2, 16, torch.float32)
    q = torch.stack([seqs.q[0][39], seqs.q[1][4]])
    return dict(
        q=q,
        k_buffer=seqs.k_buffer,
        v_buffer=seqs.v_buffer,
        o=torch.empty_like(q),
        kv_indptr=indptr([40, 5]),
        kv_indices=torch.cat(seqs.slots),
        sm_scale=SCALE,
        max_seq_len=40,
        workspace=fixed_split_workspace(q, 40, SMALL),
        config=SMALL,
    )


def _extend_args(gen):
    seqs = make_sequences(gen, [40, 5], 4, 2, 16, torch.float32)
    q = torch.cat([seqs.q[0][30:], seqs.q[1]])
    return dict(
        q=q,
        o=torch.empty_like(q),
        k_buffer=seqs.k_buffer,
        v_buffer=seqs.v_buffer,
        qo_indptr=indptr([10, 5]),
        kv_indptr=indptr([40, 5]),
        kv_indices=torch.cat(seqs.slots),
        sm_scale=SCALE,
        max_extend_len=10,
        config=SMALL,
    )


KERNEL = {
    _decode_args: deterministic_decode_attention,
    _extend_args: deterministic_extend_attention,
}
# (label, kernel's argument builder, argument, replacement, the name the error must start with)
BAD_ARGS = [
    ("decode_q_dtype_unlike_o", _decode_args, "q", lambda a: a["q"].half(), "o"),
    ("decode_max_seq_len_float", _decode_args, "max_seq_len", lambda a: 40.0, "max_seq_len"),
    (
        "decode_workspace_splits",
        _decode_args,
        "workspace",
        lambda a: fixed_split_workspace(a["q"], 70, SMALL),
        "workspace.partial_o",
    ),
    ("extend_o_shape", _extend_args, "o", lambda a: a["o"][:-1], "o"),
    ("extend_kv_indptr_length", _extend_args, "kv_indptr", lambda a: indptr([40]), "kv_indptr"),
    (
        "extend_max_extend_len_negative",
        _extend_args,
        "max_extend_len",
        lambda a: -1,
        "max_extend_len",
    ),
]
VALUE_ARGS = [  # index values: checked only on CPU, where it costs no device sync
    ("decode_max_seq_len_short", _decode_args, "max_seq_len", lambda a: 39, "max_seq_len"),
    ("extend_max_extend_len_short", _extend_args, "max_extend_len", lambda a: 9, "max_extend_len"),
    (
        "extend_kv_shorter_than_new_tokens",
        _extend_args,
        "kv_indptr",
        lambda a: indptr([40, 4]),
        "kv_indptr",
    ),
]


@pytest.mark.parametrize(
    "label,args,name,replace,arg", BAD_ARGS + VALUE_ARGS, ids=[b[0] for b in BAD_ARGS + VALUE_ARGS]
)
def test_rejects_bad_arguments(label, args, name, replace, arg, request):
    gen, _ = make_generator(request)
    checks_values = label in {b[0] for b in VALUE_ARGS}
    assert_rejects(KERNEL[args], args(gen), name, replace, arg, checks_values)
