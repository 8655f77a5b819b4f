"""The mixture-of-experts block (radixrt/model/moe.py) against transformers' blocks on the same
seeded float32 weights: qwen3_moe, mixtral, olmoe, and qwen2_moe's shared expert; a token's
bits alone equal its bits in a batch of 1..64 (exact kernels: float32, bf16, Q8_0); routings
that leave experts without tokens or send every token to one; the experts' one C call
(radixrt_kernels.cpu.experts) against their grouped calls, bit for bit, on every packed kernel, and
which weights take which; the settings read from a config.json as transformers reads them; the
checkpoint's names, per expert and stacked."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from safetensors.torch import load_file

from radixrt.model.calibrate import Choice
from radixrt.model.kernel_set import Kernels, choose_kernels
from radixrt.model.layers import prepare_weights
from radixrt.model.moe import MOE_MODEL_TYPES, MoeSpec, SparseMoeBlock, group_by_expert
from radixrt.model.weights import cache_dir
from radixrt.quant.rtn import quantize
from radixrt_kernels.cpu import experts as cpu_experts
from radixrt_kernels.cpu import library
from radixrt_kernels.cpu import linear as cpu_linear

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

CPU = torch.device("cpu")
HIDDEN, EXPERTS, INTER, SHARED = 64, 8, 32, 96
# the block's settings per family, as transformers' config takes them
FAMILY_KWARGS = {
    "qwen3_moe": dict(
        num_experts=EXPERTS, num_experts_per_tok=3, moe_intermediate_size=INTER, norm_topk_prob=True
    ),
    "mixtral": dict(num_local_experts=EXPERTS, num_experts_per_tok=2, intermediate_size=INTER),
    "olmoe": dict(num_experts=EXPERTS, num_experts_per_tok=4, intermediate_size=INTER),
    "qwen2_moe": dict(
        num_experts=EXPERTS,
        num_experts_per_tok=4,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED,
    ),
}
BLOCK_PREFIX = {"mixtral": "model.layers.0.block_sparse_moe."}  # else model.layers.0.mlp.
ROWS = [1, 2, 3, 5, 8, 13, 16, 31, 33, 64]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def lib():
    loaded = library.load(cache_dir())
    if loaded is None:
        pytest.skip(f"no CPU kernels' library: {library.why_unavailable()}")
    return loaded


def exact(dtype: torch.dtype) -> Kernels:
    return choose_kernels(CPU, dtype, lib(), cache_dir=cache_dir(), exact=True)


def hf_config(family: str, **extra):
    settings = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    return AutoConfig.for_model(family, **settings | FAMILY_KWARGS[family] | extra)


def hf_model(family: str, seed: int = 0, **extra):
    """A one-layer transformers model whose block has seeded weights of about unit output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_config(family, **extra)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def saved_block_tensors(model, family: str) -> dict[str, torch.Tensor]:
    """The block's tensors as ``save_pretrained`` writes them, by their names below the block."""
    prefix = BLOCK_PREFIX.get(family, "model.layers.0.mlp.")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tensors = load_file(f"{folder}/model.safetensors")
    return {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}


def our_block(family: str, tensors, kernels: Kernels | None = None, dtype=torch.float32):
    spec = MoeSpec.from_hf(family, hf_config(family).to_dict())
    block = SparseMoeBlock(spec, kernels or Kernels()).to(dtype)
    filled = set()
    for name, tensor in tensors.items():
        filled.update(block.load(name, tensor))
    assert filled == {n for n, _ in block.named_parameters()}
    prepare_weights(block)
    return block


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# ---- against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILY_KWARGS))
def test_the_block_is_transformers_block(family: str) -> None:
    """From the checkpoint save_pretrained writes, on PyTorch's linears: the transformers
    model's block (grouped_mm) and its eager loop, each within 1e-6. Not bit for bit: which
    float32 GEMM kernel PyTorch's grouped and plain matmuls reach depends on the CPU (on some
    they share one and the bits agree; on others transformers' two implementations differ from
    each other by as much)."""
    model = hf_model(family)
    hf_block = model.model.layers[0].mlp
    assert model.config._experts_implementation == "grouped_mm"
    block = our_block(family, saved_block_tensors(model, family))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = block(x)
    with torch.no_grad():
        want = hf_block(x[None])[0]
        model.config._experts_implementation = "eager"
        eager = hf_block(x[None])[0]
    assert relative_error(got, want) < 1e-6
    assert relative_error(got, eager) < 1e-6


@pytest.mark.parametrize("family", list(FAMILY_KWARGS))
def test_the_exact_float32_block_is_near_transformers(family: str) -> None:
    """On the exact float32 kernels (radixrt's own sums): within 1e-5 of transformers."""
    model = hf_model(family)
    block = our_block(family, saved_block_tensors(model, family), exact(torch.float32))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.model.layers[0].mlp(x[None])[0]
    assert relative_error(block(x), want) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_exact_bf16_block_is_near_transformers(family: str) -> None:
    """In bf16 (mixtral's routing weights float32, qwen's rounded to bf16): as near transformers'
    bf16 block as bf16 roundings of the experts' outputs allow."""
    model = hf_model(family).to(torch.bfloat16)
    block = our_block(
        family, saved_block_tensors(model, family), exact(torch.bfloat16), torch.bfloat16
    )
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        want = model.model.layers[0].mlp(x[None])[0]
    assert relative_error(block(x), want) < 2e-2


@pytest.mark.parametrize("family", list(FAMILY_KWARGS))
def test_stacked_weights_load_as_the_per_expert_ones(family: str) -> None:
    """transformers v5's in-memory names (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) fill the same weights as the per-expert checkpoint names."""
    model = hf_model(family)
    stacked = dict(model.model.layers[0].mlp.state_dict())
    assert stacked["experts.gate_up_proj"].shape == (EXPERTS, 2 * INTER, HIDDEN)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(4))
    per_expert = our_block(family, saved_block_tensors(model, family))
    assert torch.equal(our_block(family, stacked)(x), per_expert(x))


# ---- a token's bits whatever the batch --------------------------------------------------------


def block_of(family: str, dtype: torch.dtype, qtype: str | None = None) -> SparseMoeBlock:
    tensors = saved_block_tensors(hf_model(family, seed=5), family)
    if qtype is not None:
        tensors = {n: quantize(t, qtype) if t.dim() == 2 else t for n, t in tensors.items()}
    return our_block(family, tensors, exact(dtype), dtype)


@pytest.mark.parametrize(
    "family,dtype,qtype",
    [
        ("qwen3_moe", torch.float32, None),
        ("qwen2_moe", torch.float32, None),
        ("qwen3_moe", torch.bfloat16, None),
        ("mixtral", torch.bfloat16, None),
        ("qwen2_moe", torch.bfloat16, "Q8_0"),
    ],
    ids=str,
)
def test_a_tokens_bits_do_not_depend_on_its_batch(family, dtype, qtype) -> None:
    block = block_of(family, dtype, qtype)
    x = torch.randn(max(ROWS), HIDDEN, generator=torch.Generator().manual_seed(6)).to(dtype)
    alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
    for rows in ROWS:
        assert torch.equal(bits(block(x[:rows])), bits(alone[:rows])), rows
    shuffled = torch.randperm(len(x), generator=torch.Generator().manual_seed(7))
    assert torch.equal(bits(block(x[shuffled])), bits(alone[shuffled]))


def routed_block(family: str, favourites: list[int], dtype=torch.float32) -> SparseMoeBlock:
    """A block whose router sends every token of positive features to ``favourites`` (in that
    order) and leaves the other experts without tokens."""
    model = hf_model(family, seed=8)
    tensors = saved_block_tensors(model, family)
    router = torch.zeros(EXPERTS, HIDDEN)
    for rank, e in enumerate(favourites):
        router[e] = 1.0 / (rank + 1)
    tensors["gate.weight"] = router
    return our_block(family, tensors, exact(dtype), dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_every_token_to_the_same_experts(family: str) -> None:
    """Every token routed to the same k experts (one call each, the others none): the
    reference's result, and each token's bits alone."""
    k = FAMILY_KWARGS[family]["num_experts_per_tok"]
    favourites = [5, 2, 7][:k]
    block = routed_block(family, favourites)
    x = torch.rand(33, HIDDEN, generator=torch.Generator().manual_seed(9)) + 0.5
    routing = block.route(x)
    assert (routing.experts == torch.tensor(favourites)).all()
    counts = group_by_expert(routing.experts, EXPERTS).counts
    assert [e for e, n in enumerate(counts) if n] == sorted(favourites)
    got = block(x)
    alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(got, alone)
    want = sum(
        block.experts[e](x) * routing.weights[:, r : r + 1] for r, e in enumerate(favourites)
    )
    assert relative_error(got, want) < 1e-6


def test_one_expert_per_token_and_experts_without_tokens() -> None:
    """k = 1 (every token's weight 1 after renormalising): each token is its expert's output,
    for experts that get one token, many, or none in the call."""
    model = hf_model("qwen3_moe", seed=10, num_experts_per_tok=1)
    tensors = saved_block_tensors(model, "qwen3_moe")
    spec = MoeSpec.from_hf("qwen3_moe", hf_config("qwen3_moe", num_experts_per_tok=1).to_dict())
    block = SparseMoeBlock(spec, exact(torch.float32))
    for name, tensor in tensors.items():
        block.load(name, tensor)
    prepare_weights(block)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(11))
    routing = block.route(x)
    assert torch.equal(routing.weights, torch.ones(12, 1))
    assert len(routing.experts.unique()) < EXPERTS  # some experts idle
    want = torch.stack(
        [block.experts[int(e)](x[i : i + 1])[0] for i, e in enumerate(routing.experts[:, 0])]
    )
    assert torch.equal(block(x), want)
    with torch.no_grad():
        assert torch.allclose(model.model.layers[0].mlp(x[None])[0], want, rtol=1e-5, atol=1e-6)


def test_ties_are_broken_as_torch_topk() -> None:
    """Experts with the same router row tie on every token: the choice is torch.topk's, as in
    transformers' router."""
    model = hf_model("olmoe", seed=12)
    tensors = saved_block_tensors(model, "olmoe")
    router = tensors["gate.weight"].clone()
    router[[1, 3, 6]] = router[4].clone()
    tensors["gate.weight"] = router
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.copy_(router)
    block = our_block("olmoe", tensors)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        _, weights, experts = model.model.layers[0].mlp.gate(x)
    routing = block.route(x)
    assert torch.equal(routing.experts, experts) and torch.equal(routing.weights, weights)
    tied = torch.isin(experts, torch.tensor([1, 3, 4, 6])).sum(-1)
    assert ((tied > 0) & (tied < 4)).any()  # some tokens choose some of the tied experts only


def test_an_empty_batch() -> None:
    block = our_block("qwen2_moe", saved_block_tensors(hf_model("qwen2_moe"), "qwen2_moe"))
    assert block(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


# ---- the experts' one C call ------------------------------------------------------------------


def packed_kernels(kernel: str) -> Kernels:
    """Exact bf16 kernels that run every linear on ``kernel`` (skipped where it does not run)."""
    if not cpu_linear.kernel_available(lib(), kernel):
        pytest.skip(f"the {kernel} linear kernel does not run here")
    return choose_kernels(
        CPU, torch.bfloat16, lib(), cache_dir=cache_dir(), exact=True, linear=kernel
    )


def grouped(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output with its experts called one by one (the reference)."""
    settled, block.experts.path = block.experts.path, block.experts.grouped
    try:
        return block(x)
    finally:
        block.experts.path = settled


def one_call(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    assert isinstance(block.experts.path, cpu_experts.Experts)
    return out


@pytest.mark.parametrize("kernel", list(cpu_linear.KERNELS))
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_one_call_is_the_grouped_calls(family: str, kernel: str) -> None:
    """bf16 on each packed kernel (qwen3's routing weights bf16, mixtral's float32, qwen2's
    shared expert beside): the one C call's bits are the grouped calls' for 1..64 tokens and
    for a prefill's 200, alone and in a batch."""
    tensors = saved_block_tensors(hf_model(family, seed=5), family)
    block = our_block(family, tensors, packed_kernels(kernel), torch.bfloat16)
    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(14)).bfloat16()
    for rows in [*ROWS, 200]:
        assert torch.equal(bits(one_call(block, x[:rows])), bits(grouped(block, x[:rows]))), rows
    alone = torch.cat([one_call(block, x[i : i + 1]) for i in range(16)])
    assert torch.equal(bits(alone), bits(one_call(block, x[:16])))


def test_one_call_takes_each_experts_kernel_by_its_rows() -> None:
    """Outside exact mode a packed weight may run one kernel up to 64 rows and another above:
    each expert's calls take the one for its own rows, as the grouped calls do (every token to
    the same experts: 100 rows each; a few tokens: a few rows each)."""
    if not all(cpu_linear.kernel_available(lib(), k) for k in ("fma", "amx")):
        pytest.skip("needs the fma and amx linear kernels")
    kernels = Kernels(lambda n, k, large=True: Choice("fma", "amx"), lib())
    tensors = saved_block_tensors(hf_model("qwen3_moe", seed=8), "qwen3_moe")
    tensors["gate.weight"] = torch.zeros(EXPERTS, HIDDEN)
    tensors["gate.weight"][[5, 2, 7]] = torch.tensor([1.0, 0.5, 0.25])[:, None]
    block = our_block("qwen3_moe", tensors, kernels, torch.bfloat16)
    x = torch.rand(100, HIDDEN, generator=torch.Generator().manual_seed(15)).bfloat16() + 0.5
    assert (block.route(x).experts == torch.tensor([5, 2, 7])).all()
    for rows in (3, 64, 65, 100):
        assert torch.equal(bits(one_call(block, x[:rows])), bits(grouped(block, x[:rows]))), rows


@pytest.mark.parametrize("favourites", [[5, 2, 7], [0, 1, 2], [7, 6, 5]])
def test_one_call_with_experts_without_tokens(favourites: list[int]) -> None:
    """Every token to the same three experts (the others idle, first, last or between): the
    grouped calls' bits, each token's alone."""
    block = routed_block("qwen3_moe", favourites, torch.bfloat16)
    x = torch.rand(33, HIDDEN, generator=torch.Generator().manual_seed(16)).bfloat16() + 0.5
    assert (block.route(x).experts == torch.tensor(favourites)).all()
    got = one_call(block, x)
    assert torch.equal(bits(got), bits(grouped(block, x)))
    alone = torch.cat([one_call(block, x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(bits(got), bits(alone))


def test_one_call_with_one_expert_per_token() -> None:
    """k = 1: each expert with one token, several, or none."""
    tensors = saved_block_tensors(
        hf_model("qwen3_moe", seed=10, num_experts_per_tok=1), "qwen3_moe"
    )
    spec = MoeSpec.from_hf("qwen3_moe", hf_config("qwen3_moe", num_experts_per_tok=1).to_dict())
    block = SparseMoeBlock(spec, exact(torch.bfloat16)).to(torch.bfloat16)
    for name, tensor in tensors.items():
        block.load(name, tensor)
    prepare_weights(block)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(11)).bfloat16()
    assert len(block.route(x).experts.unique()) < EXPERTS
    assert torch.equal(bits(one_call(block, x)), bits(grouped(block, x)))


@pytest.mark.parametrize(
    "dtype,qtype", [(torch.float32, None), (torch.bfloat16, "Q8_0")], ids=["float32", "Q8_0"]
)
def test_weights_the_one_call_does_not_take_run_grouped(dtype, qtype) -> None:
    """float32 and quantized experts run their grouped calls; so does a block whose weights
    are not laid out yet (its path is settled once they are)."""
    block = block_of("qwen3_moe", dtype, qtype)
    block(torch.randn(3, HIDDEN).to(dtype))
    assert block.experts.path == block.experts.grouped
    spec = MoeSpec.from_hf("qwen3_moe", hf_config("qwen3_moe").to_dict())
    unprepared = SparseMoeBlock(spec, Kernels()).to(torch.bfloat16)
    unprepared(torch.randn(2, HIDDEN).bfloat16())
    assert unprepared.experts.path is None


def test_the_one_call_refuses_what_it_does_not_take() -> None:
    block = our_block(
        "qwen3_moe",
        saved_block_tensors(hf_model("qwen3_moe"), "qwen3_moe"),
        exact(torch.bfloat16),
        torch.bfloat16,
    )
    x = torch.randn(4, HIDDEN).bfloat16()
    block(x)
    experts = block.experts.path
    routing = block.route(x)
    with pytest.raises(ValueError, match="out of range"):
        experts(x, torch.full((4, 3), EXPERTS), routing.weights)
    with pytest.raises(ValueError, match="bf16 x"):
        experts(x.float(), routing.experts, routing.weights)
    with pytest.raises(ValueError, match="multiples of 32"):
        w = torch.zeros(cpu_linear.packed_elems(96, 48), dtype=torch.bfloat16)
        cpu_experts.Experts(lib(), [w], [w], 48, ("amx", "amx"), ("amx", "amx"), 64)


# ---- the settings of a config.json ------------------------------------------------------------


@pytest.mark.parametrize("family", MOE_MODEL_TYPES)
def test_absent_keys_take_transformers_defaults(family: str) -> None:
    full = AutoConfig.for_model(family).to_dict()
    assert MoeSpec.from_hf(family, {"hidden_size": full["hidden_size"]}) == MoeSpec.from_hf(
        family, full
    )


def test_spec_fields() -> None:
    qwen3 = MoeSpec.from_hf("qwen3_moe", hf_config("qwen3_moe").to_dict())
    assert (qwen3.num_experts, qwen3.top_k, qwen3.intermediate_size) == (EXPERTS, 3, INTER)
    assert qwen3.norm_topk_prob and not qwen3.float32_weights and not qwen3.shared_intermediate_size
    mixtral = MoeSpec.from_hf("mixtral", {"hidden_size": 8, "norm_topk_prob": False})
    assert mixtral.norm_topk_prob and mixtral.float32_weights  # mixtral always renormalises
    assert MoeSpec.from_hf("olmoe", {"hidden_size": 8, "num_local_experts": 16}).num_experts == 16
    assert (
        MoeSpec.from_hf("qwen2_moe", hf_config("qwen2_moe").to_dict()).shared_intermediate_size
        == SHARED
    )
    assert MoeSpec.from_hf("qwen3_moe", {"hidden_size": 8, "num_experts": 0}) is None


def test_sparse_layers_are_transformers_ones() -> None:
    """qwen3_moe's mlp_only_layers and decoder_sparse_step pick the same layers."""
    config = hf_config("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[3], decoder_sparse_step=2)
    config.intermediate_size = 48
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    spec = MoeSpec.from_hf("qwen3_moe", config.to_dict())
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert (
        [spec.is_sparse(i) for i in range(6)] == sparse == [False, True, False, False, False, True]
    )


def test_what_is_refused_is_named() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        MoeSpec.from_hf("olmoe", {"hidden_size": 8, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="model_type 'llama'"):
        MoeSpec.from_hf("llama", {"hidden_size": 8})
    with pytest.raises(ValueError, match="num_experts_per_tok 9 > num_experts 8"):
        MoeSpec(hidden_size=8, num_experts=8, top_k=9, intermediate_size=4)
    block = SparseMoeBlock(MoeSpec(hidden_size=8, num_experts=2, top_k=1, intermediate_size=4))
    with pytest.raises(KeyError, match="no expert '2'"):
        block.load("experts.2.gate_proj.weight", torch.zeros(4, 8))
    with pytest.raises(KeyError, match="no projection 'w4'"):
        block.load("experts.0.w4.weight", torch.zeros(4, 8))
    with pytest.raises(KeyError, match="shared_expert_gate"):
        block.load("shared_expert_gate.weight", torch.zeros(1, 8))
    with pytest.raises(KeyError, match="shared_expert.gate_proj"):
        block.load("shared_expert.gate_proj.weight", torch.zeros(4, 8))
    with pytest.raises(ValueError, match="checkpoint shape"):
        block.load("experts.1.down_proj.weight", torch.zeros(8, 5))
    with pytest.raises(ValueError, match="stacked expert weight"):
        block.load("experts.down_proj", torch.zeros(3, 8, 4))
