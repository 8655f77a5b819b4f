"""Frontend benchmark: a few-shot program (5 examples + a question) through ``run_batch``.

Runs the same 64 programs on two Engines, radix cache on and off, and reports
throughput, hit rate, and prefill tokens computed vs the unique tokens of the
program's prefix tree (a trie over every prompt the backend was sent).
Prints a table, writes bench/results/frontend.json.

    python bench/frontend.py [--model tiny|default|PATH] [--dtype bfloat16] [--questions 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import radixrt.lang as rl
from radixrt import Engine

RESULTS = Path(__file__).parent / "results"
TOPICS = [
    "photosynthesis",
    "the French revolution",
    "plate tectonics",
    "compound interest",
    "the immune system",
]


def example(i: int) -> tuple[str, str]:
    topic = TOPICS[i]
    context = " ".join(
        f"Fact {k} about {topic}: it has been studied for many years and "
        f"researchers describe aspect number {k} of it in considerable detail."
        for k in range(6)
    )
    return f"{context}\nQuestion: What is the passage about?", topic


@rl.function
def few_shot(s, question):
    s += "Answer each question about the passage in a few words.\n\n"
    for i in range(5):
        passage, answer = example(i)
        s += f"Passage: {passage}\nAnswer: {answer}\n\n"
    s += f"Passage: {question}\nQuestion: What is the passage about?\nAnswer:"
    s += rl.gen("answer", max_tokens=8, stop="\n", ignore_eos=True)


def unique_tokens(prompts: list[list[int]]) -> int:
    """Nodes of the token trie over all prompts."""
    root: dict = {}
    count = 0
    for ids in prompts:
        node = root
        for t in ids:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                count += 1
            node = nxt
    return count


def run(name: str, model, dtype: str, questions: list[str], threads: int, **kwargs) -> dict:
    eng = Engine(model=model, dtype=dtype, **kwargs)
    warm = rl.EngineBackend(eng)
    few_shot.run(question="warm up", backend=warm)
    eng.flush_cache()
    before = dict(eng.stats())
    backend = rl.EngineBackend(eng, request_log_len=None)  # every prompt, for the trie
    t0 = time.perf_counter()
    states = few_shot.run_batch(
        [{"question": q} for q in questions], backend=backend, num_threads=threads
    )
    elapsed = time.perf_counter() - t0
    after = eng.stats()
    errors = [st.error for st in states if st.error is not None]
    if errors:
        raise errors[0]
    delta = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in ("prefill_tokens", "cached_tokens", "prompt_tokens", "output_tokens")
    }
    uniq = unique_tokens(backend.request_log)
    eng.check_memory()
    return {
        "name": name,
        "programs": len(questions),
        "seconds": elapsed,
        "programs_per_s": len(questions) / elapsed,
        "output_tok_per_s": delta["output_tokens"] / elapsed,
        "hit_rate": delta["cached_tokens"] / max(1, delta["prompt_tokens"]),
        "prefill_tokens": delta["prefill_tokens"],
        "unique_prefix_tree_tokens": uniq,
        "prefill_over_unique": delta["prefill_tokens"] / max(1, uniq),
        "answers": [st["answer"] for st in states[:3]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "frontend.json"))
    args = ap.parse_args()
    model = None if args.model == "default" else args.model
    if args.model == "tiny":
        from radixrt.testing import tiny_model_path

        model = tiny_model_path("llama")
    questions = [
        f"Short note number {i} on topic {i % 7}: the item is described briefly."
        for i in range(args.questions)
    ]
    rows = [
        run("cache on", model, args.dtype, questions, args.threads),
        run("cache off", model, args.dtype, questions, args.threads, disable_radix_cache=True),
    ]
    print(
        f"{'':10} {'s':>7} {'prog/s':>8} {'tok/s':>8} {'hit':>6} "
        f"{'prefill':>9} {'unique':>8} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['name']:10} {r['seconds']:7.2f} {r['programs_per_s']:8.2f} "
            f"{r['output_tok_per_s']:8.1f} "
            f"{r['hit_rate']:6.1%} {r['prefill_tokens']:9d} {r['unique_prefix_tree_tokens']:8d} "
            f"{r['prefill_over_unique']:6.2f}"
        )
    speedup = rows[1]["seconds"] / rows[0]["seconds"]
    print(f"speedup (cache on vs off): {speedup:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"model": args.model, "dtype": args.dtype, "rows": rows, "speedup": speedup}, indent=2
        )
    )


if __name__ == "__main__":
    main()
