"""Are two source trees' outputs the same, bit for bit, on every model and kernel path?

For a refactor that must not change what the model computes: each tree runs, in a fresh
process that imports radixrt from that tree only, the tiny generated llama, qwen2 and qwen3
models (and with ``--smollm`` the default model) in bf16 on each linear kernel path
(``avx512_bf16``, ``fma``, ``amx``, PyTorch, and the calibrated choice) and in float32, the
decode chain on wherever the tree runs one. Per case it hashes the greedy tokens, logprobs
and top-3 logprobs of a batch and of a cached single request, and the scores of two
continuations after a cached prefix (small extends). Prints a table (case, equal, each
tree's decode chain) and writes bench/results/ab_outputs.json.

A path this CPU lacks is reported as an error for both trees. "auto" compares the
calibrated choices, which each tree measures itself: on a busy machine they may choose
different paths (the table shows it in the chain column).

    python bench/ab_outputs.py --a /path/to/old/checkout --b . [--smollm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CHILD = r"""
import hashlib, json, sys
from radixrt import Engine, SamplingParams
from radixrt.testing import tiny_model_path
PROMPTS = ["The same long system prompt for everyone. Then question one?",
           "The same long system prompt for everyone. Then another question?",
           "Something else entirely, and a little longer than the others.", "Short."]
cases = [(a, "bfloat16", k) for a in ("llama", "qwen2", "qwen3")
         for k in ("avx512_bf16", "fma", "amx", "auto", "torch")]
cases += [(a, "float32", "auto") for a in ("llama", "qwen2", "qwen3")]
if sys.argv[1] == "1":
    cases += [(None, "bfloat16", "auto"), (None, "bfloat16", "fma"), (None, "float32", "auto")]
out = {}
for arch, dtype, kernel in cases:
    name = f"{arch or 'smollm2'}/{dtype}/{kernel}"
    kw = {} if kernel == "auto" else {"linear_kernel": kernel}
    try:
        path = tiny_model_path(arch) if arch else None
        with Engine(model=path, dtype=dtype, max_total_tokens=2048, **kw) as eng:
            sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True,
                                logprobs=True, top_logprobs=3)
            outs = eng.generate(PROMPTS, sp) + eng.generate(PROMPTS[:1], sp)
            scores = eng.score(outs[0].token_ids,
                               [outs[1].token_ids[:5], outs[2].token_ids[:7]])
            blob = repr(([(o.token_ids, o.logprobs, o.top_logprobs) for o in outs], scores))
            digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
            out[name] = [digest, eng.runner.decode_chain_info]
    except Exception as e:  # a path this CPU lacks: the same error in both trees
        out[name] = ["error", f"{type(e).__name__}: {e}"[:120]]
print(json.dumps(out))
"""


def run_tree(tree: Path, smollm: bool) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(int(smollm))],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="source tree A (e.g. a checkout of the old commit)")
    ap.add_argument("--b", default=".", help="source tree B (default: this one)")
    ap.add_argument("--smollm", action="store_true", help="also the default model")
    args = ap.parse_args()
    trees = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    runs = {name: run_tree(tree, args.smollm) for name, tree in trees.items()}
    a, b = runs["A"], runs["B"]
    print("| case | equal | A's decode chain | B's decode chain |\n|---|---|---|---|")
    for case in a:
        equal = a[case][0] == b[case][0] and a[case][0] != "error"
        print(f"| {case} | {'yes' if equal else 'NO'} | {a[case][1]} | {b[case][1]} |")
    same = sum(a[c][0] == b[c][0] != "error" for c in a)
    print(f"\n{same} of {len(a)} cases equal")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ab_outputs.json").write_text(
        json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": runs}, indent=1)
    )


if __name__ == "__main__":
    main()
