"""The engine with attention_backend="triton" generates exactly what "torch" does.

The Triton run is on CPU under the interpreter, in a subprocess: TRITON_INTERPRET
must be set before ``triton.jit`` runs (at import), and an interpreter crash
must fail this test rather than kill pytest. The prompts share a prefix, so
the batch runs extend with and without a cached prefix, then decode (split-KV,
several splits) — every kernel and the backend's index building.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from radixrt import SamplingParams

SYSTEM = "You are a careful assistant. Answer the question about the standard library. "
PROMPTS = [
    SYSTEM + q for q in ("What does zip return?", "Why use pathlib?", "What is a generator?")
]
NEW = 6
ENGINE_ARGS = dict(
    dtype="float32", max_total_tokens=2048, device="cpu", disable_deterministic_inference=True
)
MARK = "TRITON_RESULT "

CHILD = f"""
import json, sys
import torch
torch.set_num_threads(2)
from radixrt import Engine, SamplingParams
from radixrt.attention.triton_backend import TritonAttentionBackend
path, prompts, new, engine_args = json.loads(sys.argv[1])
eng = Engine(model=path, attention_backend="triton", **engine_args)
assert isinstance(eng.runner.attn_backend, TritonAttentionBackend)
outs = eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
eng.check_memory()
print({MARK!r} + json.dumps([[list(o.token_ids), o.cached_tokens] for o in outs]))
"""


def test_triton_backend_matches_torch(tiny_llama, engine_factory):
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = engine_factory(tiny_llama, attention_backend="torch", **ENGINE_ARGS).generate(
        PROMPTS, greedy
    )
    args = json.dumps([tiny_llama, PROMPTS, NEW, ENGINE_ARGS])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, (
        f"triton engine subprocess failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    got = json.loads(lines[-1][len(MARK) :])
    assert [ids for ids, _ in got] == [list(o.token_ids) for o in want]
    assert [cached for _, cached in got] == [o.cached_tokens for o in want]
    assert sum(cached for _, cached in got) > 0, "no request extended a cached prefix"


SPEC_CHILD = f"""
import json, sys
import torch
torch.set_num_threads(2)
from radixrt import Engine, SamplingParams
path, prompts, new = json.loads(sys.argv[1])
args = dict(dtype="float32", max_total_tokens=2048, device="cpu", attention_backend="triton",
            enable_deterministic_inference=True, max_prefill_step_ms=0)
sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True, logprobs=True)
got = []
for extra in ({{}}, {{"speculative_algorithm": "NGRAM"}}):
    eng = Engine(model=path, **args, **extra)
    outs = [eng.generate(p, sp)[0] for p in prompts]  # the second drafts from the first
    eng.check_memory()
    got.append([[list(o.token_ids), o.logprobs, o.spec_verify_ct] for o in outs])
    eng.shutdown()
print({MARK!r} + json.dumps(got))
"""


def test_triton_kernels_verify_speculative_drafts_exactly(tiny_llama):
    """NGRAM verification rows through the Triton kernels (deterministic mode): a second
    request of a prompt drafts from the first's output in the tree, and gets the same tokens
    and logprobs as decoding without speculation. (No time budget: the step cost stays
    unknown, so every draft is admitted.)"""
    args = json.dumps([tiny_llama, [PROMPTS[0], PROMPTS[0]], 12])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SPEC_CHILD, args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, (
        f"triton engine subprocess failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    plain, spec = json.loads(lines[-1][len(MARK) :])
    assert [(ids, lps) for ids, lps, _ in spec] == [(ids, lps) for ids, lps, _ in plain]
    assert sum(ct for _, _, ct in spec) > 0, "nothing was verified"
