"""The front's roles without processes or sockets: admission, the request table, responses to
ZeroMQ clients and HTTP sinks, the drain. Replicas are stand-ins that record what they were sent;
the end-to-end behaviour is tests/e2e/test_server*.py and test_http.py's."""

from __future__ import annotations

import asyncio

import pytest

from radixrt.config import ServerConfig
from radixrt.protocol import (
    AbortRid,
    BatchTextOut,
    Drained,
    ErrorCode,
    ErrorReply,
    GenerateReply,
    ReplyBatch,
    StreamChunk,
    TextDelta,
    decode,
)
from radixrt.sampling import SamplingParams
from radixrt.server.admission import Admission
from radixrt.server.drain import Drain
from radixrt.server.front_api import RequestError
from radixrt.server.metrics import ServerMetrics
from radixrt.server.request_table import ClientReq, RequestTable
from radixrt.server.responses import Responses
from radixrt.server.routing import Replica, Router

LIMITS = {"max_context": 64, "kv_slots": 128, "vocab_size": 100}


class Sent:
    """A socket stand-in: what was sent, decoded."""

    def __init__(self) -> None:
        self.msgs: list = []

    def send(self, data: bytes) -> None:
        self.msgs.append(decode(data))


class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw) -> str:
        if kw:
            raise ValueError(f"unknown template arguments {sorted(kw)}")
        return " ".join(m["content"] for m in messages) + (" go" if add_generation_prompt else "")


class Replicas:
    """What the drain needs of a ReplicaSet: ``send(rid, msg)``."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, rid: str, msg) -> None:
        self.sent.append(msg)


def roles(**server):
    """(admission, requests, drain, replica) over one replica that serves."""
    config = ServerConfig(**server)
    replica = Replica(0, Sent())
    replica.up = True
    requests = RequestTable(Router(config, [replica]))
    drain = Drain(config.grace_period, requests, Replicas(), launcher=Sent())
    return Admission(config, Tokenizer(), requests, drain), requests, drain, replica


def book(requests: RequestTable, replica: Replica, identity: bytes, req_id: str, **kw) -> str:
    return requests.add(ClientReq(identity, req_id, **kw), replica, [1, 2, 3], None)


def test_admission_refuses_by_name():
    admission, requests, drain, replica = roles(max_requests_per_client=2, max_prompt_tokens=8)
    book(requests, replica, b"a", "x", stream=False)
    with pytest.raises(RequestError, match="already in flight") as e:
        admission.check(b"a", "x")
    assert e.value.code == ErrorCode.DUPLICATE_RID
    admission.check(b"a", "y")
    with pytest.raises(RequestError, match="1 requests in flight; the limit is 2") as e:
        admission.check(b"a", "y", count=2)
    assert e.value.status == 429
    for ids, start, match in [
        ([], None, "empty"),
        ([1] * 9, None, "at most 8"),
        ([1, 200], None, r"outside \[0, 100\)"),
        ([1, 2], 2, "logprob_start_len 2"),
    ]:
        with pytest.raises(RequestError, match=match):
            admission.validate(ids, start, LIMITS)
    with pytest.raises(RequestError, match="the context is 4 tokens"):
        admission.validate([1] * 5, None, {**LIMITS, "max_context": 4})
    drain.request()
    with pytest.raises(RequestError, match="shutting down"):
        admission.check(b"b", "z")


def test_admission_keys_limits_and_tenants():
    admission, *_ = roles(api_key="k1,k2", isolate_by_api_key=True, max_new_tokens_limit=10)
    assert admission.authorized("k2") and not admission.authorized("k3")
    assert not admission.authorized(None)
    assert roles()[0].authorized(None)  # no key configured: anyone
    assert (
        admission.limit_new_tokens(SamplingParams(max_new_tokens=128), False).max_new_tokens == 10
    )
    with pytest.raises(RequestError, match="over the server's limit of 10"):
        admission.limit_new_tokens(SamplingParams(max_new_tokens=11), True)
    sp = SamplingParams(cache_salt="s")
    salts = {admission.isolate(sp, key).cache_salt for key in ("k1", "k2")}
    assert len(salts) == 2 and "s" not in salts
    assert roles()[0].isolate(sp, "k1") is sp


def test_chat_template_errors_are_the_requests_fault():
    admission = roles()[0]
    assert admission.chat_prompt([{"role": "user", "content": "hi"}]) == "hi go"
    with pytest.raises(RequestError, match="chat template failed") as e:
        admission.chat_prompt([{"role": "user", "content": "hi"}], bogus=1)
    assert e.value.code == ErrorCode.INVALID_REQUEST


def test_request_table_books_clients_and_routes():
    _, requests, _, replica = roles()
    r1 = book(requests, replica, b"a", "x", stream=False)
    r2 = book(requests, replica, b"a", "y", stream=False)
    book(requests, replica, b"\0http:k", "h0:0", stream=True, sink=asyncio.Queue())
    assert requests.rid_of(b"a", "y") == r2 and requests.in_flight(b"a") == 2
    assert requests.rpc_clients() == {b"a"}  # HTTP requests have a sink
    assert requests.replica_of(r1) is replica and replica.in_flight == 3
    assert requests.forget(r1).req_id == "x" and requests.forget(r1) is None
    assert requests.rids_of(b"a") == [r2] and replica.in_flight == 2
    requests.forget(r2)
    assert requests.in_flight(b"a") == 0 and len(requests) == 1


def delta(rid: str, text: str, ids: list[int], finish: str | None = None) -> TextDelta:
    return TextDelta(rid=rid, text=text, token_ids=ids, finish_reason=finish, prompt_tokens=3)


def test_responses_reach_clients_and_sinks():
    _, requests, _, replica = roles()
    replies, metrics = [], ServerMetrics()
    responses = Responses(requests, metrics, lambda identity, msg: replies.append((identity, msg)))
    whole = book(requests, replica, b"a", "whole", stream=False)
    streamed = book(requests, replica, b"a", "streamed", stream=True)
    sink: asyncio.Queue = asyncio.Queue()
    http = book(requests, replica, b"\0http:k", "h0:0", stream=True, sink=sink, index=0)
    responses.on_text_batch(
        BatchTextOut(
            items=[delta(whole, "a", [5]), delta(streamed, "b", [6]), delta(http, "c", [7])]
        )
    )
    assert [(i, type(m)) for i, m in replies] == [(b"a", StreamChunk)]  # whole: nothing yet
    assert sink.get_nowait() == (0, delta(http, "c", [7]))
    responses.on_text_batch(
        BatchTextOut(items=[delta(whole, "d", [8], "stop"), delta(streamed, "e", [9], "length")])
    )
    identity, batch = replies[-1]
    assert identity == b"a" and isinstance(batch, ReplyBatch)  # one message per client per step
    done = next(m for m in batch.items if isinstance(m, GenerateReply))
    assert done.output.text == "ad" and done.output.token_ids == [5, 8]
    assert requests.rid_of(b"a", "whole") is None and requests.rid_of(b"a", "streamed") is None
    responses.fail(http, ErrorCode.REPLICA_FAILED, "gone")
    index, error = sink.get_nowait()
    assert isinstance(error, RequestError) and error.code == ErrorCode.REPLICA_FAILED
    assert len(requests) == 0
    rendered = metrics.render({}).decode()
    assert 'radixrt:requests_total{finish_reason="stop"} 1.0' in rendered
    assert 'radixrt:requests_total{finish_reason="length"} 1.0' in rendered


def test_a_failed_zmq_request_gets_an_error_reply():
    _, requests, _, replica = roles()
    replies = []
    responses = Responses(requests, ServerMetrics(), lambda i, m: replies.append((i, m)))
    rid = book(requests, replica, b"a", "x", stream=False)
    responses.fail(rid, ErrorCode.INTERNAL, "boom")
    assert replies == [(b"a", ErrorReply(req_id="x", code=ErrorCode.INTERNAL, message="boom"))]
    responses.fail(rid, ErrorCode.INTERNAL, "again")  # forgotten: nothing more
    assert len(replies) == 1


def test_drain_waits_for_requests_and_responses_then_reports():
    _, requests, drain, replica = roles(grace_period=3600)
    rid = book(requests, replica, b"a", "x", stream=False)
    drain.step()
    assert drain.launcher.msgs == []  # not requested
    drain.request()
    drain.open_responses = 1
    drain.step()
    assert drain.launcher.msgs == [] and drain.replicas.sent == []  # within the grace period
    requests.forget(rid)
    drain.step()
    assert drain.launcher.msgs == []  # an HTTP response is still being written
    drain.open_responses = 0
    drain.step()
    drain.step()
    assert drain.launcher.msgs == [Drained(aborted=0)]


def test_drain_aborts_what_outlives_the_grace_period_once():
    _, requests, drain, replica = roles(grace_period=0)
    rids = [book(requests, replica, b"a", r, stream=False) for r in ("x", "y")]
    drain.request()
    drain.step()
    drain.step()
    assert drain.replicas.sent == [AbortRid(rid=r) for r in rids]
    for rid in rids:  # their aborted ends arrive
        requests.forget(rid)
    drain.step()
    assert drain.launcher.msgs == [Drained(aborted=2)]


def test_front_implements_every_member_of_the_http_interface():
    import inspect

    from radixrt.server.front import Front
    from radixrt.server.front_api import FrontApi

    for name, member in vars(FrontApi).items():
        if name.startswith("_") or isinstance(member, property):
            continue
        wanted = list(inspect.signature(member).parameters)
        given = list(inspect.signature(getattr(Front, name)).parameters)
        assert given[: len(wanted)] == wanted, name
