"""A/B of two source trees on the offline shared-prefix workload, interleaved, fresh processes.

Each round runs the workload once per tree, alternating which goes first; every run is a
fresh Python process that imports radixrt from that tree only, builds the Engine (default
model, bf16), runs the workload once untimed (warm-up), flushes the cache, then times
``--repeats`` runs and keeps the best. Each run also hashes the greedy token ids, so the
table says whether the two trees generate the same outputs. Writes
bench/results/ab_trees.json.

    python bench/ab_trees.py --a /path/to/old/checkout --b . [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_shared_prefix import make_workload  # noqa: E402

RESULTS = Path(__file__).parent / "results"

CHILD = r"""
import hashlib, json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from radixrt import Engine, SamplingParams
work = json.load(open(sys.argv[1]))
eng = Engine(model=None, dtype=work["dtype"])
sp = SamplingParams(max_new_tokens=work["output"], temperature=0, ignore_eos=True)
eng.generate(input_ids=work["prompts"], sampling_params=sp)
times, digest = [], None
for _ in range(work["repeats"]):
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=work["prompts"], sampling_params=sp)
    times.append(time.perf_counter() - t0)
    ids = json.dumps([list(o.token_ids) for o in outs]).encode()
    digest = hashlib.sha256(ids).hexdigest()[:16]
print(json.dumps({"best_s": min(times), "times_s": times, "sha256": digest}))
"""


def run_tree(tree: Path, work_file: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(work_file), str(threads)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="source tree A (e.g. a checkout of the old commit)")
    ap.add_argument("--b", default=".", help="source tree B (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    trees = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    prompts = make_workload(49152, 4, 8, 512, 32, 0)
    RESULTS.mkdir(exist_ok=True)
    work_file = RESULTS / "ab_trees_workload.json"
    work_file.write_text(
        json.dumps({"prompts": prompts, "output": 32, "dtype": args.dtype, "repeats": args.repeats})
    )
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in "AB" if r % 2 == 0 else "BA":
            runs[name].append(run_tree(trees[name], work_file, args.threads))
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    work_file.unlink()
    print("\n| tree | path | best s per round | median | sha256 |\n|---|---|---|---|---|")
    for name in "AB":
        bests = [x["best_s"] for x in runs[name]]
        hashes = sorted({x["sha256"] for x in runs[name]})
        print(
            f"| {name} | {trees[name]} | {' / '.join(f'{b:.3f}' for b in bests)} | "
            f"{statistics.median(bests):.3f} | {', '.join(hashes)} |"
        )
    same = {x["sha256"] for x in runs["A"]} == {x["sha256"] for x in runs["B"]}
    print(f"\ngreedy outputs identical: {same}")
    (RESULTS / "ab_trees.json").write_text(
        json.dumps(
            {"trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "identical": same},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
