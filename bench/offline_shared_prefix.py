"""Offline shared-prefix workload: radixrt (lpm, fcfs, no cache) vs transformers generate.

G groups × Q questions; each prompt is a group's S-token system prompt plus an
L-token question; O output tokens are forced with ignore_eos. Token ids are
seeded random ids from the vocabulary. Prints a table, writes JSON and a PNG.
Each row runs in a fresh process of its own (as a user would run either
system: no row inherits another's allocator settings or heap; the old
single-process order is ``--same-process``). Every row gets one untimed warm-up
(radixrt: the whole workload, then a cache flush; transformers: its first
batch), then ``--repeats`` timed runs, best reported (all are in the JSON:
this kind of machine drifts 10-20 % between runs). ``decode_attention`` says whether
decode attention ran in the C kernel (radixrt_kernels/cpu) or, without a
compiler, on PyTorch's kernels. The "+ torch.compile" row
compiles at start-up (``startup_s``), outside the clock. The "floor" row times
the model's weight matmuls alone on the workload's shapes (see
``dense_floor``): the most any runtime could reach here.

    python bench/offline_shared_prefix.py [--groups 4 --questions 8 --system 512 ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import time
from pathlib import Path

import torch

from radixrt import Engine, SamplingParams
from radixrt.model.layers import QKVLinear

RESULTS = Path(__file__).parent / "results"


def make_workload(
    vocab: int, groups: int, questions: int, system: int, question: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = 10, vocab - 10  # keep clear of special tokens at either end
    prompts = []
    for _ in range(groups):
        sys_ids = [rng.randrange(lo, hi) for _ in range(system)]
        prompts += [
            sys_ids + [rng.randrange(lo, hi) for _ in range(question)] for _ in range(questions)
        ]
    rng.shuffle(prompts)
    return prompts


def run_radixrt(
    name: str, prompts: list[list[int]], out: int, dtype: str, repeats: int, **kwargs
) -> dict:
    """One untimed run of the whole workload (warm-up: first-touch of the activation and KV
    memory), then ``repeats`` timed runs on a flushed cache; the fastest is reported."""
    t0 = time.perf_counter()
    eng = Engine(model=None, dtype=dtype, **kwargs)
    startup = time.perf_counter() - t0
    backend = eng.runner.attn_backend
    decode_attention = {"cpu": "C kernel", "torch": "PyTorch SDPA"}.get(backend.name, backend.name)
    sp = SamplingParams(max_new_tokens=out, temperature=0, ignore_eos=True)
    eng.generate(input_ids=prompts, sampling_params=sp)
    runs = []
    for _ in range(repeats):
        eng.flush_cache()
        before = eng.stats()
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        after = eng.stats()
        eng.check_memory()
        runs.append((wall, outs, before, after))
    eng.shutdown()
    wall, outs, before, after = min(runs, key=lambda r: r[0])
    n_out = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = after["cached_tokens"] - before.get("cached_tokens", 0)
    return {
        "row": name,
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "output_tokens": n_out,
        "prefill_tokens": after["prefill_tokens"] - before.get("prefill_tokens", 0),
        "hit_rate": cached / prompt_tokens,
        "retractions": after.get("retractions", 0),
        "runs_s": [r[0] for r in runs],
        "startup_s": startup,
        "decode_attention": decode_attention,
        **{
            k: after.get(k, 0.0) - before.get(k, 0.0)
            for k in ("prefill_forward_s", "decode_forward_s", "decode_steps")
        },
    }


def run_transformers(
    path: str, prompts: list[list[int]], out: int, dtype: str, batch: int, repeats: int
) -> dict:
    """Batched, left-padded greedy ``generate``; an untimed warm-up on the first batch, then
    ``repeats`` timed passes over the workload; the fastest is reported."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = 0

    def generate(chunk: list[list[int]], new: int) -> tuple[int, int]:
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        return (gen.shape[1] - width) * len(chunk), width * len(chunk)

    generate(prompts[:batch], out)  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n_out = prefill = 0
        for i in range(0, len(prompts), batch):
            o, p = generate(prompts[i : i + batch], out)
            n_out, prefill = n_out + o, prefill + p
        runs.append(time.perf_counter() - t0)
    wall = min(runs)
    return {
        "row": f"transformers generate (batch {batch})",
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "output_tokens": n_out,
        "prefill_tokens": prefill,
        "hit_rate": 0.0,
        "retractions": 0,
        "runs_s": runs,
    }


def dense_floor(
    prompts: list[list[int]], unique: int, out: int, dtype: str, chunk: int = 512
) -> dict:
    """A lower bound no runtime on this model can beat: its weight matmuls alone.

    Times only the model's own linear layers (qkv, o, gate_up, down of every
    layer, and the LM head for each sampled row; called as the model calls
    them, so with its packed CPU weights too) on the workload's shapes:
    every unique prompt token once, in ``chunk``-row prefill batches, then
    ``out`` decode steps over all requests at once. No attention, norms,
    rotary, sampling or Python scheduling: any real run takes longer.
    """
    eng = Engine(model=None, dtype=dtype, max_total_tokens=4096)
    model = eng.runner.model
    linears = [
        m
        for layer in model.model.layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    head = model.lm_head
    hidden = head.weight.shape[1]

    widths = sorted({m.in_features for m in linears} | {hidden})
    inputs = {
        k: torch.randn(chunk, k, dtype=head.weight.dtype) for k in widths
    }  # outside the clock

    positions = torch.zeros(chunk, dtype=torch.int64)  # the qkv projection rotates q and k

    def run(rows: int, sampled: int) -> None:
        for m in linears:
            x = inputs[m.in_features][:rows]
            if isinstance(m, QKVLinear):
                m(x, positions[:rows])
            else:
                m(x)
        head(inputs[hidden][:sampled])

    assert len(prompts) <= chunk
    shapes = [(min(chunk, unique - i), 0) for i in range(0, unique, chunk)]
    shapes[-1] = (shapes[-1][0], len(prompts))  # the last prefill chunk samples every request
    shapes += [(len(prompts), len(prompts))] * (out - 1)
    with torch.inference_mode():
        run(64, 64)  # warm up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for rows, sampled in shapes:
                run(rows, sampled)
            best = min(best, time.perf_counter() - t0)
    eng.shutdown()
    n_out = out * len(prompts)
    return {
        "row": "floor: weight matmuls only",
        "wall_s": best,
        "output_tok_s": n_out / best,
        "output_tokens": n_out,
        "prefill_tokens": unique,
        "hit_rate": 0.0,
        "retractions": 0,
    }


def _call_with_threads(threads: int, fn, args: tuple, kwargs: dict) -> dict:
    torch.set_num_threads(threads)
    return fn(*args, **kwargs)


def row(isolated: bool, threads: int, fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)``, in a fresh spawned process when ``isolated``."""
    if not isolated:
        return fn(*args, **kwargs)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_call_with_threads, (threads, fn, args, kwargs))


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r["row"] for r in rows], [r["output_tok_s"] for r in rows], color="#4477aa")
    ax.set_xlabel("output tokens / s")
    ax.set_title("offline shared-prefix workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=2, help="timed runs per row after a warm-up; best reported"
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--skip-compile", action="store_true", help="no torch.compile row (it compiles ~1 min)"
    )
    ap.add_argument(
        "--same-process",
        action="store_true",
        help="run every row in this process, one after another (the old way)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from radixrt.model.default_model import default_model_path
    from radixrt.model.hf_config import ModelConfig

    path = default_model_path()
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts = make_workload(
        vocab, args.groups, args.questions, args.system, args.question, args.seed
    )
    unique = args.groups * args.system + len(prompts) * args.question
    n, iso, th = args.repeats, not args.same_process, args.threads
    rows = [
        row(iso, th, run_radixrt, "radixrt lpm", prompts, args.output, args.dtype, n),
        row(
            iso,
            th,
            run_radixrt,
            "radixrt fcfs",
            prompts,
            args.output,
            args.dtype,
            n,
            schedule_policy="fcfs",
        ),
        row(
            iso,
            th,
            run_radixrt,
            "radixrt no cache",
            prompts,
            args.output,
            args.dtype,
            n,
            disable_radix_cache=True,
        ),
    ]
    if not args.skip_compile:
        rows.append(
            row(
                iso,
                th,
                run_radixrt,
                "radixrt lpm + torch.compile",
                prompts,
                args.output,
                args.dtype,
                n,
                enable_torch_compile=True,
                disable_deterministic_inference=True,
            )
        )
    radixrt_rows = list(rows)
    rows.append(row(iso, th, dense_floor, prompts, unique, args.output, args.dtype))
    floor = rows[-1]
    if not args.skip_transformers:
        rows.append(
            row(
                iso,
                th,
                run_transformers,
                path,
                prompts,
                args.output,
                args.dtype,
                batch=8,
                repeats=n,
            )
        )
    print(
        f"workload: {args.groups} groups x {args.questions} questions, system {args.system}, "
        f"question {args.question}, output {args.output}; unique prefix-tree tokens {unique}"
    )
    print(f"{'row':32} {'wall s':>8} {'out tok/s':>10} {'prefill tok':>12} {'hit rate':>9}")
    for r in rows:
        print(
            f"{r['row']:32} {r['wall_s']:8.2f} {r['output_tok_s']:10.1f} "
            f"{r['prefill_tokens']:12d} {r['hit_rate']:9.3f}"
        )
    for r in radixrt_rows:  # where a radixrt row's wall time went
        steps = max(r["decode_steps"], 1)
        print(
            f"  {r['row']}: prefill forwards {r['prefill_forward_s']:.2f} s, decode forwards "
            f"{r['decode_forward_s']:.2f} s ({r['decode_steps']:.0f} steps, "
            f"{1e3 * r['decode_forward_s'] / steps:.1f} ms each), outside forwards "
            f"{r['wall_s'] - r['prefill_forward_s'] - r['decode_forward_s']:.2f} s; start-up "
            f"{r['startup_s']:.1f} s; decode attention: {r['decode_attention']}"
        )
    base = rows[-1]["output_tok_s"] if not args.skip_transformers else None
    if base:
        ups = ", ".join(
            f"{r['row']} {r['output_tok_s'] / base:.1f}x" for r in radixrt_rows if "lpm" in r["row"]
        )
        print(
            f"speed-up over transformers: {ups}; prefill / unique = "
            f"{rows[0]['prefill_tokens'] / unique:.3f}; the weight-matmul floor allows at most "
            f"{floor['output_tok_s'] / base:.1f}x"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offline_shared_prefix.json").write_text(
        json.dumps({"args": vars(args), "unique_tokens": unique, "rows": rows}, indent=2)
    )
    plot(rows, RESULTS / "offline_shared_prefix.png")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
