"""Quantization at load (``--quantization``): the legacy types are the gguf package's
quantizer's bytes, Q4_K's blocks decode (with the gguf package) within half a code step of
the weights, fallbacks are taken where rows are not whole blocks, and the flag is checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.quant.formats import QuantTensor
from radixrt.quant.rtn import quantize, quantized_weights, type_for


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_legacy_types_are_the_gguf_packages_quantizer(qtype) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(1))
    q = quantize(w, qtype)
    assert np.array_equal(q.raw.numpy(), gguf_quantize(w.numpy(), GGMLQuantizationType[qtype]))


def test_q4_k_decodes_within_half_a_step_of_each_sub_block() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 512, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row: zero scales, exact zeros back
    w[5, :256] = torch.rand(256, generator=g) * 1e-3  # a positive-only block (min 0)
    q = quantize(w, "Q4_K")
    assert q.raw.shape == (16, 2 * 144)
    back = q.dequantize()  # the gguf package's decoding of our bytes
    sub = w.reshape(16, -1, 32)
    half_step = ((sub.amax(-1) - sub.amin(-1).clamp(max=0)) / 15 / 2).repeat_interleave(32, -1)
    # 6-bit scale codes add up to 1/126 of the largest scale per code step
    bound = half_step.reshape(16, -1) * 1.1 + w.abs().amax(-1, keepdim=True) / 126
    assert ((back - w).abs() <= bound).all()
    assert torch.equal(back[3], torch.zeros(512))


def test_q4_k_falls_back_where_rows_are_not_whole_super_blocks() -> None:
    assert type_for("Q4_K", 512) == "Q4_K" and type_for("Q4_K", 576) == "Q5_0"
    with pytest.raises(ValueError, match="cannot be quantized to Q8_0"):
        type_for("Q8_0", 48)
    weights = [
        ("a.weight", torch.randn(4, 576)),
        ("b.weight", torch.randn(4, 256)),
        ("n", torch.ones(4)),
    ]
    out = dict(quantized_weights(weights, "q4_k"))
    assert isinstance(out["a.weight"], QuantTensor) and out["a.weight"].qtype == "Q5_0"
    assert out["b.weight"].qtype == "Q4_K" and torch.equal(out["n"], torch.ones(4))


def test_the_quantization_flag_is_checked() -> None:
    assert EngineConfig(quantization="q4_0").quantization == "q4_0"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        EngineConfig(quantization="gguf")
    with pytest.raises(ValueError, match="already quantized"):
        EngineConfig(model="m.gguf", quantization="q4_k")
