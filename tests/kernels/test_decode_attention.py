"""decode_attention against decode_attention_ref on ragged batches; split merging; argument checks.

Sequence lengths include 1 (only the new token), lengths that are not
multiples of BLOCK_N, and more splits than a short sequence has chunks (empty
splits must merge as weight 0). The stage-1 workspace is poisoned with NaN too.
Sliding windows shorter and longer than the sequences, with and without a soft cap.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEVICE,
    DTYPES,
    assert_matches,
    assert_rejects,
    make_generator,
    paged_kv,
    poisoned,
    randn,
)

from radixrt_kernels.triton.decode_attention import (
    MAX_KV_SPLITS,
    DecodeConfig,
    DecodeWorkspace,
    choose_num_kv_splits,
    decode_attention,
)
from radixrt_kernels.triton.reference import decode_attention_ref

SEQ_LENS = [1, 17, 64, 100, 33]


def _run(
    gen,
    seed,
    lens,
    heads,
    kv_heads,
    head_dim,
    dtype,
    num_kv_splits,
    config=None,
    index_dtype=torch.int64,
    q_view=False,
    workspace=True,
    window=None,
    softcap=None,
):
    kv = paged_kv(gen, lens, kv_heads, head_dim, dtype, index_dtype)
    batch = len(lens)
    if q_view:  # q as the model makes it: a strided view of the [B, H + 2·KH, D] projection
        q = randn(gen, batch, heads + 2 * kv_heads, head_dim, dtype=dtype)[:, :heads]
    else:
        q = randn(gen, batch, heads, head_dim, dtype=dtype)
    if softcap is not None:  # scores wide enough for the cap to bite
        q = q * 4
    ws = None
    if workspace:
        ws = DecodeWorkspace(
            poisoned((batch, heads, num_kv_splits, head_dim), torch.float32),
            poisoned((batch, heads, num_kv_splits), torch.float32),
        )
    o = poisoned(q.shape, dtype)
    scale = head_dim**-0.5
    decode_attention(
        q,
        kv.k_buffer,
        kv.v_buffer,
        o,
        kv.indptr,
        kv.indices,
        scale,
        num_kv_splits,
        ws,
        config,
        window,
        softcap,
    )
    ref = decode_attention_ref(
        q, kv.k_buffer, kv.v_buffer, kv.indptr, kv.indices, scale, window, softcap
    )
    assert_matches(o, ref, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(dtype, group, head_dim, request):
    gen, seed = make_generator(request)
    splits = {1: 1, 2: 3, 4: 4}[group]
    _run(gen, seed, SEQ_LENS, 2 * group, 2, head_dim, dtype, splits)


@pytest.mark.parametrize("num_kv_splits", [1, 2, 7, 16])
def test_decode_split_counts(num_kv_splits, request):
    """16 splits of 16-key chunks leave most splits of the short sequences empty."""
    gen, seed = make_generator(request)
    _run(gen, seed, [1, 5, 70, 129], 8, 1, 32, torch.float32, num_kv_splits)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 256])
def test_decode_other_head_dims(head_dim, request):
    gen, seed = make_generator(request)
    _run(gen, seed, [3, 40], 4, 2, head_dim, torch.float16, 2)


def test_decode_wide_group_int32_model_layout(request):
    """G = 32 query heads per KV head (BLOCK_H 32), int32 indices, q a strided view, own
    workspace."""
    gen, seed = make_generator(request)
    _run(
        gen,
        seed,
        [9, 30],
        32,
        1,
        64,
        torch.float16,
        2,
        index_dtype=torch.int32,
        q_view=True,
        workspace=False,
    )


def test_decode_block_config(request):
    gen, seed = make_generator(request)
    _run(
        gen,
        seed,
        [50, 1, 97],
        4,
        2,
        32,
        torch.bfloat16,
        3,
        DecodeConfig(block_n=32, num_warps=4, num_stages=1),
    )


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window", [5, 16, 40, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_windowed_decode_matches_reference(dtype, window, softcap, request):
    """Each request's last ``window`` keys divided between 3 splits (some empty)."""
    gen, seed = make_generator(request)
    _run(gen, seed, SEQ_LENS, 4, 2, 32, dtype, 3, window=window, softcap=softcap)


def test_choose_num_kv_splits():
    assert choose_num_kv_splits(1, 8, 32768, 132) == MAX_KV_SPLITS  # few programs, long sequences
    assert choose_num_kv_splits(256, 8, 32768, 132) == 1  # the batch fills the device
    assert choose_num_kv_splits(4, 8, 700, 132, min_split_len=256) == 3  # bounded by split length
    assert choose_num_kv_splits(4, 8, 1, 132) == 1


def _valid_args(gen):
    kv = paged_kv(gen, [3, 5], 2, 32, torch.float32)
    q = randn(gen, 2, 4, 32, dtype=torch.float32)
    return dict(
        q=q,
        k_buffer=kv.k_buffer,
        v_buffer=kv.v_buffer,
        o=torch.empty_like(q),
        kv_indptr=kv.indptr,
        kv_indices=kv.indices,
        sm_scale=0.2,
        num_kv_splits=2,
        workspace=DecodeWorkspace.allocate(2, 4, 32, 2, DEVICE),
    )


# (label, argument, replacement given the valid args, the name the error must start with)
BAD_ARGS = [
    ("q_4d", "q", lambda a: a["q"][None], "q"),
    ("q_int", "q", lambda a: a["q"].int(), "q"),
    ("q_heads_not_multiple", "q", lambda a: a["q"][:, :3], "q"),
    ("o_shape", "o", lambda a: a["o"][:1], "o"),
    ("o_last_dim_strided", "o", lambda a: a["o"].transpose(1, 2).contiguous().transpose(1, 2), "o"),
    ("k_buffer_dtype", "k_buffer", lambda a: a["k_buffer"].half(), "k_buffer"),
    ("v_buffer_rows", "v_buffer", lambda a: a["v_buffer"][:-1], "v_buffer"),
    ("kv_indptr_length", "kv_indptr", lambda a: a["kv_indptr"][:2], "kv_indptr"),
    ("kv_indices_int16", "kv_indices", lambda a: a["kv_indices"].short(), "kv_indices"),
    ("num_kv_splits_zero", "num_kv_splits", lambda a: 0, "num_kv_splits"),
    ("num_kv_splits_too_many", "num_kv_splits", lambda a: MAX_KV_SPLITS + 1, "num_kv_splits"),
    ("sm_scale_nan", "sm_scale", lambda a: float("nan"), "sm_scale"),
    ("window_zero", "window", lambda a: 0, "window"),
    ("softcap_negative", "softcap", lambda a: -1.0, "softcap"),
    (
        "workspace_splits",
        "workspace",
        lambda a: DecodeWorkspace.allocate(2, 4, 32, 3, DEVICE),
        "workspace.partial_o",
    ),
    (
        "workspace_lse_dtype",
        "workspace",
        lambda a: a["workspace"]._replace(partial_lse=a["workspace"].partial_lse.half()),
        "workspace.partial_lse",
    ),
]
VALUE_ARGS = [  # index values: checked only on CPU, where it costs no device sync
    ("kv_indptr_not_from_zero", "kv_indptr", lambda a: a["kv_indptr"] + 1, "kv_indptr"),
    ("kv_indices_short", "kv_indices", lambda a: a["kv_indices"][:-1], "kv_indices"),
    ("kv_indices_negative", "kv_indices", lambda a: a["kv_indices"] - 100, "kv_indices"),
]


@pytest.mark.parametrize(
    "label,name,replace,arg", BAD_ARGS + VALUE_ARGS, ids=[b[0] for b in BAD_ARGS + VALUE_ARGS]
)
def test_decode_rejects_bad_arguments(label, name, replace, arg, request):
    gen, _ = make_generator(request)
    checks_values = label in {b[0] for b in VALUE_ARGS}
    assert_rejects(decode_attention, _valid_args(gen), name, replace, arg, checks_values)
