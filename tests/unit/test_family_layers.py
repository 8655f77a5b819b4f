"""The layers the families beyond Llama are built of, against transformers' modules on the same
inputs: Gemma's RMSNorm, GeGLU, scaled embeddings and soft-capped logits; phi3's partial
rotation and fused checkpoint weights; and the decode chain's refusal of PyTorch's steps."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.hf_config import ModelConfig
from radixrt.model.layers import (
    GateUpLinear,
    GeluGateUpLinear,
    GemmaRMSNorm,
    LogitSoftCap,
    PartialRotaryEmbedding,
    QKVLinear,
    ScaledVocabEmbedding,
    gelu_tanh,
)
from radixrt.quant.formats import QuantTensor, random_blocks
from radixrt.testing import make_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_is_transformers_bit_for_bit(dtype):
    """x·(1 + w) in float32, one rounding; with a residual, the norm of the sum and the sum."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(9, 256, generator=gen).to(dtype) for _ in range(2))
    weight = (0.3 * torch.randn(256, generator=gen)).to(dtype)
    hf = Gemma2RMSNorm(256, eps=1e-6).to(dtype)
    ours = GemmaRMSNorm(256, 1e-6).to(dtype)
    hf.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    assert torch.equal(ours(x), hf(x))
    normed, summed = ours(x, r)
    assert torch.equal(summed, r + x) and torch.equal(normed, hf(r + x))
    heads = x.view(9, 8, 32)  # a q/k norm per head (gemma3)
    hf_heads, ours_heads = Gemma2RMSNorm(32).to(dtype), GemmaRMSNorm(32, 1e-6).to(dtype)
    hf_heads.weight.data.copy_(weight[:32])
    ours_heads.weight.data.copy_(weight[:32])
    assert torch.equal(ours_heads(heads), hf_heads(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_rows_do_not_depend_on_the_batch(dtype):
    """Exact outputs: a row's bits are the same alone and among 1..700 rows."""
    gen = torch.Generator().manual_seed(6)
    x, r = (torch.randn(700, 2304, generator=gen).to(dtype) for _ in range(2))
    norm = GemmaRMSNorm(2304, 1e-6).to(dtype)
    norm.weight.data.copy_(0.3 * torch.randn(2304, generator=gen))
    alone = [norm(x[i : i + 1]) for i in (0, 5)]
    alone_sum = [norm(x[i : i + 1], r[i : i + 1])[0] for i in (0, 5)]
    for rows in (6, 17, 64, 333, 700):
        out, (out_sum, _) = norm(x[:rows]), norm(x[:rows], r[:rows])
        assert torch.equal(out[0:1], alone[0]) and torch.equal(out[5:6], alone[1])
        assert torch.equal(out_sum[0:1], alone_sum[0]) and torch.equal(out_sum[5:6], alone_sum[1])


def test_geglu_is_gelu_tanh_of_gate_times_up():
    """transformers' gelu_pytorch_tanh of the gate times up, within float32 rounding."""
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(1)
    gate, up, x = (torch.randn(*shape, generator=gen) for shape in ((96, 64), (96, 64), (5, 64)))
    mlp = GeluGateUpLinear(64, 96)
    mlp.weight_loader(mlp.weight, gate, 0)
    mlp.weight_loader(mlp.weight, up, 1)
    mlp.prepare_weights()
    both = torch.nn.functional.linear(x, torch.cat([gate, up]))
    want = ACT2FN["gelu_pytorch_tanh"](both[:, :96]) * both[:, 96:]
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3])
def test_gelu_tanh_rows_do_not_depend_on_the_batch(dtype, threads):
    """Exact outputs: each element's bits are the same alone and in a batch of rows split
    among threads anywhere (a width no vector divides)."""
    gen = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(64, 9000, generator=gen)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = {rows: gelu_tanh(x[:rows].float()) for rows in (2, 5, 17, 64)}
        alone = [gelu_tanh(x[i : i + 1].float()) for i in range(64)]
    finally:
        torch.set_num_threads(before)
    for rows, out in batched.items():
        assert all(torch.equal(out[i : i + 1], alone[i]) for i in range(rows)), rows
    single = torch.cat([gelu_tanh(x[0, i : i + 1].float()) for i in range(9000)])
    assert torch.equal(single, alone[0][0])  # every element as the scalar loop gives it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embedding_rounds_its_multiplier_as_transformers(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    hidden = 3072  # sqrt: 55.4256..., 55.5 in bf16
    weight = torch.randn(10, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    hf = Gemma2TextScaledWordEmbedding(10, hidden, 0, embed_scale=hidden**0.5).to(dtype)
    hf.weight.data.copy_(weight)
    with torch.device("cpu"):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            ours = ScaledVocabEmbedding(10, hidden)
        finally:
            torch.set_default_dtype(default)
    ours.weight.data.copy_(weight)
    ids = torch.tensor([3, 0, 9, 3])
    assert torch.equal(ours(ids), hf(ids))


def test_logit_softcap_is_transformers():
    logits = 20 * torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    want = torch.tanh(logits / 30.0) * 30.0  # Gemma2ForCausalLM's three steps
    assert torch.equal(LogitSoftCap(30.0)(logits), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotation_is_phi3s_bit_for_bit(dtype):
    """The first rotary_dim dimensions of each head rotate (neox among them), the rest pass;
    cos and sin as transformers' Phi3RotaryEmbedding gives them at the same positions."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = Phi3Config(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=4, partial_rotary_factor=0.75
    )
    gen = torch.Generator().manual_seed(4)
    positions = torch.tensor([0, 5, 17, 300, 4095])
    q, k = (torch.randn(5, n, 32, generator=gen).to(dtype) for n in (8, 4))
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    rotary = PartialRotaryEmbedding(24, 4096, 10000.0)
    assert torch.equal(rotary(positions, q), want_q[0].transpose(0, 1))
    assert torch.equal(rotary(positions, k), want_k[0].transpose(0, 1))


def test_fused_checkpoint_weights_split_into_the_stacked_shards():
    """phi3's qkv_proj and gate_up_proj: their rows are q, k, v (gate, up) in order, dense or
    quantized; a fused weight of the wrong height is refused."""
    gen = torch.Generator().manual_seed(5)
    qkv = QKVLinear(64, 16, 4, 2)  # q 64 rows, k and v 32 each
    fused = torch.randn(128, 64, generator=gen)
    qkv.weight_loader(qkv.weight, fused)
    assert torch.equal(qkv.weight, fused)
    gate_up = GateUpLinear(64, 48)
    fused = torch.randn(96, 64, generator=gen)
    gate_up.weight_loader(gate_up.weight, fused)
    assert torch.equal(gate_up.weight, fused)
    with pytest.raises(ValueError, match="fused checkpoint weight of 100 rows"):
        qkv.weight_loader(qkv.weight, torch.randn(100, 64))

    blocks = QuantTensor("Q8_0", random_blocks("Q8_0", 128, 64, gen), 64)
    quantized = QKVLinear(64, 16, 4, 2)
    quantized.weight_loader(quantized.weight, blocks)
    parts = quantized.weight.quant
    assert [parts[s].shape for s in ("q", "k", "v")] == [(64, 64), (32, 64), (32, 64)]
    assert torch.equal(torch.cat([parts[s].raw for s in ("q", "k", "v")]), blocks.raw)


def test_phi3_checkpoint_loads_into_the_stacked_layers(tmp_path):
    from radixrt.model.llama import LlamaForCausalLM
    from radixrt.model.weights import iter_weights

    path = make_tiny_model(tmp_path, "phi3", num_layers=2)
    weights = dict(iter_weights(path))
    model = LlamaForCausalLM(ModelConfig.from_pretrained(path))
    model.load_weights(weights.items())
    layer = model.model.layers[1]
    assert torch.equal(
        layer.self_attn.qkv_proj.weight, weights["model.layers.1.self_attn.qkv_proj.weight"]
    )
    assert torch.equal(
        layer.mlp.gate_up_proj.weight, weights["model.layers.1.mlp.gate_up_proj.weight"]
    )


def test_gemma_and_partial_rotation_keep_the_decode_chain_off_by_name(tmp_path):
    """A layer step in PyTorch (Gemma's norm; a partial rotation, which the C rotary does not
    take) refuses the capture with where it happened: the runner runs those models layer by
    layer."""
    from radixrt.attention.cpu_backend import CpuAttentionBackend, unavailable_reason
    from radixrt.cache.kv_pool import KVPool
    from radixrt.model.decode_chain import decode_chain_for
    from radixrt.model.kernel_set import choose_kernels
    from radixrt.model.llama import LlamaForCausalLM
    from radixrt.model.weights import cache_dir, iter_weights
    from radixrt_kernels.cpu import chain as cpu_chain
    from radixrt_kernels.cpu import library as cpu_library
    from radixrt_kernels.cpu import linear as cpu_linear

    lib = cpu_library.load(cache_dir())
    runs = [k for k in cpu_chain.KERNELS if lib is not None and cpu_linear.kernel_available(lib, k)]
    if not runs:
        pytest.skip("no linear kernel a chain runs works here")
    bf16 = torch.bfloat16
    for arch, where in (("gemma2", "at layers.py"), ("phi3", "at kernel_set.py")):
        path = make_tiny_model(tmp_path / arch, arch, num_layers=2)
        cfg = ModelConfig.from_pretrained(path)
        kernels = choose_kernels(torch.device("cpu"), bf16, lib, linear=runs[0])
        default = torch.get_default_dtype()
        torch.set_default_dtype(bf16)
        try:
            model = LlamaForCausalLM(cfg, kernels)
        finally:
            torch.set_default_dtype(default)
        model.load_weights(iter_weights(path))
        pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bf16, 4, 64)
        if unavailable_reason(pool) is not None:
            pytest.skip(unavailable_reason(pool))
        backend = CpuAttentionBackend(pool, cfg.num_heads)
        chain, info = decode_chain_for(model.eval(), backend, lib)
        assert chain is None and info.startswith("off: ") and where in info, (arch, info)
