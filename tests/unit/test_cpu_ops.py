"""The elementwise CPU kernels (radixrt_kernels.cpu.elementwise) against the PyTorch ops they
replace in the model's layers: RMS norm with and without the residual add, the rotary embedding
in place on a strided q/k view, SiLU-and-mul; float32 and bfloat16. The sampling kernels
(radixrt_kernels.cpu.sampling_ops: argmax, the grammar bitmask) against PyTorch's."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.kernel_set import (
    CRMSNorm,
    CRotary,
    CSiluMul,
    Kernels,
    TorchSiluMul,
    choose_kernels,
)
from radixrt.model.layers import RMSNorm, RotaryEmbedding
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import elementwise, sampling_ops
from radixrt_kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(
    cpu_library.compiler() is None,
    reason="no C compiler: the CPU kernels cannot be built here",
)


@pytest.fixture(scope="module")
def lib():
    lib = cpu_library.load(cache_dir())
    assert lib is not None, cpu_library.why_unavailable()
    return lib


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: equal but for a rare last-bit flip (float32 sums in another order); fp32: 1e-6."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.995
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _pair(module_cls, *args):
    """(the layer through the kernels, the same layer on PyTorch's ops)."""
    lib = cpu_library.load(cache_dir())
    kernels = Kernels(norm=CRMSNorm(lib), rotary=CRotary(lib), act=CSiluMul(lib))
    return module_cls(*args, kernels=kernels), module_cls(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(lib, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    fast, plain = _pair(RMSNorm, 200, 1e-6)
    weight = torch.randn(200).to(dtype)
    for m in (fast, plain):
        m.weight.data = weight
    wide = (torch.randn(37, 300) * 3).to(dtype)
    x = wide[:, 50:250]  # strided rows
    _close(fast(x), plain(x))
    residual = torch.randn(37, 200).to(dtype)
    r_fast, r_plain = residual.clone(), residual.clone()
    out_fast, new_fast = fast(x, r_fast)
    out_plain, new_plain = plain(x, r_plain)
    assert new_fast is r_fast and torch.equal(r_fast, x + residual)  # the sum, in place, exact
    assert torch.equal(new_plain, x + residual)
    _close(out_fast, out_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_rms_norm_of_a_qkv_view(lib, dtype: torch.dtype) -> None:
    """q or k [T, H, D] as a view into a qkv row (a q/k norm): each head normed in place by the C
    kernel, as the 2-D norm does each row, and as PyTorch's ops do up to the last bit."""
    torch.manual_seed(1)
    fast, plain = _pair(RMSNorm, 64, 1e-6)
    weight = (1 + 0.1 * torch.randn(64)).to(dtype)
    for m in (fast, plain):
        m.weight.data = weight
    qkv = (torch.randn(9, (4 + 2 + 2) * 64) * 2).to(dtype)
    k = qkv[:, 4 * 64 : 6 * 64].view(9, 2, 64)  # strided token rows, contiguous heads
    rows = fast(k.reshape(18, 64))  # the rows' kernel, per head (on a copy)
    want = plain(k)
    q_and_v = torch.cat([qkv[:, : 4 * 64], qkv[:, 6 * 64 :]], 1)
    got = fast(k)
    assert got.shape == (9, 2, 64) and got.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(got.reshape(18, 64), rows)
    assert torch.equal(torch.cat([qkv[:, : 4 * 64], qkv[:, 6 * 64 :]], 1), q_and_v)
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_a_qkv_view(lib, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    fast, plain = _pair(RotaryEmbedding, 64, 4096, 10000.0)
    qkv = torch.randn(21, 15 * 64).to(dtype)  # q 9 heads, k 3, v 3
    positions = torch.randint(0, 4096, (21,))
    want = plain(positions, qkv[:, : 12 * 64].view(21, 12, 64))
    v_before = qkv[:, 12 * 64 :].clone()
    got = fast(positions, qkv[:, : 12 * 64].view(21, 12, 64))
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # v untouched
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(lib, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    fast, plain = CSiluMul(lib), TorchSiluMul()
    x = (torch.randn(19, 2 * 100) * 4).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0])
    _close(fast(x), plain(x))


def test_other_dtypes_get_pytorchs_ops(lib) -> None:
    kernels = choose_kernels(torch.device("cpu"), torch.float16, lib)  # no fp16 kernel
    assert {kernels.norm.name, kernels.rotary.name, kernels.act.name} == {"torch"}
    assert choose_kernels(torch.device("cpu"), torch.float32, lib).norm.name == "c"
    assert choose_kernels(torch.device("cpu"), torch.float32, None).norm.name == "torch"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        elementwise.silu_mul(lib, torch.randn(4, 16, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_pytorch(lib, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = torch.randn(9, 1000 + 7).to(dtype)[:, 3:1003]  # strided rows, a tail past 16 lanes
    x[1, 10] = x[1, 990] = 40.0  # a tie: the first index
    x[2, 999] = 40.0  # the maximum in the tail
    x[3, 500] = float("nan")  # NaN wins, as in PyTorch
    x[4, :] = float("-inf")  # all -inf: index 0
    x[5, 20] = float("nan")
    x[5, 700] = float("nan")  # the first NaN
    got = sampling_ops.argmax(lib, x)
    assert torch.equal(got, x.argmax(-1))
    assert got[:6].tolist() == [int(x[0].argmax()), 10, 999, 500, 0, 20]


def test_greedy_sampling_takes_the_kernel_argmax(lib, monkeypatch) -> None:
    from radixrt import SamplingParams
    from radixrt.sampling import Sampler

    calls = []
    real = sampling_ops.argmax
    monkeypatch.setattr(
        sampling_ops, "argmax", lambda lib_, x: calls.append(x.shape) or real(lib_, x)
    )
    logits = torch.randn(4, 300)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4)
    assert calls == [(4, 300)] and torch.equal(out.token_ids, logits.argmax(-1))


def test_ops_built_without_avx512_agree(lib, monkeypatch, tmp_path) -> None:
    """The portable build (CPUs without AVX-512: narrower vectors, a division for 1/x) gives
    the native build's results."""
    monkeypatch.setattr(cpu_library, "CFLAGS", [*cpu_library.CFLAGS, "-mno-avx512f"])
    other = cpu_library._build_and_load(tmp_path)
    torch.manual_seed(4)
    x = torch.randn(5, 2 * 200).bfloat16()
    w = torch.randn(200).bfloat16()
    res = torch.randn(5, 200).bfloat16()
    r1, r2 = res.clone(), res.clone()
    torch.testing.assert_close(
        elementwise.rms_norm(other, x[:, :200], w, 1e-6, r1),
        elementwise.rms_norm(lib, x[:, :200], w, 1e-6, r2),
        atol=1e-2,
        rtol=1e-2,
    )
    assert torch.equal(r1, r2)
    torch.testing.assert_close(
        elementwise.silu_mul(other, x).float(),
        elementwise.silu_mul(lib, x).float(),
        atol=1e-2,
        rtol=1e-2,
    )
    cos, sin = torch.randn(50, 64), torch.randn(50, 64)
    qk1, qk2 = (torch.randn(5, 4, 64).bfloat16() for _ in range(2))
    qk2.copy_(qk1)
    pos = torch.tensor([0, 3, 49, 7, 7])
    assert torch.equal(
        elementwise.rope_(other, qk1, pos, cos, sin), elementwise.rope_(lib, qk2, pos, cos, sin)
    )
    assert torch.equal(sampling_ops.argmax(other, x), sampling_ops.argmax(lib, x))


@pytest.mark.parametrize("vocab", [31, 64, 1000, 49157])
def test_token_bitmask_matches_xgrammars_apply(lib, vocab: int) -> None:
    """Words wholly blocked, wholly allowed and mixed; a vocabulary that ends inside a word; only
    the given rows touched."""
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, -(-vocab // 32)), generator=gen).int()
    bitmask[:, ::4] = 0  # nothing allowed
    bitmask[:, 1::4] = -1  # everything allowed
    logits = torch.randn(6, vocab, generator=gen)
    rows = [0, 2, 5]
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    got = logits.clone()
    sampling_ops.apply_token_bitmask(lib, got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 4]], logits[[1, 3, 4]])
    with pytest.raises(ValueError, match="apply_token_bitmask"):
        sampling_ops.apply_token_bitmask(lib, got, bitmask, torch.tensor([6]))
