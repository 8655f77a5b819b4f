"""store_kv against store_kv_ref: written rows equal, every other row untouched; argument checks."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, make_generator, randn

from radixrt_kernels.triton import INTERPRET
from radixrt_kernels.triton.reference import store_kv_ref
from radixrt_kernels.triton.store_kv import store_kv


def _case(
    gen: torch.Generator,
    n: int,
    kv_heads: int,
    head_dim: int,
    src: torch.dtype,
    dst: torch.dtype,
    slot_dtype: torch.dtype = torch.int64,
):
    num_slots = n + 9
    k = randn(gen, n, kv_heads, head_dim, dtype=src)
    v = randn(gen, n, kv_heads, head_dim, dtype=src)
    k_buf = randn(gen, num_slots, kv_heads, head_dim, dtype=dst)
    v_buf = randn(gen, num_slots, kv_heads, head_dim, dtype=dst)
    slots = torch.randperm(num_slots, generator=gen)[:n].to(slot_dtype).to(DEVICE)
    return k, v, k_buf, v_buf, slots


def _check(k, v, k_buf, v_buf, slots) -> None:
    want_k, want_v = k_buf.clone(), v_buf.clone()
    store_kv_ref(k, v, want_k, want_v, slots)
    store_kv(k, v, k_buf, v_buf, slots)
    if INTERPRET and k_buf.dtype == torch.bfloat16 and k.dtype != torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 (a GPU rounds to nearest): allow one bf16 ulp.
        torch.testing.assert_close(k_buf, want_k, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_buf, want_v, atol=0, rtol=2**-7)
        return
    assert torch.equal(k_buf, want_k)
    assert torch.equal(v_buf, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (4, 128), (2, 80), (8, 32)])
def test_store_kv_matches_reference(dtype, kv_heads, head_dim, request):
    gen, _ = make_generator(request)
    _check(*_case(gen, 13, kv_heads, head_dim, dtype, dtype))


@pytest.mark.parametrize(
    "src,dst",
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
    ids=str,
)
def test_store_kv_casts_to_buffer_dtype(src, dst, request):
    gen, _ = make_generator(request)
    _check(*_case(gen, 9, 2, 64, src, dst))


def test_store_kv_strided_rows_int32_slots_many_heads(request):
    """k, v as the model makes them (views into one qkv tensor); 64 heads split over programs."""
    gen, _ = make_generator(request)
    n, kv_heads, head_dim = 5, 64, 128
    qkv = randn(gen, n, 3 * kv_heads, head_dim, dtype=torch.float16)
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    _, _, k_buf, v_buf, slots = _case(
        gen, n, kv_heads, head_dim, torch.float16, torch.float16, torch.int32
    )
    assert not k.is_contiguous()
    _check(k, v, k_buf, v_buf, slots)


def test_store_kv_no_tokens(request):
    gen, _ = make_generator(request)
    _check(*_case(gen, 0, 2, 64, torch.float32, torch.float32))


def _bad_store_args():
    """(label, mutate(args) -> args, the argument name the error must mention)."""

    def replace(i, fn):
        return lambda a: a[:i] + (fn(a[i]),) + a[i + 1 :]

    cases = [
        ("k_2d", replace(0, lambda k: k[:, 0]), "k"),
        ("v_shape", replace(1, lambda v: v[:, :1]), "v"),
        ("k_int", replace(0, lambda k: k.to(torch.int32)), "k"),
        (
            "k_last_dim_strided",
            replace(0, lambda k: k.transpose(1, 2).contiguous().transpose(1, 2)),
            "k",
        ),
        ("buffer_heads", replace(2, lambda b: b[:, :1]), "k_buffer"),
        ("v_buffer_dtype", replace(3, lambda b: b.to(torch.float16)), "v_buffer"),
        ("slots_float", replace(4, lambda s: s.float()), "slots"),
        ("slots_count", replace(4, lambda s: s[:-1]), "slots"),
        ("slots_2d", replace(4, lambda s: s[:, None]), "slots"),
        ("slots_out_of_range", replace(4, lambda s: s + 1000), "slots"),  # checked only on CPU
    ]
    return cases


@pytest.mark.parametrize(
    "label,mutate,arg", _bad_store_args(), ids=[c[0] for c in _bad_store_args()]
)
def test_store_kv_rejects_bad_arguments(label, mutate, arg, request):
    if label == "slots_out_of_range" and DEVICE.type != "cpu":
        pytest.skip("index values are checked only for CPU tensors")
    gen, _ = make_generator(request)
    args = mutate(_case(gen, 4, 2, 32, torch.float32, torch.float32))
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        store_kv(*args)
