"""Structured outputs through the Engine: JSON schemas, regexes and EBNF grammars (xgrammar) on
the tiny model, greedy and sampled; constrained and unconstrained rows in one batch;
retraction and chunked prefill under constraints; bad grammars; the wait for compilation."""

from __future__ import annotations

import ast
import json
import re
import threading
import time

import jsonschema
import pytest

from radixrt import SamplingParams, grammar
from radixrt.grammar import GrammarError
from radixrt.testing import tiny_model_path

PROMPTS = ["The weather today", "Name three colours:", "1, 2, 3,", "Once upon a time"]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "active"],
            }
        },
        "required": ["user"],
    },
    "array_bounds": {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 4},
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
            "t": {"type": "number", "minimum": -10, "maximum": 10},
        },
        "required": ["n", "t"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": DIGIT, "b": {"type": "string", "maxLength": 5}, "c": DIGIT},
        "required": ["a"],
    },
    "ref": {
        "$defs": {
            "pt": {"type": "object", "properties": {"x": DIGIT, "y": DIGIT}, "required": ["x", "y"]}
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
    },
}
REGEXES = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "alternation": r"(yes|no|maybe)",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
}
ARITHMETIC = """
root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] | [1-9] [0-9]
"""
MAX_NEW = 400  # room for any whitespace the grammar allows between JSON elements


def variants(**constraint) -> list[SamplingParams]:
    """Greedy, and three sampled (seeded, with filters) params under one constraint."""
    return [
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, **constraint),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=1, **constraint),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=2, **constraint),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.2, top_k=20, seed=3, **constraint),
    ]


@pytest.fixture(scope="module")
def engine():
    from radixrt import Engine

    eng = Engine(model=tiny_model_path("llama"), dtype="float32", max_total_tokens=16384)
    yield eng
    eng.check_memory()
    eng.shutdown()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(engine, name: str) -> None:
    schema = SCHEMAS[name]
    params = variants(json_schema=schema)
    outs = engine.generate(PROMPTS, params)
    for o in outs:
        assert o.finish_reason == "stop", (name, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    assert len({o.text for o in outs}) > 1  # sampling varies within the grammar


def test_a_structural_tag_constrains_what_follows_its_free_text(engine) -> None:
    schema = SCHEMAS["enum"]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {
                    "type": "tag",
                    "begin": "<t>",
                    "content": {"type": "regex", "pattern": "[a-z]{1,8}"},
                    "end": "</t>",
                },
                {"type": "json_schema", "json_schema": schema},
            ],
        },
    }
    outs = engine.generate(PROMPTS, variants(structural_tag=tag))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        m = re.fullmatch(r"<t>[a-z]{1,8}</t>(.*)", o.text, re.S)
        assert m is not None, o.text
        jsonschema.validate(json.loads(m.group(1)), schema)


def test_a_schema_as_json_text_equals_the_dict(engine) -> None:
    schema = SCHEMAS["enum"]
    as_dict = engine.generate(PROMPTS[:2], variants(json_schema=schema)[:2])
    as_text = engine.generate(PROMPTS[:2], variants(json_schema=json.dumps(schema))[:2])
    assert [o.token_ids for o in as_dict] == [o.token_ids for o in as_text]


def test_compact_json_has_no_free_whitespace() -> None:
    from radixrt import Engine

    eng = Engine(
        model=tiny_model_path("llama"),
        dtype="float32",
        max_total_tokens=4096,
        constrained_json_disable_any_whitespace=True,
    )
    schema = SCHEMAS["nested"]
    for o in eng.generate(PROMPTS, variants(json_schema=schema)):
        value = json.loads(o.text)
        jsonschema.validate(value, schema)
        assert o.text == json.dumps(value), o.text  # ", " and ": " only
    eng.check_memory()
    eng.shutdown()


@pytest.mark.parametrize("name", list(REGEXES))
def test_every_output_fully_matches_its_regex(engine, name: str) -> None:
    outs = engine.generate(PROMPTS, variants(regex=REGEXES[name]))
    for o in outs:
        assert o.finish_reason == "stop"
        assert re.fullmatch(REGEXES[name], o.text), (name, o.text)


def test_every_output_parses_under_an_arithmetic_grammar(engine) -> None:
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    for o in engine.generate(PROMPTS, variants(ebnf=ARITHMETIC)):
        assert o.finish_reason == "stop"
        tree = ast.parse(o.text, mode="eval")
        assert all(isinstance(n, allowed) for n in ast.walk(tree)), o.text
        assert isinstance(eval(compile(tree, "<out>", "eval")), int)


def test_running_out_of_tokens_is_length(engine) -> None:
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=3, json_schema=SCHEMAS["ref"]))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3
    assert out[0].text.startswith("{")


def test_a_completed_grammar_stops_even_with_ignore_eos(engine) -> None:
    sp = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True, regex="(yes|no)")
    out = engine.generate(PROMPTS[0], sp)[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_unconstrained_rows_are_untouched_by_constrained_ones(engine) -> None:
    plain = [
        SamplingParams(max_new_tokens=24, temperature=0.0),
        SamplingParams(max_new_tokens=24, temperature=1.0, seed=11),
    ]
    alone = engine.generate(PROMPTS[:2], plain)
    constrained = variants(json_schema=SCHEMAS["nested"])[:2]
    mixed = engine.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
        [plain[0], constrained[0], plain[1], constrained[1]],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone]
    for o in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(o.text), SCHEMAS["nested"])


def test_retraction_and_chunked_prefill_keep_the_matchers_state(engine) -> None:
    from radixrt import Engine

    prompts = [f"{p} and then, in a long story number {i}," * 4 for i, p in enumerate(PROMPTS)]
    params = variants(json_schema=SCHEMAS["ref"]) + variants(regex=REGEXES["email"])
    prompts = prompts + prompts
    want = engine.generate(prompts, params)
    sizes = [o.prompt_tokens + len(o.token_ids) for o in want]
    tight = Engine(
        model=tiny_model_path("llama"),
        dtype="float32",
        max_total_tokens=max(sum(sizes) // 4, max(sizes) + 16),
        chunked_prefill_size=32,
        new_token_ratio=0.05,
    )
    got = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats["retractions"] > 0 and stats["prefill_chunks"] > 0, stats
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    tight.check_memory()
    tight.shutdown()


def test_bad_constraints_are_refused_naming_the_problem() -> None:
    with pytest.raises(GrammarError, match=r"SamplingParams.regex: invalid regex: .*Unclosed"):
        SamplingParams(regex="[a-")
    with pytest.raises(
        GrammarError, match=r"SamplingParams.ebnf: invalid EBNF grammar: .*not defined"
    ):
        SamplingParams(ebnf="root ::= foo")
    with pytest.raises(GrammarError, match=r"json_schema: invalid JSON schema: .*nonsense"):
        SamplingParams(json_schema={"type": "nonsense"})
    with pytest.raises(GrammarError, match=r"json_schema: invalid JSON schema: not JSON"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(
        ValueError, match=r"at most one of json_schema, regex, ebnf, structural_tag"
    ):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match=r"SamplingParams.regex must be"):
        SamplingParams(regex=7)
    with pytest.raises(GrammarError, match=r"structural_tag: invalid structural tag: not JSON"):
        SamplingParams(structural_tag="{oops")
    with pytest.raises(GrammarError, match=r"structural_tag: invalid structural tag: an object"):
        SamplingParams(structural_tag={"format": {"type": "any_text"}})
    with pytest.raises(GrammarError, match=r"structural_tag: invalid structural tag: "):
        SamplingParams(structural_tag={"type": "structural_tag", "format": {"type": "nope"}})
    assert SamplingParams(json_schema={"type": "object"}).json_schema == '{"type": "object"}'


def test_a_grammar_that_fails_to_compile_fails_only_its_request(engine, monkeypatch) -> None:
    compile_real = grammar.GrammarCompiler._compile

    def compile_or_fail(self, c):
        if c.text == "(broken)":
            raise GrammarError("could not compile the regex: test")
        return compile_real(self, c)

    monkeypatch.setattr(grammar.GrammarCompiler, "_compile", compile_or_fail)
    bad = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=5, regex="(broken)"))
    good = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=5, regex="(yes|no)"))
    while not (bad.finished and good.finished):
        engine.step()
    assert bad.finish_reason == "error" and bad.error_code == "invalid_grammar"
    assert "could not compile" in bad.error
    assert good.finish_reason == "stop"
    with pytest.raises(GrammarError, match="could not compile"):
        engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=5, regex="(broken)"))


def test_a_compiling_grammar_does_not_stall_the_batch(engine, monkeypatch) -> None:
    release = threading.Event()
    compile_real = grammar.GrammarCompiler._compile

    def slow_compile(self, c):
        release.wait(30)
        return compile_real(self, c)

    monkeypatch.setattr(grammar.GrammarCompiler, "_compile", slow_compile)
    slow = engine.add_request([9, 8, 7], SamplingParams(max_new_tokens=8, regex=r"slow\d"))
    plain = engine.add_request([9, 8, 7], SamplingParams(max_new_tokens=8, temperature=0))
    while not plain.finished:
        engine.step()
    assert not slow.finished and slow in [r for r, _ in engine.scheduler.compiling.pending]
    release.set()
    deadline = time.monotonic() + 30
    while not slow.finished and time.monotonic() < deadline:
        engine.step()
    assert slow.finish_reason == "stop" and re.fullmatch(r"slow\d", engine.make_output(slow).text)


def test_a_cached_grammar_is_ready_at_admission_and_abort_works_while_compiling(
    engine, monkeypatch
) -> None:
    c = SamplingParams(regex=REGEXES["phone"]).constraint
    first = engine.grammars.submit(c)
    first.result(timeout=30)
    assert engine.grammars.submit(c) is first  # compiled once
    release = threading.Event()
    compile_real = grammar.GrammarCompiler._compile
    monkeypatch.setattr(
        grammar.GrammarCompiler,
        "_compile",
        lambda self, c: release.wait(30) and compile_real(self, c),
    )
    req = engine.add_request([3, 4], SamplingParams(max_new_tokens=8, regex=r"abort\d"))
    assert engine.scheduler.abort(req.rid).finish_reason == "abort"
    assert not engine.scheduler.compiling and engine.scheduler.idle
    release.set()


def test_json_object_takes_any_object_and_nothing_else(engine) -> None:
    compiled = engine.grammars.submit(grammar.Constraint("json_schema", grammar.JSON_OBJECT))
    for text, ok in (('{"a": 1, "b": [true, null]}', True), ("{}", True), ("[1]", False)):
        m = grammar.Matcher(compiled.result(timeout=30)).matcher
        assert (m.accept_string(text) and m.is_completed()) is ok, text


@pytest.mark.parametrize("limit", [{"maxLength": 5}, {"minLength": 1}, {}])
def test_strings_take_no_raw_control_characters(engine, limit: dict) -> None:
    # JSON allows control characters in a string only escaped; xgrammar's class for a
    # length-limited string's characters lets them through unless rewritten.
    schema = {"type": "object", "properties": {"b": {"type": "string", **limit}}, "required": ["b"]}
    compiled = engine.grammars.submit(grammar.Constraint("json_schema", json.dumps(schema)))
    for text, ok in (('{"b": "ab"}', True), ('{"b": "a\x18"}', False), ('{"b": "a\x00"}', False)):
        m = grammar.Matcher(compiled.result(timeout=30)).matcher
        assert (m.accept_string(text) and m.is_completed()) is ok, (limit, text)
