"""Structured outputs: a batch of JSON-schema requests against the same batch unconstrained.

The default model (bf16 on the CPU) answers ``--batch`` chat prompts (different people to
describe) under one JSON schema; then the same prompts run unconstrained, each with
``max_new_tokens`` set to the length its constrained output had and ``ignore_eos``, so both
batches generate the same number of tokens per request. The two batches take turns,
``--repeats`` times each (the cache flushed before each run, the best of each kept). Reported:

- output tokens/s both ways, and their ratio (the target: constrained >= 90 % of
  unconstrained);
- the per-step mask time: the scheduler's time filling and applying the token bitmasks
  (``grammar_mask_s``) per decode step and per masked row;
- grammar compile time: the first compilation of the schema (a fresh compiler, vocabulary
  read included, and a second schema on the warm compiler), and a cached one (``submit`` of
  a compiled schema: the future is already done); and the admission cost of a cached-grammar
  request against an unconstrained one (``Engine.add_request``, mean of 200).

Every constrained output is checked with jsonschema. Writes results/structured.json.

    python bench/structured.py [--batch 32 --max-new-tokens 96 --repeats 4 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jsonschema
import torch

from radixrt import Engine, SamplingParams
from radixrt.grammar import GrammarCompiler

RESULTS = Path(__file__).parent / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "Lima", "Cairo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
}
OTHER_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["title", "year"],
}
PEOPLE = [
    "a retired sailor",
    "a young chess player",
    "a baker who loves music",
    "a nurse on night shifts",
    "a painter from the coast",
    "a student of physics",
    "a farmer with three dogs",
    "a taxi driver",
]


def prompts(eng: Engine, n: int) -> list[str]:
    out = []
    for i in range(n):
        who = f"{PEOPLE[i % len(PEOPLE)]} (person {i})"
        msgs = [
            {"role": "system", "content": "You reply with one JSON object."},
            {"role": "user", "content": f"Describe {who}: name, age, city and hobbies."},
        ]
        out.append(
            eng.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        )
    return out


def run(eng: Engine, texts: list[str], params: list[SamplingParams]):
    """(seconds, outputs, scheduler stats) of one generate on an empty cache."""
    eng.flush_cache()
    eng.scheduler.stats.clear()
    t0 = time.perf_counter()
    outs = eng.generate(texts, params)
    return time.perf_counter() - t0, outs, dict(eng.scheduler.stats)


def compile_times(eng: Engine) -> dict:
    fresh = GrammarCompiler(eng.tokenizer, eng.model_config.vocab_size, [2])
    first = SamplingParams(json_schema=SCHEMA).constraint
    t0 = time.perf_counter()
    fresh.submit(first).result()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh.submit(SamplingParams(json_schema=OTHER_SCHEMA).constraint).result()
    t_second = time.perf_counter() - t0
    t0 = time.perf_counter()
    fut = fresh.submit(first)
    t_cached = time.perf_counter() - t0
    assert fut.done()
    fresh.close()
    return {"first_s": t_first, "second_schema_s": t_second, "cached_submit_s": t_cached}


def admission_cost(eng: Engine, n: int = 200) -> dict:
    """Mean seconds per request of Engine.add_request and the scheduler's move of requests with a
    ready grammar into its queue (their matchers made), unconstrained and with a cached grammar
    (the requests are aborted right after)."""
    ids = eng.tokenizer.encode("Describe a person.")
    out = {}
    for name, sp in (
        ("plain", SamplingParams(max_new_tokens=4)),
        ("cached_grammar", SamplingParams(max_new_tokens=4, json_schema=SCHEMA)),
    ):
        t0 = time.perf_counter()
        reqs = [eng.add_request(ids, sp) for _ in range(n)]
        eng.scheduler._take_compiled()  # a cached grammar's matchers are made here
        out[f"{name}_s"] = (time.perf_counter() - t0) / n
        for r in reqs:
            eng.scheduler.abort(r.rid)
    eng.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine(max_running_requests=args.batch)
    texts = prompts(eng, args.batch)
    compiles = compile_times(eng)
    constrained = [
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, json_schema=SCHEMA)
        for _ in texts
    ]
    eng.generate(texts[:2], constrained[:2])  # warm-up (and the engine's grammar compiled)
    _, outs_c, _ = run(eng, texts, constrained)
    valid = 0
    for o in outs_c:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
            valid += 1
    lengths = [len(o.token_ids) for o in outs_c]
    plain = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    best = {"constrained": None, "unconstrained": None}
    for r in range(args.repeats):  # the two take turns, so a slow spell hits both alike
        order = ("constrained", "unconstrained") if r % 2 == 0 else ("unconstrained", "constrained")
        for way in order:
            got = run(eng, texts, constrained if way == "constrained" else plain)
            if best[way] is None or got[0] < best[way][0]:
                best[way] = got
    t_c, outs_c, stats_c = best["constrained"]
    t_u, outs_u, stats_u = best["unconstrained"]
    assert [len(o.token_ids) for o in outs_u] == lengths
    assert [len(o.token_ids) for o in outs_c] == lengths
    tokens = sum(lengths)
    steps = stats_c.get("decode_steps", 0) + stats_c.get("prefill_steps", 0)
    result = {
        "args": vars(args),
        "cpu": platform.processor() or platform.machine(),
        "output_tokens": tokens,
        "constrained": {"seconds": t_c, "tokens_per_s": tokens / t_c, "valid_json": valid},
        "unconstrained": {"seconds": t_u, "tokens_per_s": tokens / t_u},
        "ratio": t_u / t_c,
        "mask": {
            "total_s": stats_c.get("grammar_mask_s", 0.0),
            "per_step_s": stats_c.get("grammar_mask_s", 0.0) / max(1, steps),
            "per_row_s": stats_c.get("grammar_mask_s", 0.0)
            / max(1, stats_c.get("grammar_masked_rows", 1)),
            "steps": steps,
        },
        "forward_s": {
            way: {k: st.get(k, 0.0) for k in ("prefill_forward_s", "decode_forward_s")}
            for way, st in (("constrained", stats_c), ("unconstrained", stats_u))
        },
        "compile": compiles,
        "admission": admission_cost(eng),
        "finish_reasons": sorted({o.finish_reason for o in outs_c}),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(result, indent=1))
    print("| batch | way | s | tokens/s |\n|---|---|---|---|")
    print(f"| {args.batch} | json_schema | {t_c:.2f} | {tokens / t_c:.1f} |")
    print(f"| {args.batch} | unconstrained | {t_u:.2f} | {tokens / t_u:.1f} |")
    m, c, a = result["mask"], compiles, result["admission"]
    print(f"\nconstrained / unconstrained throughput: {result['ratio']:.3f}")
    print(
        f"mask: {m['per_step_s'] * 1e3:.2f} ms per step ({m['steps']} steps), "
        f"{m['per_row_s'] * 1e6:.0f} us per row"
    )
    print(
        f"compile: first {c['first_s']:.3f} s (vocabulary read included), another schema "
        f"{c['second_schema_s']:.3f} s, cached submit {c['cached_submit_s'] * 1e6:.1f} us"
    )
    print(
        f"admission: unconstrained {a['plain_s'] * 1e6:.1f} us, cached grammar "
        f"{a['cached_grammar_s'] * 1e6:.1f} us per request"
    )
    print(f"valid JSON: {valid} of {len(outs_c)} (finish reasons {result['finish_reasons']})")
    for way, f in result["forward_s"].items():
        print(
            f"{way}: prefill forwards {f['prefill_forward_s']:.2f} s, decode forwards "
            f"{f['decode_forward_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
