"""fused_moe (radixrt_kernels/triton/fused_moe.py) against its PyTorch reference: float32,
float16 and bf16, routing weights float32 (mixtral) or in x's dtype; hidden and expert widths
that leave partial tiles and K chunks; a token's bits alone equal its bits in the batch; every
token to one expert, experts without tokens, every expert for every token; the alignment of the
pairs by expert; what is not taken is refused by name. And ``SparseMoeBlock`` on
``FusedExperts`` (as on CUDA) against the block on its per-expert linears, from the same
checkpoint names.

The kernel rounds where the reference does, so their results differ only where a float32 dot,
summed in another order, lands on the other side of a 16-bit rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, TOLERANCE, make_generator

from radixrt.model.layers import prepare_weights
from radixrt.model.moe import FusedExperts, MoeSpec, SparseMoeBlock
from radixrt.quant.rtn import quantize
from radixrt_kernels.triton.fused_moe import (
    MoeTiling,
    align_by_expert,
    fused_moe,
    fused_moe_reference,
)

EXPERTS = 6
# (tokens, k, hidden, intermediate): partial N tiles (48, 80), two K chunks (160, 144)
SHAPES = [(1, 2, 64, 48), (5, 3, 64, 48), (33, 2, 160, 80), (7, 1, 64, 144)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_case(gen: torch.Generator, t: int, k: int, hidden: int, inter: int, dtype, weights):
    """x [t, hidden], stacked weights of unit-sized outputs, k distinct experts per token."""
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w_down = (torch.randn(EXPERTS, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    ids = torch.rand(t, EXPERTS, generator=gen).argsort(dim=1)[:, :k].contiguous()  # distinct
    topk_weights = torch.rand(t, k, generator=gen).to(weights)
    return [a.to(DEVICE) for a in (x, w_gate_up, w_down, ids, topk_weights)]


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("float32_weights", [False, True])
def test_fused_moe_is_the_reference(request, shape, dtype, float32_weights) -> None:
    gen, seed = make_generator(request)
    weights = torch.float32 if float32_weights else dtype
    args = make_case(gen, *shape, dtype, weights)
    got = fused_moe(*args)
    assert got.dtype == dtype and got.shape == args[0].shape, seed
    check_close(got, fused_moe_reference(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tokens_bits_do_not_depend_on_its_batch(request, dtype) -> None:
    gen, seed = make_generator(request)
    x, w_gate_up, w_down, ids, weights = make_case(gen, 20, 2, 64, 48, dtype, dtype)
    batch = fused_moe(x, w_gate_up, w_down, ids, weights)
    for i in range(len(x)):
        alone = fused_moe(x[i : i + 1], w_gate_up, w_down, ids[i : i + 1], weights[i : i + 1])
        assert torch.equal(alone, batch[i : i + 1]), (i, seed)


def test_every_token_to_one_expert_and_the_others_idle(request) -> None:
    gen, _ = make_generator(request)
    x, w_gate_up, w_down, _, _ = make_case(gen, 19, 1, 64, 48, torch.bfloat16, torch.bfloat16)
    ids = torch.full((19, 1), 4, dtype=torch.int64, device=DEVICE)  # 19 pairs: two blocks
    weights = torch.ones(19, 1, dtype=torch.float32, device=DEVICE)
    got = fused_moe(x, w_gate_up, w_down, ids, weights)
    check_close(got, fused_moe_reference(x, w_gate_up, w_down, ids, weights))


def test_every_expert_for_every_token(request) -> None:
    gen, _ = make_generator(request)
    args = make_case(gen, 3, EXPERTS, 64, 48, torch.float32, torch.float32)
    check_close(fused_moe(*args), fused_moe_reference(*args))


def test_an_empty_batch(request) -> None:
    gen, _ = make_generator(request)
    x, w_gate_up, w_down, ids, weights = make_case(gen, 0, 2, 64, 48, torch.float32, torch.float32)
    assert fused_moe(x, w_gate_up, w_down, ids, weights).shape == (0, 64)


@pytest.mark.parametrize("block_m", [16, 32])
def test_the_pairs_are_aligned_by_expert(request, block_m) -> None:
    """Each (token, rank) pair once, in its expert's blocks, ascending within an expert; the
    padding is the sentinel T·k; blocks past the last run name expert E."""
    gen, _ = make_generator(request)
    ids = torch.randint(0, EXPERTS, (37, 3), generator=gen)
    ids[:, 1] = 2  # one expert with more than a block of pairs
    align = align_by_expert(ids.to(DEVICE), EXPERTS, block_m)
    pairs, blocks = align.pairs.cpu().long(), align.block_expert.cpu().long()
    n = ids.numel()
    assert len(pairs) == len(blocks) * block_m
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    for b, e in enumerate(blocks.tolist()):
        chunk = pairs[b * block_m : (b + 1) * block_m]
        chunk = chunk[chunk < n]
        if e == EXPERTS:
            assert len(chunk) == 0
            continue
        assert len(chunk) and (ids.reshape(-1)[chunk] == e).all()
    assert blocks.diff().ge(0).all()
    for e in range(EXPERTS):
        mine = pairs[(blocks.repeat_interleave(block_m) == e) & (pairs < n)]
        assert mine.tolist() == (ids.reshape(-1) == e).nonzero()[:, 0].tolist()


def test_what_is_refused_is_named(request) -> None:
    gen, _ = make_generator(request)
    x, w_gate_up, w_down, ids, weights = make_case(gen, 4, 2, 64, 48, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="w_gate_up must be"):
        fused_moe(x, w_gate_up[:, :, :32], w_down, ids, weights)
    with pytest.raises(ValueError, match="w_down has shape"):
        fused_moe(x, w_gate_up, w_down[:, :, :16], ids, weights)
    with pytest.raises(ValueError, match="w_down has dtype"):
        fused_moe(x, w_gate_up, w_down.double(), ids, weights)
    with pytest.raises(ValueError, match="topk_ids must be an int"):
        fused_moe(x, w_gate_up, w_down, ids.float(), weights)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        fused_moe(x, w_gate_up, w_down, ids, weights[:, :1])
    with pytest.raises(ValueError, match="topk_weights has dtype"):
        fused_moe(x, w_gate_up, w_down, ids, weights.bfloat16())
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        fused_moe(x, w_gate_up, w_down, ids, weights, MoeTiling(block_m=24))
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="expert ids outside"):
            fused_moe(x, w_gate_up, w_down, ids + EXPERTS, weights)


@pytest.mark.parametrize("names", ["per_expert", "mixtral", "stacked"])
def test_the_block_on_fused_experts_is_the_block_on_its_linears(request, names) -> None:
    gen, _ = make_generator(request)
    spec = MoeSpec(hidden_size=64, num_experts=EXPERTS, top_k=3, intermediate_size=48)
    x, w_gate_up, w_down, _, _ = make_case(gen, 9, 1, 64, 48, torch.float32, torch.float32)
    w_gate_up, w_down = w_gate_up.cpu(), w_down.cpu()
    tensors = {"gate.weight": torch.randn(EXPERTS, 64, generator=gen)}
    if names == "stacked":
        tensors |= {"experts.gate_up_proj": w_gate_up, "experts.down_proj": w_down}
    else:
        projections = (
            ["gate_proj", "up_proj", "down_proj"] if names == "per_expert" else ["w1", "w3", "w2"]
        )
        for e in range(EXPERTS):
            for projection, w in zip(projections, [*w_gate_up[e].split(48), w_down[e]]):
                tensors[f"experts.{e}.{projection}.weight"] = w
    linears, fused = SparseMoeBlock(spec), SparseMoeBlock(spec)
    fused.experts = FusedExperts(spec)
    for block in (linears, fused):
        for name, tensor in tensors.items():
            block.load(name, tensor)
    prepare_weights(linears)
    want = linears(x.cpu())
    check_close(fused.to(DEVICE)(x).cpu(), want)


def test_fused_experts_refuse_quantized_weights() -> None:
    experts = FusedExperts(MoeSpec(hidden_size=64, num_experts=2, top_k=1, intermediate_size=32))
    with pytest.raises(ValueError, match="quantized"):
        experts.load("0.gate_proj.weight", quantize(torch.randn(32, 64), "Q8_0"))
