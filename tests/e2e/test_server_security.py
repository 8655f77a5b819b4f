"""Who may connect, what they may ask for, tenant isolation, and the SIGTERM drain.

Every server here is a real `radixrt launch` subprocess on the tiny model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import msgspec
import pytest
import zmq
from server_harness import Server, assert_idle_kv, wait_idle

from radixrt.client import Client, ServerError
from radixrt.protocol import ErrorCode, ErrorReply, GenerateRequest, decode, encode

KEYS = ("key-alpha", "key-beta")
SHARED = "You are a careful assistant. Answer in one short sentence. " * 6  # > 32 tokens


@pytest.fixture(scope="module")
def guarded():
    """API keys (two tenants, isolated) and small limits."""
    srv = Server(
        "--api-key",
        ",".join(KEYS),
        "--isolate-by-api-key",
        "--max-message-bytes",
        "4096",
        "--max-prompt-tokens",
        "200",
        "--max-new-tokens-limit",
        "64",
        "--max-requests-per-client",
        "2",
    )
    yield srv
    srv.stop()


@pytest.fixture
def alpha(guarded):
    with Client(guarded.address, timeout=60, api_key=KEYS[0]) as c:
        yield c
        assert_idle_kv(c)


def raw_socket(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def recv(sock: zmq.Socket, timeout_ms: int = 30000):
    assert sock.poll(timeout_ms), "no reply"
    return decode(sock.recv())


# ------------------------------------------------------------------ who may connect


def test_requests_need_a_valid_api_key(guarded, alpha):
    assert "127.0.0.1" in guarded.ready_line
    for key in (None, "", "key-gamma", KEYS[0] + "x"):
        with pytest.raises(ServerError) as e:
            Client(guarded.address, timeout=30, api_key=key)
        assert e.value.code == ErrorCode.UNAUTHORIZED
    sock = raw_socket(guarded.address)  # every message is checked, not only the handshake
    sock.send(encode(GenerateRequest(req_id="r1", prompt="hi")))
    reply = recv(sock)
    assert (
        isinstance(reply, ErrorReply)
        and reply.req_id == "r1"
        and reply.code == ErrorCode.UNAUTHORIZED
    )
    sock.close()
    with Client(guarded.address, timeout=30, api_key=KEYS[1]) as beta:
        assert beta.generate("hi", {"max_new_tokens": 4}).finish_reason in ("stop", "length")
    assert alpha.generate("hi", {"max_new_tokens": 4}).finish_reason in ("stop", "length")


def test_api_key_from_the_environment():
    env = {**os.environ, "RADIXRT_API_KEY": "from-env"}
    srv = Server(env=env)
    try:
        with pytest.raises(ServerError) as e:
            Client(srv.address, timeout=30, api_key="wrong")
        assert e.value.code == ErrorCode.UNAUTHORIZED
        with Client(srv.address, timeout=30, api_key="from-env") as c:
            assert c.generate("hi", {"max_new_tokens": 3}).token_ids
            assert_idle_kv(c)
    finally:
        srv.stop()


def test_curve_encryption(tmp_path):
    folder = str(tmp_path / "keys")
    res = subprocess.run(
        [sys.executable, "-m", "radixrt.cli", "curve-keygen", folder],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert oct(os.stat(os.path.join(folder, "server.key_secret")).st_mode & 0o777) == "0o600"
    srv = Server("--curve-keys", folder)
    try:
        with Client(
            srv.address, timeout=30, curve_server_key=os.path.join(folder, "server.key")
        ) as c:
            out = c.generate("def f(x):", {"max_new_tokens": 5, "temperature": 0})
            assert len(out.token_ids) == 5
            assert_idle_kv(c)
        with pytest.raises(TimeoutError):  # plaintext never completes the handshake
            Client(srv.address, timeout=2)
        # ...so its hello can never leave (a DEALER without a peer): the I/O thread must not
        # sit blocked in send, but end with the client
        assert not [t for t in threading.enumerate() if t.name == "radixrt-client"]
        import zmq.auth

        public = zmq.auth.load_certificate(os.path.join(folder, "server.key"))[0]
        with Client(srv.address, timeout=30, curve_server_key=public.decode()) as c:
            assert c.health()
    finally:
        srv.stop()


# ------------------------------------------------------------------ limits


def test_message_size_limit(guarded, alpha):
    with pytest.raises(ServerError) as e:
        alpha.generate("word " * 1000, {"max_new_tokens": 2})  # > 4096 bytes
    assert e.value.code == ErrorCode.TOO_LARGE and "4096" in str(e.value)
    sock = raw_socket(guarded.address)  # far over: the connection is dropped unread...
    sock.send(b"\x00" * (5 * 4096))
    sock.close()
    assert alpha.generate("hi", {"max_new_tokens": 2}).token_ids  # ...and the server serves on


def test_prompt_and_max_new_tokens_limits(alpha):
    with pytest.raises(ServerError) as e:
        alpha.generate(input_ids=[7] * 201)
    assert e.value.code == ErrorCode.PROMPT_TOO_LONG and "200" in str(e.value)
    assert (
        alpha.generate(input_ids=[7] * 200, sampling_params={"max_new_tokens": 1}).prompt_tokens
        == 200
    )
    with pytest.raises(ServerError) as e:
        alpha.generate("hi", {"max_new_tokens": 65})
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED and "64" in str(e.value)
    assert len(alpha.generate("hi", {"max_new_tokens": 64, "ignore_eos": True}).token_ids) == 64


def test_requests_in_flight_per_client(guarded, alpha):
    long = {"max_new_tokens": 64, "ignore_eos": True}
    streams = [alpha.generate("a", long, stream=True) for _ in range(2)]
    with pytest.raises(ServerError) as e:
        alpha.generate("b", {"max_new_tokens": 2})
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED and "2" in str(e.value)
    with Client(guarded.address, timeout=60, api_key=KEYS[0]) as other:  # per client, not global
        assert other.generate("c", {"max_new_tokens": 2}).token_ids
    for s in streams:
        assert sum(len(c.token_ids) for c in s) == 64
    assert alpha.generate("d", {"max_new_tokens": 2}).token_ids  # the slots came back


# ------------------------------------------------------------------ tenant isolation


def test_tenants_never_share_cached_prefixes(guarded, alpha):
    prompt = SHARED + "Question one?"
    sp = {"max_new_tokens": 4, "temperature": 0}
    first = alpha.generate(prompt, sp)
    assert alpha.generate(prompt, sp).cached_tokens > 0  # the same tenant hits
    with Client(guarded.address, timeout=60, api_key=KEYS[1]) as beta:
        other = beta.generate(prompt, sp)
        assert other.cached_tokens == 0  # the other tenant never does
        assert other.token_ids == first.token_ids
        assert beta.generate(prompt, sp).cached_tokens > 0
        assert_idle_kv(beta)


def test_cache_salt_namespaces_the_cache(guarded, alpha):
    prompt = SHARED + "Question two?"
    salted = lambda salt: {"max_new_tokens": 4, "temperature": 0, "cache_salt": salt}  # noqa: E731
    a = alpha.generate(prompt, salted("s1"))
    b = alpha.generate(prompt, salted("s2"))
    assert b.cached_tokens == 0 and b.token_ids == a.token_ids
    assert alpha.generate(prompt, salted("s1")).cached_tokens > 0
    with Client(guarded.address, timeout=60, api_key=KEYS[1]) as beta:  # same salt, other tenant
        assert beta.generate(prompt, salted("s1")).cached_tokens == 0


# ------------------------------------------------------------------ graceful drain


def _stream_in_thread(client: Client, prompt: str, max_new_tokens: int):
    """Start a streamed request; return (first-chunk event, result dict filled when it ends)."""
    started, result = threading.Event(), {}

    def run():
        try:
            chunks = []
            for chunk in client.generate(
                prompt,
                {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                stream=True,
                timeout=120,
            ):
                chunks.append(chunk)
                started.set()
            result["tokens"] = sum(len(c.token_ids) for c in chunks)
            result["finish"] = chunks[-1].finish_reason
        except Exception as e:  # noqa: BLE001 (reported to the test)
            result["error"] = e
        started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return started, result, t


def _wait_draining(address: str) -> None:
    """Poll until the server reports it is draining (fails fast if it has already gone)."""
    with Client(address, timeout=10) as client:
        for _ in range(600):
            if client.server_info().get("draining"):
                return
            threading.Event().wait(0.05)
    pytest.fail("the server never started draining")


@contextlib.contextmanager
def sigterm_mid_stream(grace_period: str, prompt: str, max_new_tokens: int):
    """A server with one streamed request under way, sent SIGTERM: (server, client, result,
    thread)."""
    srv = Server("--grace-period", grace_period)
    try:
        with Client(srv.address, timeout=120) as c:
            started, result, t = _stream_in_thread(c, prompt, max_new_tokens)
            assert started.wait(60)
            srv.proc.send_signal(signal.SIGTERM)
            yield srv, c, result, t
    finally:
        srv.stop()


def test_sigterm_drains_running_requests_then_exits_0():
    with sigterm_mid_stream("120", "for i in range(", 800) as (srv, c, result, t):
        _wait_draining(srv.address)
        with pytest.raises(ServerError) as e:
            c.generate("new work", {"max_new_tokens": 2})
        assert e.value.code == ErrorCode.SHUTTING_DOWN
        t.join(120)
        assert result == {"tokens": 800, "finish": "length"}  # nothing lost, nothing cut
        assert srv.proc.wait(60) == 0


def test_grace_period_over_aborts_what_is_left():
    with sigterm_mid_stream("0.5", "x = [", 1900) as (srv, c, result, t):
        t.join(120)
        assert result.get("finish") == "abort" and result["tokens"] < 1900  # the client hears of it
        assert srv.proc.wait(60) == 1
        assert "aborted 1 running" in srv.proc.stderr.read()


def test_second_sigterm_stops_at_once():
    with sigterm_mid_stream("600", "x = [", 1900) as (srv, c, result, t):
        _wait_draining(srv.address)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0  # long before 1900 tokens or 600 s
        assert "tokens" not in result


def test_malformed_frames_do_not_need_a_key(guarded, alpha):
    """Undecodable bytes get an error (never a crash); deep nesting included."""
    sock = raw_socket(guarded.address)
    deep = b"\x83\xa4type\xa8generate\xa6req_id\xa1a\xa6prompt" + b"\x91" * 3000 + b"\xc0"
    for frame in (b"\xc1", msgspec.msgpack.encode([1, 2]), deep):
        sock.send(frame)
        reply = recv(sock)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.MALFORMED
    sock.close()
    assert wait_idle(alpha)["running"] == 0
