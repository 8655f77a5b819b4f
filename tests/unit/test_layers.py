"""Model layers: packed CPU weights (bf16: the AMX kernel's layout, or oneDNN's) give the plain
layers' results."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from radixrt.model import layers
from radixrt.model.layers import (MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                  SiluAndMul, pack_cpu_weights)
from radixrt.model.loader import cache_dir
from radixrt_kernels import cpu_library, cpu_linear

needs_onednn = pytest.mark.skipif(
    layers._ONEDNN_LINEAR is None or not torch.backends.mkldnn.is_available(),
    reason="this PyTorch build has no oneDNN linear ops")


def amx_library():
    lib = cpu_library.load(cache_dir())
    if not cpu_linear.available(lib):
        pytest.skip(f"no AMX linear kernel here (library: {cpu_library.why_unavailable() or 'built'})")
    return lib


def library_for(packing: str):
    return amx_library() if packing == "amx" else None  # no library: oneDNN's layout


class Tiny(nn.Module):
    """An MLP ([gate; up], SiLU-and-mul, down with a bias) and an LM head."""

    def __init__(self, dtype: torch.dtype, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = MergedColumnParallelLinear(hidden, [64, 64], silu_gated=True)
        self.down = RowParallelLinear(64, hidden, bias=True)
        self.head = ParallelLMHead(100, hidden)
        for p in self.parameters():
            p.data.normal_(std=0.3)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.head(self.down(h if self.up.fused_act else SiluAndMul()(h)))


PACKINGS = [pytest.param("onednn", marks=needs_onednn), "amx"]


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_bf16_model_matches_plain(packing: str, rows: int) -> None:
    plain = Tiny(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_cpu_weights(packed, library_for(packing)) == packing
    assert packed.up.packing == packed.down.packing == packed.head.packing == packing
    assert packed.up.fused_act == (packing == "amx")  # SiLU-and-mul in the AMX kernel's pass
    assert packed.up.weight.is_mkldnn == (packing == "onednn")
    assert packed.head.packed_weight is not None and not packed.head.weight.is_mkldnn  # kept plain
    x = torch.randn(rows, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = packed(x), plain(x)
    assert got.dtype == want.dtype == torch.float32  # logits
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-1)
    assert pack_cpu_weights(packed, library_for(packing)) is None  # nothing left to pack


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 45, 64, 100, 700])
def test_amx_linear_equals_pytorch(rows: int) -> None:
    # Up to 32 rows (a decode batch) and for large prefills the kernel adds the products in
    # oneDNN's order: bit-equal to F.linear. In between oneDNN picks kernels of other orders, so
    # there: equal up to bf16 rounding, and as close to a float64 product as F.linear.
    lib = amx_library()
    torch.manual_seed(rows)
    n, k = 200, 96  # a short last block of features (200 = 6·32 + 8)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(rows, 3 * k, dtype=torch.bfloat16)[:, k:2 * k]  # strided rows
    packed = cpu_linear.pack(lib, w)
    exact = (x.double() @ w.double().T + bias.double()).float()
    for b in (None, bias):
        got = cpu_linear.linear(lib, x, packed, n, b)
        want = torch.nn.functional.linear(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        if rows <= 32:
            assert torch.equal(got, want)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0.05)
    got = cpu_linear.linear(lib, x, packed, n, bias, float_out=True)
    assert got.dtype == torch.float32
    assert torch.equal(got, cpu_linear.linear(lib, x, packed, n, bias).float())
    err_ours = (got - exact).abs().mean()
    err_torch = (torch.nn.functional.linear(x, w, bias).float() - exact).abs().mean()
    assert err_ours <= err_torch * 1.05


@pytest.mark.parametrize("rows", [1, 17, 32, 100, 700])
def test_gated_amx_linear_is_silu_and_mul_of_the_two_products(rows: int) -> None:
    # [gate; up] packed gated: silu(gate)·up in the same pass, bit-equal to the two steps apart
    # (the linear, then cpu_ops.silu_mul, which rounds as PyTorch's F.silu(gate) * up does).
    from radixrt_kernels import cpu_ops
    lib = amx_library()
    torch.manual_seed(rows)
    w = (torch.randn(192, 96) * 0.2).bfloat16()  # gate and up: 96 rows each (3 blocks of 32)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = cpu_linear.linear(lib, x, cpu_linear.pack(lib, w, gated=True), 192, gated=True)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_ops.silu_mul(lib, cpu_linear.linear(lib, x, cpu_linear.pack(lib, w), 192)))
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), (torch.nn.functional.silu(gate) * up).float(), rtol=2 ** -7, atol=1e-2)
    with pytest.raises(ValueError, match="gate; up"):
        cpu_linear.pack(lib, w[:160], gated=True)  # halves of 80 rows: not whole blocks


def test_llama_mlp_fuses_silu_into_its_gate_up_linear() -> None:
    from radixrt.model.layers import MergedColumnParallelLinear, RowParallelLinear, SiluAndMul
    lib = amx_library()
    torch.manual_seed(0)
    mlp = nn.ModuleDict({"gate_up": MergedColumnParallelLinear(64, [96, 96], silu_gated=True),
                         "down": RowParallelLinear(96, 64)})
    for p in mlp.parameters():
        p.data.normal_(std=0.2)
    mlp.to(torch.bfloat16)
    plain = copy.deepcopy(mlp)
    assert pack_cpu_weights(mlp, lib) == "amx" and mlp.gate_up.fused_act
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert mlp.gate_up(x).shape == (5, 96)
        want = plain.down(SiluAndMul()(plain.gate_up(x)))
        torch.testing.assert_close(mlp.down(mlp.gate_up(x)), want, rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("head_dim,bias", [(64, False), (64, True), (128, True)])
def test_qkv_linear_rotates_q_and_k_in_its_own_pass(head_dim: int, bias: bool) -> None:
    # QKVParallelLinear.rotated (fused_rope): [q, k, v] with q and k rotated, bit-equal to the
    # linear followed by the rotary embedding (cpu_ops.rope_), eager and under torch.compile.
    from radixrt.model.layers import QKVParallelLinear, RotaryEmbedding
    from radixrt_kernels import cpu_ops
    lib = amx_library()
    torch.manual_seed(head_dim)
    qkv = QKVParallelLinear(96, head_dim, 4, 2, bias=bias, rope_follows=True)
    for p in qkv.parameters():
        p.data.normal_(std=0.3)
    qkv.to(torch.bfloat16)
    plain = copy.deepcopy(qkv)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    assert pack_cpu_weights(qkv, lib) == "amx" and qkv.fused_rope
    rotated = torch.compile(lambda x, pos: qkv.rotated(x, pos, rotary), dynamic=True)
    with torch.inference_mode():
        for rows in (1, 33, 300):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            positions = torch.randint(0, 4096, (rows,))
            want = qkv(x)  # the same kernel without the rotation
            assert torch.equal(want, plain(x)) or rows > 32  # (bit-equal to F.linear up to 32 rows)
            cpu_ops.rope_(lib, want[:, :6 * head_dim].view(rows, 6, head_dim), positions, rotary.cos,
                          rotary.sin_signed)
            assert torch.equal(qkv.rotated(x, positions, rotary), want)
            assert torch.equal(rotated(x, positions), want)


def test_amx_linear_rejects_what_it_cannot_take() -> None:
    lib = amx_library()
    w = torch.randn(64, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack(lib, torch.randn(64, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack(lib, w.float())
    packed = cpu_linear.pack(lib, w)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear(lib, torch.randn(2, 64, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(ValueError, match="bf16"):
        cpu_linear.linear(lib, torch.randn(2, 96), packed, 64)


def test_amx_packing_needs_packable_weights() -> None:
    # in_features that are not a multiple of 32: no AMX layout; oneDNN's, where it exists
    lib = amx_library()
    model = Tiny(torch.bfloat16, hidden=40)
    expected = "onednn" if layers._ONEDNN_LINEAR is not None and torch.backends.mkldnn.is_available() else None
    assert pack_cpu_weights(model, lib) == expected


@pytest.mark.parametrize("packing", PACKINGS)
def test_packed_layers_compile(packing: str) -> None:
    # Inductor cannot lower the packed layouts: under torch.compile the packed linears and the
    # LM head go through the opaque radixrt::amx_linear / radixrt::onednn_linear ops, the very
    # kernels eager runs: with AMX (SiLU-and-mul inside the op) the same results bit for bit;
    # with oneDNN's layout Inductor fuses the SiLU-and-mul itself, rounding once instead of
    # twice, so there: equal up to that rounding.
    packed = Tiny(torch.bfloat16)
    assert pack_cpu_weights(packed, library_for(packing)) == packing
    compiled = torch.compile(packed, dynamic=True)
    exact = packing == "amx"
    with torch.inference_mode():
        for rows in (3, 17):
            x = torch.randn(rows, 32, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), packed(x), rtol=0 if exact else 0.05, atol=0 if exact else 0.5)


def test_other_dtypes_stay_plain() -> None:
    model = Tiny(torch.float32)
    assert pack_cpu_weights(model, cpu_library.load(cache_dir())) is None
    assert model.up.packing is None and not model.up.weight.is_mkldnn and model.head.packed_weight is None


def test_bf16_cpu_engine_packs_its_weights(tiny_llama: str) -> None:
    from radixrt import Engine
    lib = cpu_library.load(cache_dir())
    expected = "amx" if cpu_linear.available(lib) else "onednn" if layers._ONEDNN_LINEAR is not None else None
    with Engine(model=tiny_llama, dtype="bfloat16", max_total_tokens=256) as eng:
        assert eng.runner.weight_packing == expected
    with Engine(model=tiny_llama, dtype="float32", max_total_tokens=256) as eng:
        assert eng.runner.weight_packing is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_rotate_half_bit_for_bit(dtype) -> None:
    # Hugging Face's form: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1].
    from radixrt.model.layers import RotaryEmbedding
    rope = RotaryEmbedding(64, 256, 10000.0)
    torch.manual_seed(0)
    positions = torch.randint(0, 256, (7,))
    x = torch.randn(7, 12, 64, dtype=dtype)
    cos = rope.cos[positions].unsqueeze(1).to(dtype)
    sin = torch.cat([rope.sin_signed[:, 32:]] * 2, dim=-1)[positions].unsqueeze(1).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos + torch.cat([-x2, x1], dim=-1) * sin
    assert torch.equal(rope(positions, x), want)
    assert torch.equal(rope(positions, x[:, 3:9]), want[:, 3:9])  # a strided view of some heads


def test_cpus_without_amx_get_onednn_layout(monkeypatch, tmp_path) -> None:
    """A library built without AMX (as on CPUs that lack it) has no linear kernel: the model
    keeps oneDNN's layout and its results."""
    from radixrt_kernels import cpu_library as library
    monkeypatch.setattr(library, "CFLAGS", [*library.CFLAGS, "-mno-amx-tile"])
    lib = library._build_and_load(tmp_path)
    assert not cpu_linear.available(lib)
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    y = torch.empty(2, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    packed = cpu_linear.pack(lib, w)  # packing is plain C: it still works
    assert lib.radixrt_linear(x.data_ptr(), 32, packed.data_ptr(), None, y.data_ptr(), 64, 0, 0, None, None, None,
                              0, 0, 2, 64, 32, 1) == -1
    model = Tiny(torch.bfloat16)
    expected = "onednn" if layers._ONEDNN_LINEAR is not None and torch.backends.mkldnn.is_available() else None
    assert pack_cpu_weights(model, lib) == expected
