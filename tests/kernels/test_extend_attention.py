"""extend_attention against extend_attention_ref on ragged batches; argument checks.

Each batch mixes: a request with no prefix, one with a 1-token suffix, lengths
that are not multiples of the blocks (and span several of them), and, where
asked, a request with no new tokens at all. Sliding windows shorter than the
prefixes and the blocks, and longer than everything, with and without a soft cap.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEVICE,
    DTYPES,
    assert_matches,
    assert_rejects,
    indptr,
    make_generator,
    paged_kv,
    poisoned,
    randn,
)

from radixrt_kernels.triton.extend_attention import ExtendConfig, extend_attention
from radixrt_kernels.triton.reference import extend_attention_ref

# (prefix_len, extend_len) per request
RAGGED = [(0, 37), (29, 1), (50, 20), (17, 33)]
SMALL_BLOCKS = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _run(
    gen,
    seed,
    requests,
    heads,
    kv_heads,
    head_dim,
    dtype,
    config=None,
    index_dtype=torch.int64,
    q_view=False,
    max_extend_len="auto",
    window=None,
    softcap=None,
):
    prefixes = [p for p, _ in requests]
    extends = [e for _, e in requests]
    total = sum(extends)
    kv = paged_kv(gen, prefixes, kv_heads, head_dim, dtype, index_dtype)
    if q_view:  # q, k, v as views of one [T, H + 2·KH, D] projection, as the model makes them
        qkv = randn(gen, total, heads + 2 * kv_heads, head_dim, dtype=dtype)
        q, k_new, v_new = qkv.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q = randn(gen, total, heads, head_dim, dtype=dtype)
        k_new = randn(gen, total, kv_heads, head_dim, dtype=dtype)
        v_new = randn(gen, total, kv_heads, head_dim, dtype=dtype)
    if softcap is not None:  # scores wide enough for the cap to bite
        q = q * 4
    qo_indptr = indptr(extends, index_dtype)
    scale = head_dim**-0.5
    o = poisoned(q.shape, dtype)
    longest = max(extends) if max_extend_len == "auto" else max_extend_len
    extend_attention(
        q,
        k_new,
        v_new,
        o,
        kv.k_buffer,
        kv.v_buffer,
        qo_indptr,
        kv.indptr,
        kv.indices,
        scale,
        longest,
        config,
        window,
        softcap,
    )
    ref = extend_attention_ref(
        q,
        k_new,
        v_new,
        kv.k_buffer,
        kv.v_buffer,
        qo_indptr,
        kv.indptr,
        kv.indices,
        scale,
        window,
        softcap,
    )
    assert_matches(o, ref, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_matches_reference(dtype, group, head_dim, request):
    gen, seed = make_generator(request)
    _run(gen, seed, RAGGED, 2 * group, 2, head_dim, dtype, SMALL_BLOCKS)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [5, 16, 40, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_windowed_extend_matches_reference(dtype, window, softcap, request):
    """Rows of a block whose windows start in different chunks, before and inside the block's
    diagonal, over prefixes longer than the window."""
    gen, seed = make_generator(request)
    _run(gen, seed, RAGGED, 4, 2, 32, dtype, SMALL_BLOCKS, window=window, softcap=softcap)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 256])
def test_extend_other_head_dims(head_dim, request):
    """Powers of two from 16 up, and a padded non-power of two (80 → BLOCK_D 128)."""
    gen, seed = make_generator(request)
    _run(gen, seed, [(0, 9), (21, 1), (5, 18)], 4, 2, head_dim, torch.float16)


@pytest.mark.parametrize(
    "config",
    [None, SMALL_BLOCKS, ExtendConfig(block_m=64, block_n=32)],
    ids=["default", "16x16", "64x32"],
)
def test_extend_block_configs(config, request):
    gen, seed = make_generator(request)
    _run(gen, seed, [(40, 70), (0, 5), (3, 64)], 2, 1, 32, torch.float32, config)


def test_extend_model_layout_int32_indices_and_empty_request(request):
    """q/k/v strided views of one projection, int32 indptr/indices, a request with no new tokens."""
    gen, seed = make_generator(request)
    _run(
        gen,
        seed,
        [(12, 0), (0, 17), (33, 2)],
        8,
        2,
        64,
        torch.float16,
        SMALL_BLOCKS,
        index_dtype=torch.int32,
        q_view=True,
    )


def test_extend_reads_max_extend_len_from_indptr(request):
    gen, seed = make_generator(request)
    _run(gen, seed, [(3, 20), (0, 31)], 2, 2, 32, torch.float32, SMALL_BLOCKS, max_extend_len=None)


def test_extend_empty_batch():
    q = torch.empty(0, 2, 32, device=DEVICE)
    kv = torch.zeros(4, 1, 32, device=DEVICE)
    zeros = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    out = extend_attention(q, q[:, :1], q[:, :1], q.clone(), kv, kv, zeros, zeros, zeros[:0], 0.1)
    assert out.shape == (0, 2, 32)


def _valid_args(gen):
    t, kv_heads, d = 6, 2, 32
    q = randn(gen, t, 4, d, dtype=torch.float32)
    k_new, v_new = (
        randn(gen, t, kv_heads, d, dtype=torch.float32),
        randn(gen, t, kv_heads, d, dtype=torch.float32),
    )
    kv = paged_kv(gen, [3, 0], kv_heads, d, torch.float32)
    return dict(
        q=q,
        k_new=k_new,
        v_new=v_new,
        o=torch.empty_like(q),
        k_buffer=kv.k_buffer,
        v_buffer=kv.v_buffer,
        qo_indptr=indptr([4, 2]),
        kv_indptr=kv.indptr,
        kv_indices=kv.indices,
        sm_scale=0.2,
        max_extend_len=4,
    )


# (label, argument, replacement given the valid args, the name the error must start with)
BAD_ARGS = [
    ("q_2d", "q", lambda a: a["q"][:, 0], "q"),
    ("q_float64", "q", lambda a: a["q"].double(), "q"),
    ("o_dtype", "o", lambda a: a["o"].half(), "o"),
    ("o_shape", "o", lambda a: a["o"][:, :2], "o"),
    ("k_new_rows", "k_new", lambda a: a["k_new"][:-1], "k_new"),
    ("v_new_heads", "v_new", lambda a: a["v_new"][:, :1], "v_new"),
    ("k_buffer_dim", "k_buffer", lambda a: a["k_buffer"][..., :16], "k_buffer"),
    ("v_buffer_dtype", "v_buffer", lambda a: a["v_buffer"].half(), "v_buffer"),
    ("q_heads_not_multiple", "q", lambda a: torch.cat([a["q"], a["q"][:, :1]], 1), "q"),
    ("q_last_dim_strided", "q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2), "q"),
    ("qo_indptr_float", "qo_indptr", lambda a: a["qo_indptr"].float(), "qo_indptr"),
    ("kv_indptr_length", "kv_indptr", lambda a: a["kv_indptr"][:-1], "kv_indptr"),
    (
        "kv_indices_strided",
        "kv_indices",
        lambda a: torch.stack([a["kv_indices"]] * 2, 1)[:, 0],
        "kv_indices",
    ),
    ("sm_scale_negative", "sm_scale", lambda a: -1.0, "sm_scale"),
    ("window_float", "window", lambda a: 4.0, "window"),
    ("softcap_inf", "softcap", lambda a: float("inf"), "softcap"),
    ("max_extend_len_float", "max_extend_len", lambda a: 4.0, "max_extend_len"),
]
VALUE_ARGS = [  # index values: checked only on CPU, where it costs no device sync
    ("qo_indptr_total", "qo_indptr", lambda a: indptr([4, 1]), "qo_indptr"),
    (
        "kv_indptr_decreasing",
        "kv_indptr",
        lambda a: torch.tensor([0, 3, 2], device=DEVICE),
        "kv_indptr",
    ),
    ("kv_indices_out_of_range", "kv_indices", lambda a: a["kv_indices"] + 100, "kv_indices"),
    ("max_extend_len_short", "max_extend_len", lambda a: 3, "max_extend_len"),
]


@pytest.mark.parametrize(
    "label,name,replace,arg", BAD_ARGS + VALUE_ARGS, ids=[b[0] for b in BAD_ARGS + VALUE_ARGS]
)
def test_extend_rejects_bad_arguments(label, name, replace, arg, request):
    gen, _ = make_generator(request)
    checks_values = label in {b[0] for b in VALUE_ARGS}
    assert_rejects(extend_attention, _valid_args(gen), name, replace, arg, checks_values)
