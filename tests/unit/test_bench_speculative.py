"""bench/speculative.py without servers: its workloads, the speculative counters of both
servers' responses, the acceptance figures, the outputs compared and the issue's checks."""

from __future__ import annotations

import argparse
import json

import pytest


@pytest.fixture(scope="module")
def sb(bench_module):
    return bench_module("speculative")


# ------------------------------------------------------------ workloads


def test_workloads_are_seeded_and_distinct(sb):
    for name in sb.WORKLOADS:
        a, b = sb.make_workload(name, 8, 64, 0), sb.make_workload(name, 8, 64, 0)
        assert a == b
        assert a != sb.make_workload(name, 8, 64, 1)
        texts = [json.dumps(p.messages) for p in a.prompts]
        assert len(texts) == 8 and len(set(texts)) == 8, name
        assert all(p.max_tokens == 64 for p in a.prompts)
        assert all(p.messages[0] == {"role": "system", "content": sb.SYSTEM} for p in a.prompts)
        assert all(p.messages[-1]["role"] == "user" for p in a.prompts)
    assert sb.make_workload("repeat_user", 8, 64, 0).first_pass
    with pytest.raises(ValueError, match="unknown workload"):
        sb.make_workload("nope", 1, 8, 0)


def test_code_edit_renames_a_function_of_the_file(sb):
    import random

    rng = random.Random(3)
    for _ in range(20):
        text, old, new = sb.code_file(rng)
        assert old != new
        assert f"def {old}(" in text and f"print({old}(" in text
        assert new not in text
        assert 50 <= len(text.splitlines()) <= 80
        compile(text, "file.py", "exec")  # real Python


def test_extract_letters_hold_every_field(sb):
    wl = sb.make_workload("extract", 4, 64, 0)
    for p in wl.prompts:
        ask = p.messages[-1]["content"]
        assert all(f'"{f}"' in ask for f in sb.EXTRACT_FIELDS)
        assert "@example.com" in ask and "Kind regards" in ask


def test_multi_turn_asks_for_an_earlier_answer(sb):
    wl = sb.make_workload("multi_turn", 8, 64, 0)
    for p in wl.prompts:
        roles = [m["role"] for m in p.messages]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
        answers = {a for _, _, a in sb.ANSWERS}
        assert p.messages[2]["content"] in answers and p.messages[4]["content"] in answers
        assert p.messages[2]["content"] != p.messages[4]["content"]


def test_scaled_tokens(sb):
    assert sb.scaled_tokens(256, 1.0) == 256
    assert sb.scaled_tokens(256, 0.25) == 64
    assert sb.scaled_tokens(256, 0.001) == 8


# ------------------------------------------------------------ counters


def test_spec_counters_of_radixrt_and_llama_server(sb):
    assert sb.spec_counters({"choices": [{"delta": {"content": "x"}}]}) == {}
    radixrt = {
        "choices": [],
        "usage": {"spec_accepted_tokens": 30, "spec_draft_tokens": 40, "spec_verify_ct": 10},
    }
    assert sb.spec_counters(radixrt) == {"accepted": 30, "drafted": 40, "verify_ct": 10}
    meta = {"meta_info": {"spec_accepted_tokens": 3, "spec_draft_tokens": 8, "spec_verify_ct": 1}}
    assert sb.spec_counters(meta) == {"accepted": 3, "drafted": 8, "verify_ct": 1}
    llama = {"choices": [], "timings": {"predicted_n": 64, "draft_n": 48, "draft_n_accepted": 40}}
    assert sb.spec_counters(llama) == {"accepted": 40, "drafted": 48}
    assert sb.spec_counters({"timings": {"predicted_n": 64}}) == {}


def rec(sb, out: int, spec: dict | None = None, error: str | None = None):
    r = sb.SpecRecord(output_tokens=out, ttft=0.1, itl=[0.01] * (out - 1), error=error)
    r.spec = dict(spec or {})
    return r


def test_acceptance_figures(sb):
    # 65 tokens: 1 from prefill, 64 after it; 48 of those accepted drafts in 16 steps
    a = sb.acceptance([rec(sb, 65, {"accepted": 48, "drafted": 64, "verify_ct": 16})])
    assert a["tokens_per_step"] == 1 + 48 / 16
    assert a["accept_len"] == (48 + 16) / 16
    assert a["accepted_share"] == 48 / 64
    llama = sb.acceptance([rec(sb, 9, {"accepted": 4, "drafted": 8})])
    assert llama["spec_verify_ct"] is None and llama["accept_len"] is None
    assert llama["tokens_per_step"] == 1 + 4 / 4
    none = sb.acceptance([rec(sb, 65)])
    assert none["tokens_per_step"] is None and none["spec_accepted"] is None


def test_summary_counts_silent_speculation_as_zero(sb):
    samples = [
        sb.Sample(rec(sb, 9), "a"),
        sb.Sample(rec(sb, 9, {"accepted": 4, "drafted": 8}), "b"),
    ]
    s = sb.summarize(samples, 2.0, omits_zero_counters=True)
    assert s["output_tokens"] == 18 and s["output_tok_s"] == 9.0
    assert s["spec_drafted"] == 8 and s["tokens_per_step"] == 1 + 4 / (8 + 4)
    plain = sb.summarize([sb.Sample(rec(sb, 9), "a")], 1.0)
    assert plain["tokens_per_step"] is None
    failed = sb.summarize([sb.Sample(rec(sb, 0, error="boom"), "")], 1.0)
    assert failed["errors"] == 1 and failed["first_error"] == "boom"


# ------------------------------------------------------------ book and checks


class FakeTarget:
    def __init__(self, name: str) -> None:
        self.name, self.omits_zero_counters = name, False


def add(sb, book, target: str, workload: str, batch: int, wall: float, texts: list[str]):
    wl = sb.Workload(workload, [sb.Prompt([], 8)] * len(texts))
    samples = [sb.Sample(rec(sb, 10, error=None if t else "failed"), t) for t in texts]
    book.add(FakeTarget(target), wl, batch, samples, wall)


def test_differing_leaves_failed_requests_out(sb):
    book = sb.Book()
    add(sb, book, "radixrt", "code_edit", 1, 1.0, ["a", "b", "c"])
    add(sb, book, "radixrt-ngram", "code_edit", 1, 1.0, ["a", "x", ""])
    assert book.differing("radixrt-ngram", "radixrt") == {"code_edit@1": [1]}
    (d,) = book.differences("radixrt-ngram", "radixrt")
    assert (d["spec"], d["plain"]) == ("x", "b")


def test_checks_pass_and_fail(sb):
    book = sb.Book()
    for w in sb.WORKLOADS:
        for b in (1, 8):
            add(sb, book, "radixrt", w, b, 4.0, ["a"] * 8)
            add(sb, book, "llama", w, b, 8.0, ["a"] * 8)
            add(sb, book, "llama-ngram-simple", w, b, 4.0, ["a"] * 8)
            add(sb, book, "llama-ngram-mod", w, b, 6.0, ["a"] * 8)
            spec_wall = 4.2 if w == "random" else (1.9 if b == 1 else 3.0)
            add(sb, book, "radixrt-ngram", w, b, spec_wall, ["a"] * 8)
    checks = {c.name: c for c in sb.checks(book, [1, 8])}
    assert checks["repetitive set, batch 1: NGRAM / plain tok/s (geomean)"].passed  # 4 / 1.9
    assert checks["repetitive set, batch 8: NGRAM / plain tok/s (geomean)"].passed  # 4 / 3.0
    assert not checks["random, batch 1: NGRAM / plain tok/s"].passed  # 4 / 4.2 < 0.97
    assert sb.best_llama_spec(book.best(), [1, 8]) == "llama-ngram-simple"
    ahead = "repetitive set, batch 8: radixrt NGRAM / llama-ngram-simple tok/s (geomean)"
    assert checks[ahead].passed and checks[ahead].value == pytest.approx(4.0 / 3.0)
    assert checks["radixrt requests differing with NGRAM"].passed
    assert "| code_edit | 1 | radixrt-ngram |" in sb.table(book)


def test_no_checks_without_both_radixrt_targets(sb):
    book = sb.Book()
    add(sb, book, "radixrt", "code_edit", 1, 1.0, ["a"])
    assert sb.checks(book, [1]) == []


# ------------------------------------------------------------ arguments


def test_arguments(sb, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    args = sb.parse_args(
        ["--gguf", str(f), "--targets", "radixrt,llama-ngram-mod", "--batches", "1,4"]
        + ["--llama-args=--no-repack", "--workloads", "random"]
    )
    assert args.targets == ["radixrt", "llama-ngram-mod"] and args.batches == [1, 4]
    assert args.llama_args == "--no-repack" and args.workloads == ["random"]
    with pytest.raises(SystemExit):
        sb.parse_args(["--gguf", str(f), "--targets", "vllm"])
    with pytest.raises(SystemExit):
        sb.parse_args(["--gguf", str(tmp_path / "missing.gguf")])


def test_llama_spec_target_flags(sb, tmp_path):
    args = argparse.Namespace(
        gguf="m.gguf", llama_args="--no-repack", llama_spec_args="--spec-ngram-mod-n-max 16"
    )
    t = sb.make_target("llama-ngram-mod", args, 8, 4096)
    assert t.omits_zero_counters
    assert t.group.args.llama_args.split() == [
        "--no-repack",
        "--spec-type",
        "ngram-mod",
        "--spec-ngram-mod-n-max",
        "16",
    ]
    assert not sb.make_target("llama", args, 8, 4096).omits_zero_counters


def test_copyable_share_of_an_output(sb):
    assert sb.copyable("a b c d e", "a b c d") == 1.0  # its one 4-gram is in the prompt
    assert sb.copyable("", "a b c d e f") == 0.0
    assert sb.copyable("", "a b c d a b c d") == 0.2  # 5 grams, the last one seen before
    assert sb.copyable("x", "a b") is None
    wl = sb.Workload("w", [sb.Prompt([{"role": "user", "content": "a b c d"}], 8)] * 2)
    samples = [sb.Sample(rec(sb, 4), "a b c d"), sb.Sample(rec(sb, 7), "p q r s t u v")]
    assert sb.copyable_share(wl, samples) == pytest.approx((1.0 * 4 + 0.0 * 7) / 11)
