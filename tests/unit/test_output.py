"""radixrt.output on scripted requests: delta counters, first-delta fields, stop strings."""

from __future__ import annotations

import pytest

from radixrt.output import Detokenizer, OutputTracker, cut_at_stop, make_output
from radixrt.protocol import BatchTokenOut, TokenDelta
from radixrt.sampling import SamplingParams
from radixrt.scheduler.req import Req, ReqState

# A byte-level vocabulary: token i decodes to PIECES[i]; an incomplete UTF-8 sequence
# decodes to U+FFFD, as with a real byte-level BPE.
PIECES = [b"Hel", b"lo", b" S", b"TO", b"P", b" wor", b"ld", b"\xc3", b"\xa9", b"!", b"ST"]


class ByteTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return ByteTokenizer().decode(ids)


def scripted(
    rid: str = "r",
    stop: list[str] | None = None,
    logprobs: bool = True,
    top_logprobs: int = 2,
    logprob_start_len: int | None = None,
) -> Req:
    sp = SamplingParams(max_new_tokens=32, stop=stop, logprobs=logprobs, top_logprobs=top_logprobs)
    req = Req(rid, [1, 2, 3, 4], sp, logprob_start_len=logprob_start_len)
    req.cached_tokens = 2
    if logprob_start_len is not None:
        req.prompt_logprobs = [-0.5, -0.25]
        req.prompt_top_logprobs = [([7, 8], [-0.1, -0.2]), ([9, 7], [-0.3, -0.4])]
    return req


def sample(req: Req, *tokens: int) -> None:
    """What the scheduler books per sampled token; logprob -(k+1) for output token k."""
    for t in tokens:
        k = len(req.output_ids)
        if k == 0:
            req.first_token_at = 123.0
        req.output_ids.append(t)
        req.output_logprobs.append(-(k + 1.0))
        if req.params.top_logprobs:
            req.output_top_logprobs.append(([t, k], [-(k + 1.0), -(k + 2.0)]))


def finish(req: Req, reason: str) -> None:
    req.state, req.finish_reason = ReqState.FINISHED, reason


def test_streamed_deltas_carry_each_token_once():
    req = scripted(logprob_start_len=2)
    outputs = OutputTracker()
    outputs.add(req)
    assert outputs.collect() == []  # nothing sampled yet
    steps = [(0,), (1, 5), (), (6,)]
    deltas = []
    for tokens in steps:
        sample(req, *tokens)
        got = outputs.collect()
        assert len(got) == (1 if tokens else 0)
        deltas += [d for _, d in got]
    finish(req, "length")
    [(done, last)] = outputs.collect()
    assert done is req and len(outputs) == 0 and outputs.collect() == []
    deltas.append(last)
    assert [d.token_ids for d in deltas] == [[0], [1, 5], [6], []]
    assert [d.logprobs for d in deltas] == [[-1.0], [-2.0, -3.0], [-4.0], []]
    assert [[ids for ids, _ in d.top_logprobs] for d in deltas] == [
        [[0, 0]],
        [[1, 1], [5, 2]],
        [[6, 3]],
        [],
    ]
    assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
    first, rest = deltas[0], deltas[1:]
    assert first.first_token_at == 123.0 and first.prompt_logprobs == [-0.5, -0.25]
    assert first.prompt_top_logprobs == req.prompt_top_logprobs
    assert all(
        d.first_token_at == 0.0 and d.prompt_logprobs is None and d.prompt_top_logprobs is None
        for d in rest
    )
    assert all(d.prompt_tokens == 4 and d.cached_tokens == 2 for d in deltas)


def test_unstreamed_request_gets_one_delta_when_it_finishes():
    req = scripted(stop=["!"], logprobs=False, top_logprobs=0)
    outputs = OutputTracker()
    outputs.add(req, stream=False)
    for t in (0, 1, 9):
        sample(req, t)
        assert outputs.collect() == []
    finish(req, "stop")
    [(_, d)] = outputs.collect()
    assert d.token_ids == [0, 1, 9] and d.finish_reason == "stop" and d.stop == ["!"]
    assert d.logprobs is None and d.top_logprobs is None and d.prompt_logprobs is None
    assert d.first_token_at == 123.0


def test_requests_are_tracked_apart():
    a, b = scripted("a"), scripted("b")
    outputs = OutputTracker()
    outputs.add(a), outputs.add(b)
    sample(a, 0, 1)
    assert [r.rid for r, _ in outputs.collect()] == ["a"]
    sample(b, 5)
    sample(a, 9)
    got = {r.rid: d for r, d in outputs.collect()}
    assert got["a"].token_ids == [9] and got["a"].logprobs == [-3.0] and got["a"].stop is None
    assert got["b"].token_ids == [5] and got["b"].first_token_at == 123.0
    outputs.remove("a")
    assert outputs.rids() == ["b"]


@pytest.mark.parametrize("stop", [None, ["STOP"], ["world", "STOP"], ["é!"]])
def test_text_deltas_hold_back_a_stop_string_split_across_deltas(stop):
    req = scripted(stop=stop)
    outputs, detok = OutputTracker(), Detokenizer(ByteTokenizer())
    outputs.add(req)
    texts = []
    # "Hello STOP world" + "é!" with "STOP" split as " S" + "TO" + "P", "é" as two bytes
    for tokens in [(0,), (1, 2), (3,), (4, 5), (6, 7), (8,), (9,)]:
        sample(req, *tokens)
        for _, d in outputs.collect():
            texts.append(detok.process(BatchTokenOut(items=[d])).items[0].text)
    finish(req, "stop")
    [(_, d)] = outputs.collect()
    texts.append(detok.process(BatchTokenOut(items=[d])).items[0].text)
    full = decode(req.output_ids)
    assert full == "Hello STOP world\u00e9!"
    assert "".join(texts) == cut_at_stop(full, stop) == make_output(req, decode).text
    assert all("\ufffd" not in t for t in texts)
    if stop == ["STOP"]:
        assert texts == ["", "Hell", "o ", "", "", "", "", ""]
        assert not any(s in t for t in texts for s in stop)
    assert not detok.states


def test_detokenizer_drops_a_failing_request_until_its_final_delta():
    detok = Detokenizer(ByteTokenizer())
    bad = TokenDelta(rid="x", token_ids=[99])  # no such token
    good = TokenDelta(rid="y", token_ids=[0], finish_reason="length")
    out = detok.process(BatchTokenOut(items=[bad, good]))
    assert [d.rid for d in out.items] == ["y"] and out.items[0].text == "Hel"
    assert [e.rid for e in detok.errors] == ["x"]
    more = TokenDelta(rid="x", token_ids=[0])
    last = TokenDelta(rid="x", token_ids=[1], finish_reason="length")
    assert detok.process(BatchTokenOut(items=[more, last])).items == [] and not detok.errors
    assert not detok.states and not detok.dropped


def test_make_output_equals_the_concatenated_deltas():
    req = scripted(stop=["ld"], logprob_start_len=2)
    outputs = OutputTracker()
    outputs.add(req)
    deltas = []
    for tokens in [(0, 1), (5,), (6, 9)]:
        sample(req, *tokens)
        deltas += [d for _, d in outputs.collect()]
    assert make_output(req, decode).finish_reason == "abort"  # unfinished
    finish(req, "stop")
    deltas += [d for _, d in outputs.collect()]
    out = make_output(req, decode)
    assert out.text == "Hello wor" and out.finish_reason == "stop"
    assert out.token_ids == [t for d in deltas for t in d.token_ids] == req.output_ids
    assert out.logprobs == [x for d in deltas for x in d.logprobs] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert out.top_logprobs == [x for d in deltas for x in d.top_logprobs]
    assert out.prompt_logprobs == deltas[0].prompt_logprobs == [-0.5, -0.25]
    assert out.prompt_top_logprobs == deltas[0].prompt_top_logprobs
    assert (out.prompt_tokens, out.cached_tokens) == (4, 2)
    plain = scripted(logprobs=False, top_logprobs=0)
    sample(plain, 0)
    finish(plain, "length")
    got = make_output(plain, decode)
    assert got.logprobs is None and got.top_logprobs is None and got.prompt_logprobs is None


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_text_when_kept_but_the_ending_stop_token(skip):
    """skip_special_tokens=False: a special token the model wrote is text (a tool-call marker,
    for instance), the stop token that ended the request is not; streamed deltas add up to
    the output's text."""
    from transformers import AutoTokenizer

    from radixrt.testing import tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_model_path("llama"))
    special, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.eos_token_id
    assert special != eos
    sp = SamplingParams(max_new_tokens=32, skip_special_tokens=skip)
    req = Req("r", [5, 6], sp)
    req.stop_ids = {eos}
    words = tok.encode("hello world", add_special_tokens=False)
    outputs, detok, texts = OutputTracker(), Detokenizer(tok), []
    outputs.add(req)
    for tokens in [words[:1], [special], words[1:], [eos]]:
        sample(req, *tokens)
        if tokens == [eos]:
            finish(req, "stop")
        for _, d in outputs.collect():
            texts.append(detok.process(BatchTokenOut(items=[d])).items[0].text)

    def engine_decode(ids, skip_special_tokens=True):
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    want = tok.decode(req.output_ids[:-1], skip_special_tokens=skip)
    assert "".join(texts) == make_output(req, engine_decode).text == want
    assert ("<|endoftext|>" in want) != skip and "<|im_end|>" not in want
