"""Model layers: oneDNN-packed CPU weights (bf16) give the plain layers' results."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from radixrt.model import layers
from radixrt.model.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                  pack_cpu_weights)

needs_onednn = pytest.mark.skipif(
    layers._ONEDNN_LINEAR is None or not torch.backends.mkldnn.is_available(),
    reason="this PyTorch build has no oneDNN linear ops")


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = ColumnParallelLinear(32, 48, bias=True)
        self.down = RowParallelLinear(48, 32)
        self.head = ParallelLMHead(100, 32)
        for p in self.parameters():
            p.data.normal_()
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.up(x)))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_bf16_model_matches_plain(rows: int) -> None:
    plain = Tiny(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_cpu_weights(packed)
    assert packed.up.packed and packed.down.packed and packed.up.weight.is_mkldnn
    assert packed.head.packed_weight is not None and not packed.head.weight.is_mkldnn  # kept plain
    x = torch.randn(rows, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-2, atol=1e-1)
    assert not pack_cpu_weights(packed)  # nothing left to pack


@needs_onednn
def test_packed_layers_compile() -> None:
    # Inductor cannot lower oneDNN's packed layout: under torch.compile the packed linears and
    # the LM head go through the opaque radixrt::onednn_linear op, the very kernels eager runs.
    packed = Tiny(torch.bfloat16)
    assert pack_cpu_weights(packed)
    compiled = torch.compile(packed, dynamic=True)
    with torch.inference_mode():
        for rows in (3, 17):
            x = torch.randn(rows, 32, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), packed(x), rtol=0, atol=0)


def test_other_dtypes_stay_plain() -> None:
    model = Tiny(torch.float32)
    assert not pack_cpu_weights(model)
    assert not model.up.packed and not model.up.weight.is_mkldnn and model.head.packed_weight is None


@needs_onednn
def test_bf16_cpu_engine_packs_its_weights(tiny_llama: str) -> None:
    from radixrt import Engine
    with Engine(model=tiny_llama, dtype="bfloat16", max_total_tokens=256) as eng:
        assert eng.runner.packed_weights
    with Engine(model=tiny_llama, dtype="float32", max_total_tokens=256) as eng:
        assert not eng.runner.packed_weights


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
