"""The elementwise CPU kernels (radixrt_kernels.cpu_ops) against the PyTorch ops they replace
in the model's layers: RMS norm with and without the residual add, the rotary embedding in place
on a strided q/k view, SiLU-and-mul; float32 and bfloat16."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixrt.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from radixrt.model.loader import cache_dir
from radixrt_kernels import cpu_library

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="no C compiler: the CPU kernels cannot be built here")


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
    fast, plain = module_cls(*args), module_cls(*args)
    fast.cpu_lib = cpu_library.load(cache_dir())
    return fast, plain


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
def test_rope_in_place_on_a_qkv_view(lib, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    fast, plain = _pair(RotaryEmbedding, 64, 4096, 10000.0)
    qkv = torch.randn(21, 15 * 64).to(dtype)  # q 9 heads, k 3, v 3
    positions = torch.randint(0, 4096, (21,))
    want = plain(positions, qkv[:, :12 * 64].view(21, 12, 64))
    v_before = qkv[:, 12 * 64:].clone()
    got = fast(positions, qkv[:, :12 * 64].view(21, 12, 64))
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # v untouched
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(lib, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    fast, plain = _pair(SiluAndMul)
    x = (torch.randn(19, 2 * 100) * 4).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0])
    _close(fast(x), plain(x))


def test_unusable_tensors_take_pytorch_ops(lib) -> None:
    fast, plain = _pair(SiluAndMul)
    x = torch.randn(4, 16, dtype=torch.float16)  # no fp16 kernel
    torch.testing.assert_close(fast(x), plain(x))
