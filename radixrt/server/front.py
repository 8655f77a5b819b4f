"""``Front``: the front process's operations, shared by its ZeroMQ and HTTP sides.

It implements ``radixrt.server.front_api.FrontApi`` by composing the roles:
``Admission`` (keys, text, limits), the ``RequestTable``, the ``ReplicaSet``
(where a request runs), ``Controls`` (requests to every replica) and the
``Drain``. A request is admitted in two calls: ``check_admission`` (or
``open_response`` for an HTTP response of several), then ``submit`` per
request, which validates it, picks its replica, books it and sends it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any

from radixrt.config import ServerConfig
from radixrt.protocol import (
    PROTOCOL_VERSION,
    AbortRid,
    ErrorCode,
    ErrorReply,
    TokenizedRequest,
    encode,
)
from radixrt.sampling import SamplingParams
from radixrt.server.admission import Admission
from radixrt.server.controls import CONTROL_KINDS, Controls
from radixrt.server.drain import Drain
from radixrt.server.front_api import FrontStatus, RequestError
from radixrt.server.metrics import ServerMetrics
from radixrt.server.replicas import ReplicaSet
from radixrt.server.request_table import ClientReq, RequestTable

LIMIT_NAMES = (
    "max_prompt_tokens",
    "max_new_tokens_limit",
    "max_requests_per_client",
    "max_message_bytes",
)


class Front:
    def __init__(
        self,
        server: ServerConfig,
        admission: Admission,
        requests: RequestTable,
        replicas: ReplicaSet,
        controls: Controls,
        drain: Drain,
        metrics: ServerMetrics,
        pids: Mapping[str, int],
    ) -> None:
        self.server, self.admission, self.requests = server, admission, requests
        self.replicas, self.controls, self.drain = replicas, controls, drain
        self.server_metrics, self.pids = metrics, dict(pids)
        # the texts of the tokenizer's special tokens (end of turn, end of text, ...)
        self.special_tokens = tuple(admission.tokenizer.all_special_tokens)

    @property
    def model(self) -> Mapping[str, Any]:
        return self.replicas.limits

    # ------------------------------------------------------------ text

    def authorized(self, key: str | None) -> bool:
        return self.admission.authorized(key)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.admission.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.admission.decode(ids)

    def chat_prompt(self, messages: list[dict], **template_kwargs: Any) -> str:
        return self.admission.chat_prompt(messages, **template_kwargs)

    def limit_new_tokens(self, sp: SamplingParams, given: bool) -> SamplingParams:
        return self.admission.limit_new_tokens(sp, given)

    # -------------------------------------------------------- requests

    def check_admission(self, identity: bytes, req_id: str, count: int = 1) -> None:
        """Raise unless ``count`` new requests from this client may start now."""
        self.admission.check(identity, req_id, count)

    def open_response(self, identity: bytes, req_id: str, count: int) -> None:
        self.admission.check(identity, req_id, count)
        self.drain.open_responses += 1

    def close_response(self) -> None:
        self.drain.open_responses -= 1

    def submit(
        self,
        identity: bytes,
        req_id: str,
        ids: list[int],
        sp: SamplingParams,
        *,
        api_key: str | None,
        logprob_start_len: int | None = None,
        stream: bool = False,
        sink: asyncio.Queue | None = None,
        index: int = 0,
        embed: bool = False,
        routing_key: str | None = None,
    ) -> str:
        """Validate one request (after ``check_admission``) and send it to a replica; its rid.
        ``embed``: an embedding request (``sp`` counts for its cache salt only)."""
        if embed and stream:
            raise RequestError(ErrorCode.INVALID_REQUEST, "an embedding request is not streamed")
        if embed:
            sp = SamplingParams(max_new_tokens=0, cache_salt=sp.cache_salt)
        sp = self.admission.isolate(sp, api_key)
        self.admission.validate(ids, logprob_start_len, self.replicas.limits)
        replica = self.replicas.choose(ids, sp.cache_salt, routing_key)
        st = ClientReq(identity, req_id, stream, sink, index)
        rid = self.requests.add(st, replica, ids, sp.cache_salt)
        msg = TokenizedRequest(
            rid=rid,
            input_ids=ids,
            sampling_params=sp,
            logprob_start_len=logprob_start_len,
            stream=stream,
            embed=embed,
            sent_at=time.monotonic(),
        )
        replica.send(encode(msg))
        return rid

    def abort(self, rid: str) -> None:
        """Forget a request still in flight (its client went away) and stop it in its replica,
        which frees its KV; nothing is answered."""
        replica = self.requests.replica_of(rid)
        if self.requests.forget(rid) is not None and replica is not None and replica.up:
            replica.send(encode(AbortRid(rid=rid)))

    def cancel(self, rid: str) -> None:
        """Stop a request in its replica; its last delta (finish_reason "abort") still comes
        back to its client."""
        self.replicas.send(rid, AbortRid(rid=rid))

    # -------------------------------------------------------- controls

    def control(self, kind: str, replica: int = 0, identity: bytes | None = None) -> asyncio.Future:
        """Send a control request to the replicas; the future gets the combined ``data`` (with
        the front's own ``info`` for ``server_info``) or a RequestError, as its result.
        ``identity``: the ZeroMQ client waiting (forgotten with it). An unknown ``kind``, or a
        ``kv_snapshot`` of a replica that does not exist, is a RequestError raised here."""
        if kind not in CONTROL_KINDS:
            raise RequestError(
                ErrorCode.UNKNOWN_MESSAGE, f"control kind must be one of {CONTROL_KINDS}"
            )
        dp_size = len(self.replicas)
        if kind == "kv_snapshot" and not 0 <= replica < dp_size:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, f"replica {replica} does not exist (dp_size {dp_size})"
            )
        fut = asyncio.get_running_loop().create_future()

        def deliver(result: dict | ErrorReply) -> None:
            if fut.done():
                return
            if isinstance(result, ErrorReply):
                fut.set_result(RequestError(result.code, result.message))
            else:
                fut.set_result({**self.info(), **result} if kind == "server_info" else result)

        self.controls.fan_out(kind, deliver, identity, replica)
        return fut

    def info(self) -> dict:
        """The front's part of ``server_info``: the model's and the server's limits, the
        processes, what is in flight and which replicas serve."""
        replicas = self.replicas
        pids = {
            "launcher": os.getppid(),
            "tokenizer_manager": os.getpid(),
            **self.pids,
            **replicas.pids(),
        }
        return {
            **replicas.limits,
            **{k: getattr(self.server, k) for k in LIMIT_NAMES},
            "version": PROTOCOL_VERSION,
            "pids": pids,
            "in_flight": len(self.requests),
            "draining": self.drain.requested,
            "dp_size": len(replicas),
            "replicas_up": [r.index for r in replicas.up],
            "load_balance_method": self.server.load_balance_method,
        }

    def status(self) -> FrontStatus:
        up = tuple(r.index for r in self.replicas.up)
        down = tuple(i for i in range(len(self.replicas)) if i not in up)
        return FrontStatus(self.drain.requested, up, down)

    def metrics(self, scheduler_stats: Mapping[str, Any]) -> bytes:
        return self.server_metrics.render(dict(scheduler_stats), self.replicas.views())
