"""Reasoning parsers (``radixrt.server.http.reasoning``): where an output starts, the whole-text
split, the streamed split at every cut (the same texts, only a possible tag held back), the
reasoning in one piece, the structured output after the reasoning (a structural tag xgrammar
accepts), the request's plan and its refusals, and the launch setting. No model, no server."""

from __future__ import annotations

import json

import pytest

from radixrt import grammar
from radixrt.config import REASONING_PARSERS, ServerConfig
from radixrt.sampling import SamplingParams
from radixrt.server.http import reasoning
from radixrt.server.http import schemas as api
from radixrt.server.http.reasoning import PARSERS, Split, StreamSplits, chat_reasoning

# (output, starts in reasoning) -> (reasoning, content)
CASES = [
    (("Let me see.</think>The answer.", True), ("Let me see.", "The answer.")),
    (
        ("<think>\nLet me see.\n</think>\n\nThe answer.", True),
        ("\nLet me see.\n", "\n\nThe answer."),
    ),
    (("  <think>x</think>y", True), ("x", "y")),
    (("\n\nhmm</think>ok", True), ("\n\nhmm", "ok")),
    (("never ends <thi", True), ("never ends <thi", "")),
    (("never ends", True), ("never ends", "")),
    (("", True), ("", "")),
    (("</think>", True), ("", "")),
    (("a</think>b</think>c<think>d", True), ("a", "b</think>c<think>d")),
    (("<think><think>x</think>", True), ("<think>x", "")),
    (("<thin", True), ("<thin", "")),
    (("Plain answer.", False), ("", "Plain answer.")),
    (("<think>why</think>because", False), ("why", "because")),
    ((" \n<think>why", False), ("why", "")),
    (("So <think>x</think>y", False), ("", "So <think>x</think>y")),
    (("a</think>b", False), ("", "a</think>b")),
    (("<thin", False), ("", "<thin")),
    (("   ", False), ("", "   ")),
    (("   ", True), ("   ", "")),
]
OUTPUTS = sorted({text for (text, _), _ in CASES} | {"Réflexion 🤔 …</think>Ça va."})


@pytest.mark.parametrize("name", REASONING_PARSERS)
@pytest.mark.parametrize(("given", "want"), CASES)
def test_the_whole_text_splits_into_reasoning_and_content(name, given, want) -> None:
    text, in_reasoning = given
    assert PARSERS[name].split(text, in_reasoning) == want


def feed_all(parser, pieces: list[str], in_reasoning: bool, stream_reasoning: bool = True):
    splitter = parser.splitter(in_reasoning, stream_reasoning)
    outs = [splitter.feed(p) for p in pieces]
    return outs + [splitter.finish()]


def joined(outs: list[Split]) -> Split:
    return Split("".join(o.reasoning for o in outs), "".join(o.content for o in outs))


@pytest.mark.parametrize("in_reasoning", [True, False])
@pytest.mark.parametrize("text", OUTPUTS)
def test_a_stream_cut_anywhere_gives_the_whole_texts_split(text, in_reasoning) -> None:
    parser = PARSERS["qwen3"]
    want = parser.split(text, in_reasoning)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            outs = feed_all(parser, [text[:i], text[i:j], text[j:]], in_reasoning)
            assert joined(outs) == want, (text, i, j)
    assert joined(feed_all(parser, list(text), in_reasoning)) == want


@pytest.mark.parametrize("in_reasoning", [True, False])
@pytest.mark.parametrize("text", OUTPUTS)
def test_only_a_possible_tag_is_held_back(text, in_reasoning) -> None:
    """After each character, what is held is a partial tag (or whitespace before a leading
    <think>), and everything before it has come out."""
    splitter = PARSERS["deepseek-r1"].splitter(in_reasoning)
    for ch in text:
        splitter.feed(ch)
        held = splitter.held
        if splitter.state == "opening":
            assert reasoning.THINK_START.startswith(held.lstrip()), held
        elif splitter.state == "reasoning":
            assert len(held) < len(reasoning.THINK_END)
            assert reasoning.THINK_END.startswith(held), held
        else:
            assert held == ""


def test_reasoning_streams_as_it_comes_unless_asked_to_wait() -> None:
    parser = PARSERS["deepseek-r1"]
    pieces = ["<think>", "one ", "two ", "three</th", "ink>", "answer"]
    streamed = feed_all(parser, pieces, True)
    assert [o.reasoning for o in streamed] == ["", "one ", "two ", "three", "", "", ""]
    assert [o.content for o in streamed] == ["", "", "", "", "", "answer", ""]
    whole = feed_all(parser, pieces, True, stream_reasoning=False)
    assert [o.reasoning for o in whole] == ["", "", "", "", "one two three", "", ""]
    assert joined(whole) == joined(streamed)
    cut = feed_all(parser, ["never ", "ends"], True, stream_reasoning=False)
    assert [o.reasoning for o in cut] == ["", "", "never ends"]


def test_where_the_output_starts() -> None:
    r1, qwen3 = PARSERS["deepseek-r1"], PARSERS["qwen3"]
    chatml = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    off = {"enable_thinking": False}
    assert r1.opens_in_reasoning(chatml, {}) and r1.opens_in_reasoning(chatml, off)
    assert qwen3.opens_in_reasoning(chatml, {}) and qwen3.opens_in_reasoning(chatml, {"x": 1})
    assert not qwen3.opens_in_reasoning(chatml, off)
    assert qwen3.opens_in_reasoning(chatml, {"enable_thinking": True})
    for parser in (r1, qwen3):
        assert parser.opens_in_reasoning(chatml + "<think>\n", off)
        assert not parser.opens_in_reasoning(chatml + "<think>\n\n</think>\n\n", {})
        assert not parser.opens_in_reasoning(chatml, {}, continued="<think>a</think>The")
        assert parser.opens_in_reasoning(chatml, off, continued="</think>x<think>Hmm")
    assert qwen3.opens_in_reasoning(chatml, {}, continued="The answer")
    assert not qwen3.opens_in_reasoning(chatml, off, continued="The answer")


def body(**fields) -> api.ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return api.decode_body(json.dumps(fields).encode(), api.ChatCompletionRequest)


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


PROMPT = ids_of("<|im_start|>assistant\n")


def test_a_chat_requests_plan() -> None:
    qwen3 = PARSERS["qwen3"]
    assert chat_reasoning(None, body(), PROMPT, decode) is None
    plan = chat_reasoning(qwen3, body(), PROMPT, decode)
    assert plan.in_reasoning and plan.separate and plan.stream_reasoning and plan.budget is None
    off = chat_reasoning(
        qwen3, body(chat_template_kwargs={"enable_thinking": False}), PROMPT, decode
    )
    assert not off.in_reasoning
    asis = chat_reasoning(qwen3, body(separate_reasoning=False), PROMPT, decode)
    assert asis.split("a</think>b") == ("", "a</think>b") and asis.splitter() is None
    assert plan.split("a</think>b") == ("a", "b")
    cont = body(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>x"}],
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert chat_reasoning(qwen3, cont, ids_of("assistant\n<think>x"), decode).in_reasoning


@pytest.mark.parametrize(
    ("parser", "budget", "words"),
    [(None, 8, "needs a server started with --reasoning-parser"), ("qwen3", -1, ">= 0, got -1")],
)
def test_a_thinking_budget_is_refused_naming_the_field(parser, budget, words) -> None:
    with pytest.raises(api.ApiError) as e:
        chat_reasoning(parser and PARSERS[parser], body(thinking_token_budget=budget), [], decode)
    assert e.value.status == 400 and e.value.param == "thinking_token_budget"
    assert words in e.value.message


def test_stream_splits_finish_each_choice_on_its_last_delta() -> None:
    plan = chat_reasoning(PARSERS["deepseek-r1"], body(), PROMPT, decode)
    splits = StreamSplits(plan)
    assert splits.feed(0, "a</th", False) == ("a", "")
    assert splits.feed(1, "b", False) == ("b", "")
    assert splits.feed(0, "ink>c", True) == ("", "c")
    assert splits.feed(1, "</thi", True) == ("</thi", "")
    assert StreamSplits(None).feed(0, "a</think>", True) == ("", "a</think>")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINED = [
    ({"json_schema": SCHEMA}, ['{"a": 7}', '{"a":-3}'], ['{"a": "x"}', "7"]),
    ({"json_schema": grammar.JSON_OBJECT}, ['{"k": [1, true]}'], ["[1]"]),
    ({"regex": "[a-z]{3}"}, ["abc"], ["abcd", "ab1"]),
    ({"ebnf": 'root ::= "yes" | "no"'}, ["yes", "no"], ["maybe"]),
    (
        {
            "structural_tag": {
                "type": "structural_tag",
                "format": {"type": "const_string", "value": "ok"},
            }
        },
        ["ok"],
        ["okay"],
    ),
]


def accepts(sp: SamplingParams, text: str) -> bool:
    """Whether the constraint of ``sp`` takes ``text`` whole, then the end of the output."""
    import xgrammar as xgr

    c = sp.constraint
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["<eos>", "a"], stop_token_ids=[0]))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar._grammar(c)))
    return matcher.accept_string(text) and matcher.accept_token(0) and matcher.is_terminated()


@pytest.mark.parametrize(("constraint", "good", "bad"), CONSTRAINED)
def test_a_structured_output_applies_after_free_reasoning(constraint, good, bad) -> None:
    plan = chat_reasoning(PARSERS["deepseek-r1"], body(), PROMPT, decode)
    sp = plan.constrain(SamplingParams(**constraint))
    assert sp.constraint.kind == "structural_tag"
    thoughts = "Free text: {, <think>, [1-9], anything at all.\n"
    for answer in good:
        assert accepts(sp, thoughts + "</think>" + answer), answer
        assert accepts(sp, "</think>" + answer), answer
        assert not accepts(sp, answer), answer  # taken as reasoning, which never ends
    for answer in bad:
        assert not accepts(sp, thoughts + "</think>" + answer), answer
    assert not accepts(sp, thoughts)  # the output may not end inside the reasoning


def test_a_request_starting_in_content_keeps_its_constraint() -> None:
    plan = chat_reasoning(
        PARSERS["qwen3"],
        body(chat_template_kwargs={"enable_thinking": False}, thinking_token_budget=4),
        PROMPT,
        decode,
    )
    sp = SamplingParams(regex="[a-z]{3}")
    assert plan.constrain(sp) is sp
    free = SamplingParams()
    assert plan.constrain(free) is free


def test_a_thinking_budget_bounds_the_reasoning_then_frees_the_content() -> None:
    plan = chat_reasoning(PARSERS["qwen3"], body(thinking_token_budget=3), PROMPT, decode)
    assert (
        chat_reasoning(PARSERS["qwen3"], body(), PROMPT, decode)
        .constrain(SamplingParams())
        .constraint
        is None
    )  # no budget, no constraint: nothing to enforce
    sp = plan.constrain(SamplingParams(max_new_tokens=9, temperature=0.0))
    assert (sp.max_new_tokens, sp.temperature) == (9, 0.0)
    tag = json.loads(sp.structural_tag)
    head, rest = tag["format"]["elements"]
    assert head == {
        "type": "tag",
        "begin": "",
        "content": {"type": "any_text", "max_tokens": 3},
        "end": "</think>",
    }
    assert rest == {"type": "any_text"}
    assert accepts(sp, "aaa</think>anything <think> at all")


def test_the_launch_setting_is_refused_unless_known() -> None:
    assert ServerConfig().reasoning_parser is None
    for name in REASONING_PARSERS:
        assert ServerConfig(reasoning_parser=name).reasoning_parser == name
        assert reasoning.parser_of(name).name == name
    assert reasoning.parser_of(None) is None
    with pytest.raises(ValueError, match="reasoning_parser 'qwen' is not known") as e:
        ServerConfig(reasoning_parser="qwen")
    assert "deepseek-r1, qwen3" in str(e.value)
