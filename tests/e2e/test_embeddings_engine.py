"""``Engine.encode`` on the tiny llama: the pooled final hidden state against transformers'
``hidden_states[-1]`` in float32, and its bits whatever the batch, the cache and the chunking
(float32, and bfloat16, whose forwards of up to 512 tokens replay the decode chain)."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams

GEN = torch.Generator().manual_seed(3)
PREFIX = torch.randint(3, 2048, (24,), generator=GEN).tolist()
# a shared prefix and tails: prompts of 5 to 90 tokens (over and under the chain's 64)
PROMPTS = [PREFIX[:5]] + [
    PREFIX + torch.randint(3, 2048, (n,), generator=GEN).tolist() for n in (1, 13, 40, 66)
]


def _hf_hidden(path: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_is_transformers_final_hidden_state_pooled(pooling, tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama, embedding_pooling=pooling)
    outs = eng.encode(input_ids=PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        hidden = _hf_hidden(tiny_llama, prompt)
        want = hidden[-1] if pooling == "last" else hidden.mean(0)
        got = torch.tensor(out["embedding"])
        assert got.shape == (eng.model_config.hidden_size,)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
    text = eng.encode("a prompt as text")
    assert isinstance(text, dict) and len(text["embedding"]) == eng.model_config.hidden_size
    assert eng.encode(["a prompt as text"])[0]["embedding"] == text["embedding"]


def _alone(eng) -> list[list[float]]:
    """Each prompt's embedding on an empty cache, by itself."""
    out = []
    for p in PROMPTS:
        eng.flush_cache()
        out.append(eng.encode(input_ids=[p])[0]["embedding"])
    return out


def _engine_settings(dtype: str) -> dict:
    """float32 (layer by layer), or bfloat16 with a linear kernel the decode chain replays."""
    if dtype == "float32":
        return {"dtype": dtype}
    from radixrt.model.weights import cache_dir
    from radixrt_kernels.cpu import chain as cpu_chain
    from radixrt_kernels.cpu import library as cpu_library
    from radixrt_kernels.cpu import linear as cpu_linear

    lib = cpu_library.load(cache_dir())
    kernels = [k for k in cpu_chain.KERNELS if cpu_linear.kernel_available(lib, k)]
    if not kernels:
        pytest.skip("no linear kernel the decode chain replays runs here")
    return {"dtype": dtype, "linear_kernel": kernels[0]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_bits_do_not_depend_on_batch_cache_or_chunks(
    pooling, dtype, tiny_llama, engine_factory
):
    eng = engine_factory(tiny_llama, embedding_pooling=pooling, **_engine_settings(dtype))
    chain_runs = []
    if dtype == "bfloat16":  # count the forwards the chain replays
        chain = eng.runner.decode_chain
        assert chain is not None, eng.runner.decode_chain_info
        body = chain.body
        chain.body = lambda batch: chain_runs.append(1) or body(batch)
    alone = _alone(eng)
    eng.flush_cache()
    batched = eng.encode(input_ids=PROMPTS)  # together, the prefix shared in the batch
    cached = eng.encode(input_ids=PROMPTS[::-1])[::-1]  # every prompt in the tree
    hits = [o["meta_info"]["cached_tokens"] for o in cached]
    assert hits == ([len(p) - 1 for p in PROMPTS] if pooling == "last" else [0] * len(PROMPTS))
    # beside requests that decode (mixed steps)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    running = [eng.add_request(p[:7] + [9, 9], sp) for p in PROMPTS[1:3]]
    eng.step()
    mixed = eng.encode(input_ids=PROMPTS)
    while not all(r.finished for r in running):
        eng.step()
    assert eng.stats()["mixed_steps"] > 0
    for got in (batched, cached, mixed):
        assert [o["embedding"] for o in got] == alone
    assert bool(chain_runs) == (dtype == "bfloat16")


def test_chunked_prefill_gives_the_same_embedding(tiny_llama, engine_factory):
    whole = engine_factory(tiny_llama, embedding_pooling="mean")
    chunked = engine_factory(tiny_llama, embedding_pooling="mean", chunked_prefill_size=16)
    for got, want in zip(chunked.encode(input_ids=PROMPTS), whole.encode(input_ids=PROMPTS)):
        assert got["embedding"] == want["embedding"]
    assert chunked.stats()["prefill_chunks"] > 0
