"""Protocol fuzzing through the real socket.

Hypothesis builds client messages of every type with hostile values (negative,
huge, NaN or empty fields, unknown enum strings, deep nesting, wrong types)
plus random bytes and multi-frame sends, and sends them one at a time to a
real `radixrt launch` subprocess. Every one must get an error reply or a
valid result; afterwards the server answers a normal request and its KV is
back to the idle invariant.
"""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_harness import Server, assert_idle_kv

from radixrt.client import Client
from radixrt.protocol import (
    ControlReply,
    ErrorReply,
    GenerateReply,
    HelloReply,
    ReplyBatch,
    StreamChunk,
    decode,
)
from radixrt.sampling import SamplingParams

REPLY_TIMEOUT_MS = 60_000
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 50_000, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=6),
    st.sampled_from(["", "greedy", "auto", "NaN", "inf", "lru", "server_info", "<fault:forward>"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
SP_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
plausible = {  # values of the right type, often out of range
    "max_new_tokens": st.integers(-5, 40),
    "temperature": st.floats(-1, 3) | st.just(float("nan")),
    "top_p": st.floats(-0.5, 1.5) | st.just(float("nan")),
    "top_k": st.integers(-3, 70_000),
    "min_p": st.floats(-0.5, 1.5),
    "stop": st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(-3, 70_000), max_size=3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "cache_salt": st.one_of(st.text(max_size=300), st.none()),
}
sampling = st.dictionaries(
    st.sampled_from(SP_FIELDS + ["bogus", ""]),
    st.one_of(values, *[s for s in plausible.values()]),
    max_size=6,
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "", "robot"])
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(roles, values), "content": st.one_of(st.text(max_size=30), values)}
    ),
    max_size=3,
)
req_ids = st.one_of(st.text(min_size=1, max_size=8), values)

hostile_generate = st.fixed_dictionaries(
    {"type": st.just("generate"), "req_id": req_ids},
    optional={
        "prompt": st.one_of(st.text(max_size=40), values),
        "input_ids": st.one_of(st.lists(st.integers(-5, 70_000), max_size=16), values),
        "messages": st.one_of(messages, values),
        "sampling_params": st.one_of(sampling, values),
        "stream": st.one_of(st.booleans(), values),
        "logprob_start_len": st.one_of(st.integers(-3, 40), values),
        "api_key": values,
        "extra": values,
    },
)
plausible_generate = st.fixed_dictionaries(  # mostly valid: many run to a result
    {
        "type": st.just("generate"),
        "req_id": st.text(min_size=1, max_size=8),
        "prompt": st.text(min_size=1, max_size=40),
        "sampling_params": st.fixed_dictionaries(
            {"max_new_tokens": st.integers(1, 8)},
            optional={k: plausible[k] for k in plausible if k != "max_new_tokens"},
        ),
        "stream": st.booleans(),
    }
)
generate = st.one_of(plausible_generate, hostile_generate)
others = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("hello"), "version": st.one_of(st.integers(-2, 3), values)},
        optional={"req_id": req_ids},
    ),
    st.fixed_dictionaries({"type": st.just("abort"), "req_id": req_ids, "target": values}),
    st.fixed_dictionaries(
        {
            "type": st.just("control"),
            "req_id": req_ids,
            "kind": st.one_of(
                st.sampled_from(["server_info", "health", "flush_cache", "shutdown", ""]), values
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.one_of(
                st.sampled_from(
                    ["result", "chunk", "tokenized", "abort_rid", "ping", "drained", "nope"]
                ),
                values,
            ),
            "req_id": req_ids,
        }
    ),
    st.dictionaries(st.text(max_size=6), values, max_size=4),
    values,
)


def terminal(msg) -> bool:
    if isinstance(msg, StreamChunk):
        return msg.finish_reason is not None
    return isinstance(msg, (ErrorReply, GenerateReply, HelloReply, ControlReply))


class Wire:
    """A raw DEALER that sends one frame (or several) and waits for the reply that ends it."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.ids = itertools.count()

    def exchange(self, frames: list[bytes]) -> object:
        self.sock.send_multipart(frames)
        while True:
            assert self.sock.poll(REPLY_TIMEOUT_MS), f"no reply to {frames!r:.200}"
            msg = decode(self.sock.recv())
            items = msg.items if isinstance(msg, ReplyBatch) else [msg]
            for item in items:
                assert not isinstance(item, ErrorReply) or item.code != "internal", item
                if terminal(item):
                    return item

    def send_dict(self, data) -> object:
        if isinstance(data, dict) and isinstance(data.get("req_id"), str):
            data["req_id"] = f"{data['req_id']}-{next(self.ids)}"  # replies match one request
        return self.exchange([msgspec.msgpack.encode(data)])


@pytest.fixture(scope="module")
def fuzz_server():
    srv = Server("--max-new-tokens-limit", "8", "--max-message-bytes", "65536")
    wire = Wire(srv.address)
    yield srv, wire
    wire.sock.close()
    with Client(srv.address, timeout=60) as c:
        assert c.generate("def add(a, b):", {"max_new_tokens": 4}).token_ids  # still serving
        assert_idle_kv(c)
    assert srv.proc.poll() is None
    srv.stop()


@FUZZ
@given(msg=generate)
def test_hostile_generate_requests(fuzz_server, msg):
    reply = fuzz_server[1].send_dict(msg)
    event(f"reply: {type(reply).__name__} {getattr(reply, 'code', '')}")
    if isinstance(reply, GenerateReply):
        assert reply.output.finish_reason in ("stop", "length")


@FUZZ
@given(msg=others)
def test_hostile_other_messages(fuzz_server, msg):
    fuzz_server[1].send_dict(msg)


@settings(FUZZ, max_examples=60)
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_random_bytes(fuzz_server, frames):
    reply = fuzz_server[1].exchange(frames)
    assert isinstance(reply, ErrorReply) or len(frames) == 1


def test_deep_nesting_and_empty_frames(fuzz_server):
    wire = fuzz_server[1]
    deep = b"\x82\xa4type\xa8generate\xa6req_id" + b"\x91" * 5000 + b"\xa1a"
    for frames in ([deep], [b""], [b"", b""], [b"\x80"], [b"\xdd\xff\xff\xff\xff"]):
        assert isinstance(wire.exchange(frames), ErrorReply)
