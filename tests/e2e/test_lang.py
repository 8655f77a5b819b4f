"""radixrt.lang end to end on the tiny model: an in-process Engine and a server subprocess."""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading

import pytest
import torch

import radixrt.lang as rl
from radixrt.lang.backend import REQUEST_LOG_LEN
from radixrt.sampling import SamplingParams
from radixrt.testing import tiny_model_path

PREFIX = "def handler(request):\n    # parse the request body and return the answer\n    data ="


@rl.function
def qa(s, question):
    s += rl.system("You answer in one word.")
    s += rl.user(question)
    s += rl.assistant(rl.gen("answer", max_tokens=16, stop="\n"))


@rl.function
def pick(s, prefix, choices):
    s += prefix
    s += rl.select("choice", choices=choices)


@rl.function
def forked(s, prefix):
    s += prefix
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += f" {i} +"
        f += rl.gen("x", max_tokens=4)
    forks.join()
    s += "done"
    s.meta["forks"] = forks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine():
    from radixrt import Engine

    eng = Engine(model=tiny_model_path("llama"), dtype="float32", max_total_tokens=8192)
    yield eng
    eng.check_memory()


@pytest.fixture(scope="module")
def server_address():
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "radixrt.cli",
        "launch",
        "--model",
        tiny_model_path("llama"),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        "--port",
        str(port),
        "--http-port",
        "0",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        assert lines.get(timeout=120).startswith("radixrt ready")
        yield f"tcp://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture(params=["engine", "server"])
def backend(request):
    if request.param == "engine":
        yield rl.EngineBackend(request.getfixturevalue("engine"))
    else:
        be = rl.RuntimeEndpoint(request.getfixturevalue("server_address"))
        yield be
        be.close()


def _raw_generate(backend, text: str, sp: SamplingParams):
    ids = backend.tokenizer.encode(text)
    return backend.generate(ids, sp)


def test_qa_matches_hand_built_prompt(backend):
    state = qa.run(question="Capital of France?", backend=backend)
    assert state.error is None
    msgs = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ]
    prompt = backend.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = _raw_generate(
        backend, prompt, SamplingParams(max_new_tokens=16, temperature=0.0, stop="\n")
    )
    assert state["answer"] == want.text
    assert state.text() == prompt + want.text + "<|im_end|>\n"
    assert state.messages() == msgs + [{"role": "assistant", "content": want.text}]


def test_select_matches_transformers(backend):
    from transformers import AutoModelForCausalLM

    choices = [" None", " request.json()", " 42", " parse(request.body, strict=True)"]
    state = pick.run(prefix=PREFIX, choices=choices, backend=backend)
    assert state.error is None
    tok = backend.tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32)
    prefix = tok.encode(PREFIX)
    scores = []
    with torch.no_grad():
        for c in choices:
            cont = tok.encode(c, add_special_tokens=False)
            lp = model(torch.tensor([prefix + cont])).logits.log_softmax(-1)[0]
            scores.append(
                sum(lp[len(prefix) - 1 + k, t].item() for k, t in enumerate(cont)) / len(cont)
            )
    assert state["choice"] == choices[max(range(len(choices)), key=scores.__getitem__)]
    assert state.get_meta_info("choice")["normalized_logprobs"] == pytest.approx(scores, abs=1e-3)


def test_fork_children_hit_shared_prefix(backend):
    state = forked.run(prefix=PREFIX, backend=backend)
    assert state.error is None
    shared = len(backend.tokenizer.encode(PREFIX))
    forks = state.meta["forks"]
    assert len(forks) == 4
    for f in forks:
        assert f.get_meta_info("x")["cached_tokens"] >= shared
        assert f.text().startswith(PREFIX)


def test_run_batch_16_with_progress_bar(backend, capsys):
    qs = [f"Question number {i}?" for i in range(16)]
    states = qa.run_batch(
        [{"question": q} for q in qs], backend=backend, num_threads=8, progress_bar=True
    )
    assert len(states) == 16 and all(st.error is None for st in states)
    singles = qa.run(question=qs[3], backend=backend)
    assert states[3]["answer"] == singles["answer"]
    assert "16/16" in capsys.readouterr().err


def test_stream_equals_plain_run(backend):
    plain = qa.run(question="What is two plus two?", backend=backend)
    streamed = qa.run(question="What is two plus two?", backend=backend, stream=True)
    pieces = list(streamed.text_iter())
    assert "".join(pieces) == plain.text()
    assert streamed.text() == plain.text() and streamed["answer"] == plain["answer"]


def test_errors(backend):
    @rl.function
    def broken(s):
        s += "hello"
        raise ValueError("boom")

    state = broken.run(backend=backend)
    assert isinstance(state.error, ValueError) and "boom" in str(state.error)
    with pytest.raises(KeyError, match="missing"):
        qa.run(question="Hi?", backend=backend)["missing"]


RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
DATE = r"\d{4}-\d{2}-\d{2}"


@rl.function
def extract(s, text):
    s += rl.user(f"Extract the person from: {text}")
    s += rl.assistant(rl.gen("record", max_tokens=200, json_schema=RECORD))
    s += "Born on: "
    s += rl.gen("date", max_tokens=16, regex=DATE)
    forks = s.fork(2)
    for f in forks:
        f += " Mood: "
        f += rl.gen("mood", max_tokens=8, regex="(calm|busy)", temperature=1.0)
    forks.join()
    s.meta["moods"] = [f["mood"] for f in forks]


def test_a_program_extracts_fields_with_json_schema_and_regex(backend):
    import json
    import re

    import jsonschema

    state = extract.run(text="Ada, 36, born 1815-12-10", backend=backend)
    assert state.error is None, state.error
    jsonschema.validate(json.loads(state["record"]), RECORD)
    assert re.fullmatch(DATE, state["date"])
    assert all(m in ("calm", "busy") for m in state.meta["moods"])
    with pytest.raises(ValueError, match="SamplingParams.regex: invalid regex"):
        rl.gen("x", regex="[unclosed")


def test_backend_down_raises():
    down = rl.RuntimeEndpoint(f"tcp://127.0.0.1:{_free_port()}", connect_timeout=1.0)
    with pytest.raises(TimeoutError):
        qa.run(question="Hi?", backend=down)
    down.close()


def test_engine_score_and_prefill_only_cache(engine):
    tok = engine.tokenizer
    prefix = tok.encode(PREFIX)
    out = engine.generate(
        input_ids=[prefix + tok.encode(" x")], sampling_params=SamplingParams(max_new_tokens=0)
    )[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    again = engine.generate(
        input_ids=[prefix + tok.encode(" x")], sampling_params=SamplingParams(max_new_tokens=0)
    )[0]
    assert again.cached_tokens >= len(prefix)
    ((lp, n),) = engine.score(prefix, [tok.encode(" x", add_special_tokens=False)])
    assert n == 1 and lp < 0
    engine.check_memory()


@rl.function
def cont(s, prefix):
    s += prefix
    s += rl.gen("x", max_tokens=4)


def test_cache_salt_namespaces_a_run(engine):
    be = rl.EngineBackend(engine)
    prefix = "# a salted run\n" + PREFIX  # starts unlike any prompt the other tests cache
    shared = len(be.tokenizer.encode(prefix))
    tok = be.tokenizer
    num_special = len(tok.encode("a")) - len(tok.encode("a", add_special_tokens=False))
    a = forked.run(prefix=prefix, backend=be, cache_salt="lang-a")
    assert a.error is None
    for f in a.meta["forks"]:  # the fork's prefix was cached under the run's salt
        assert f.get_meta_info("x")["cached_tokens"] >= shared
    b = cont.run(prefix=prefix, backend=be, cache_salt="lang-b")
    plain = cont.run(prefix=prefix, backend=be)
    again = cont.run(prefix=prefix, backend=be, cache_salt="lang-a")
    assert b.get_meta_info("x")["cached_tokens"] == 0
    assert plain.get_meta_info("x")["cached_tokens"] <= num_special  # at most a shared BOS
    assert again.get_meta_info("x")["cached_tokens"] >= shared - 1  # all but the last prompt token
    assert b["x"] == plain["x"] == again["x"]
    with pytest.raises(ValueError, match="cache_salt"):
        cont.run(prefix=prefix, backend=be, cache_salt="")
    engine.check_memory()


def test_cache_salt_reaches_select_and_run_batch(engine):
    be = rl.EngineBackend(engine)
    choices = [" None", " 42"]
    salted = pick.run(prefix=PREFIX + " pick(", choices=choices, backend=be, cache_salt="lang-c")
    plain = pick.run(prefix=PREFIX + " pick(", choices=choices, backend=be)
    assert salted["choice"] == plain["choice"]
    logprobs = [st.get_meta_info("choice")["logprobs"] for st in (salted, plain)]
    assert logprobs[0] == pytest.approx(logprobs[1])
    hit = cont.run(prefix=PREFIX + " pick(", backend=be, cache_salt="lang-c")
    assert hit.get_meta_info("x")["cached_tokens"] > 0  # select cached its prefix under lang-c
    qs = [{"question": f"Salted question {i}?"} for i in range(3)]
    states = qa.run_batch(
        qs + [{"question": "Salted question 0?", "cache_salt": "lang-e"}],
        backend=be,
        cache_salt="lang-d",
    )
    assert all(st.error is None for st in states)
    assert all(st.get_meta_info("answer")["cached_tokens"] > 0 for st in states[:3])
    assert states[3].get_meta_info("answer")["cached_tokens"] == 0  # its own salt: nothing cached
    assert states[3]["answer"] == states[0]["answer"]
    engine.check_memory()


def test_request_log_keeps_the_latest_prompts(engine):
    be = rl.EngineBackend(engine, request_log_len=2)
    prompts = [be.tokenizer.encode(f"x{i} =") for i in range(3)]
    for ids in prompts:
        be.generate(ids, SamplingParams(max_new_tokens=1))
    assert list(be.request_log) == prompts[1:]
    every = rl.EngineBackend(engine, request_log_len=None)
    for ids in prompts:
        every.generate(ids, SamplingParams(max_new_tokens=1))
    assert list(every.request_log) == prompts
    assert rl.RuntimeEndpoint("tcp://127.0.0.1:1").request_log.maxlen == REQUEST_LOG_LEN
