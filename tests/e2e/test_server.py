"""The server end to end: `radixrt launch` as a real subprocess on the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from server_harness import Server, wait_gone, wait_idle

import radixrt
from radixrt.client import AsyncClient, Client, ServerError
from radixrt.protocol import ErrorCode, ErrorReply, GenerateRequest, Hello, decode, encode
from radixrt.testing import tiny_model_path

GREEDY = {"temperature": 0.0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-running-requests", "8", "--max-waiting-requests", "40")
    yield srv
    srv.stop()


@pytest.mark.parametrize("stop", [None, ["a"], ["def", "\n\n"]])
def test_detokenizer_deltas_concatenate_to_engine_text(stop):
    import random

    from transformers import AutoTokenizer

    from radixrt.output import Detokenizer, cut_at_stop
    from radixrt.protocol import BatchTokenOut, TokenDelta

    tok = AutoTokenizer.from_pretrained(tiny_model_path("llama"))
    detok = Detokenizer(tok)
    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(0, tok.vocab_size) for _ in range(rng.randint(1, 60))]
        got, pos = [], 0
        while pos < len(ids):
            n = rng.randint(1, 3)
            last = pos + n >= len(ids)
            item = TokenDelta(
                rid=str(trial),
                token_ids=ids[pos : pos + n],
                stop=stop if pos == 0 else None,
                finish_reason="length" if last else None,
            )
            got.append(detok.process(BatchTokenOut(items=[item])).items[0].text)
            pos += n
        assert "".join(got) == cut_at_stop(tok.decode(ids, skip_special_tokens=True), stop)
    assert not detok.states


def test_ready_line(server):
    assert server.ready_line == (
        f"radixrt ready on {server.address} and {server.http} "
        f"(model {os.path.basename(tiny_model_path('llama'))}, 8192 KV slots)\n"
    )


def test_greedy_matches_engine(client):
    prompts = ["def main():", "import os\nimport sys", "class Foo(object):", "The quick brown fox"]
    eng = radixrt.Engine(model=tiny_model_path("llama"), dtype="float32", max_total_tokens=8192)
    want = eng.generate(prompts, radixrt.SamplingParams(**GREEDY))
    got = client.generate_batch(prompts, GREEDY)
    for w, g in zip(want, got):
        assert (g.text, g.token_ids, g.finish_reason, g.prompt_tokens) == (
            w.text,
            w.token_ids,
            w.finish_reason,
            w.prompt_tokens,
        )
    one = client.generate(prompts[0], radixrt.SamplingParams(**GREEDY))
    assert one.token_ids == want[0].token_ids


def test_stream_concatenates_to_full_text(client):
    sp = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    full = client.generate("def parse(text):", sp)
    stream = client.generate("def parse(text):", sp, stream=True)
    chunks = list(stream)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == full.finish_reason == "length"
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].prompt_tokens == full.prompt_tokens
    assert chunks[-1].cached_tokens > 0  # the same prompt again


def test_stop_string_stream(client):
    base = client.generate(
        "import os", {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    )
    stop = base.text[5:8]
    sp = {"temperature": 0.0, "max_new_tokens": 24, "stop": [stop]}
    full = client.generate("import os", sp)
    chunks = list(client.generate("import os", sp, stream=True))
    assert "".join(c.text for c in chunks) == full.text
    assert stop not in full.text


def test_chat_messages(client, server):
    msgs = [{"role": "user", "content": "hello"}]
    out = client.generate(messages=msgs, sampling_params=GREEDY)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path("llama"))
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert out.prompt_tokens == len(ids)
    assert client.generate(input_ids=ids, sampling_params=GREEDY).token_ids == out.token_ids


def test_32_concurrent_requests_from_4_clients(server):
    results: dict[int, list] = {}

    def worker(k: int) -> None:
        with Client(server.address, timeout=60) as c:
            prompts = [f"def f{k}_{i}(x):\n    return" for i in range(8)]
            results[k] = c.generate_batch(
                prompts, {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
            )

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(len(r) == 8 and all(len(o.token_ids) == 12 for o in r) for r in results.values())


def test_shared_prefix_second_round_hits_cache(client):
    prefix = "You are a helpful assistant. Answer briefly and precisely. " * 4
    client.generate_batch([prefix + f"Question {i}?" for i in range(4)], GREEDY)
    second = client.generate_batch([prefix + f"Other question {i}?" for i in range(4)], GREEDY)
    assert all(o.cached_tokens > 0 for o in second)
    assert client.server_info()["hit_rate"] > 0


def test_abort_mid_stream_frees_kv(client):
    stream = client.generate(
        "while True:", {"max_new_tokens": 1500, "ignore_eos": True}, stream=True
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            client.abort(stream.rid)
    assert chunks[-1].finish_reason == "abort"
    info = wait_idle(client)
    assert info["protected_tokens"] == 0 and info["running"] == 0


def test_client_disconnect_aborts_its_requests(server, client):
    gone = Client(server.address, timeout=60)
    stream = iter(
        gone.generate(
            "for i in range(10):", {"max_new_tokens": 1500, "ignore_eos": True}, stream=True
        )
    )
    next(stream), next(stream)
    gone._pending.clear()  # drop the stream without sending an abort, then vanish
    gone.close()
    info = wait_idle(client)
    assert info["protected_tokens"] == 0 and info["running"] == 0


def test_client_disconnect_aborts_non_streaming_requests(server, client):
    gone = Client(server.address, timeout=60)
    gone._send(
        GenerateRequest(
            req_id="long",
            prompt="x = [",  # sent, never waited for
            sampling_params={"max_new_tokens": 1900, "ignore_eos": True},
        )
    )
    deadline = time.monotonic() + 10
    while client.server_info()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    before = client.server_info()
    gone.close()
    info = wait_idle(client, timeout=60)
    assert info["protected_tokens"] == 0 and info["running"] == 0
    # aborted, not run to its 1900 tokens (no timing: machines are noisy)
    assert info.get("finished_abort", 0) == before.get("finished_abort", 0) + 1
    assert info["output_tokens"] - before["output_tokens"] < 1900


def test_errors_are_replies(client):
    with pytest.raises(ServerError) as e:
        client.generate("hi", {"temperature": -1})
    assert e.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(ServerError) as e:
        client.generate("hi", {"no_such_field": 1})
    assert e.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(ServerError) as e:
        client.generate(input_ids=[5] * 3000)
    assert e.value.code == ErrorCode.PROMPT_TOO_LONG
    with pytest.raises(ServerError) as e:
        client.generate(input_ids=[10**6])
    assert e.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(ServerError) as e:
        client.abort("no-such-request")
    assert e.value.code == ErrorCode.UNKNOWN_RID
    assert client.health()


def test_timeout_raises_and_aborts(server, client):
    with Client(server.address, timeout=30) as c:
        with pytest.raises(TimeoutError):
            c.generate("x = 1", {"max_new_tokens": 1500, "ignore_eos": True}, timeout=0.3)
    info = wait_idle(client)
    assert info["protected_tokens"] == 0 and info["running"] == 0


def test_malformed_messages_get_error_replies(server, client):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    bad = [
        b"\xc1garbage",
        b"",
        msgspec.msgpack.encode({"type": "nope", "req_id": "x"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "generate"}),
        msgspec.msgpack.encode({"type": "batch_tokens", "items": []}),
    ]
    try:
        for i in range(100):
            sock.send(bad[i % len(bad)])
        replies = []
        while len(replies) < 100 and sock.poll(10_000):
            replies.append(decode(sock.recv()))
        assert len(replies) == 100 and all(isinstance(r, ErrorReply) for r in replies)
        assert {r.code for r in replies} >= {ErrorCode.MALFORMED, ErrorCode.UNKNOWN_MESSAGE}
        sock.send(encode(Hello(version=999, req_id="h")))
        assert sock.poll(10_000)
        reply = decode(sock.recv())
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.VERSION_MISMATCH
    finally:
        sock.close(0)
    assert client.health()
    assert client.generate("ok", GREEDY).finish_reason in ("stop", "length")


def test_async_client_and_backpressure(server):
    async def main():
        async with AsyncClient(server.address, timeout=60) as c:
            out = await c.generate("async def f():", GREEDY)
            chunks = [ch async for ch in await c.generate("async def f():", GREEDY, stream=True)]
            assert "".join(ch.text for ch in chunks) == out.text
            sp = {"max_new_tokens": 24, "ignore_eos": True}
            results = await asyncio.gather(
                *(c.generate(f"item {i}", sp) for i in range(120)), return_exceptions=True
            )
            assert await c.health()
            return results

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors and all(
        isinstance(e, ServerError) and e.code == ErrorCode.OVERLOADED for e in errors
    )
    assert len(errors) < len(results)


def test_cli_generate_with_server(server, client):
    cmd = [
        sys.executable,
        "-m",
        "radixrt.cli",
        "generate",
        "--server",
        server.address,
        "--max-new-tokens",
        "8",
        "def main():",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    want = client.generate("def main():", {"temperature": 0.0, "max_new_tokens": 8}).text
    assert res.stdout == want + "\n"


def test_sigterm_stops_every_process(server, client):
    wait_idle(client)
    pids = set(client.server_info()["pids"].values()) - {server.proc.pid}
    kids = server.children()
    assert len(pids) == 3 and pids <= kids
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(10) == 0
    assert not wait_gone(kids, 10 - (time.monotonic() - start))


def test_killing_the_scheduler_stops_the_launcher():
    srv = Server()
    try:
        with Client(srv.address, timeout=30) as c:
            pids = c.server_info()["pids"]
        kids = srv.children()
        os.kill(pids["scheduler"], signal.SIGKILL)
        assert srv.proc.wait(10) != 0
        assert not wait_gone(kids, 10)
    finally:
        srv.stop()


def test_children_die_with_a_killed_launcher():
    srv = Server()
    try:
        kids = srv.children()
        assert len(kids) >= 3
        srv.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG / the parent-pid check
        srv.proc.wait(5)
        assert not wait_gone(kids, 10)
    finally:
        srv.stop()
        import glob
        import shutil
        import tempfile

        for path in glob.glob(os.path.join(tempfile.gettempdir(), f"radixrt-{srv.proc.pid}-*")):
            shutil.rmtree(path, ignore_errors=True)  # the killed launcher's ipc folder
