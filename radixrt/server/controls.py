"""Control requests fanned out to the data-parallel replicas, and their answers combined.

A ``Gather`` is one control request (``server_info``, ``flush_cache``,
``health``) sent to every replica that is up, under sub-ids ``QID/i``. It is
answered once each of them replied or went down: the first error if any
replica refused, else the combined data. ``kv_snapshot`` goes to one
replica. ``combine`` merges per-replica ``server_info`` data: counters and
gauges summed, the hit rate recomputed from the sums, the model's limits
taken from one replica, and every replica's own data under ``replicas``.
``Controls`` keeps the gathers in flight: it sends them, routes the
replicas' replies to them, and answers them when a replica goes down.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixrt.protocol import ControlReply, ControlRequest, ErrorCode, ErrorReply, encode

if TYPE_CHECKING:
    from radixrt.server.replicas import ReplicaSet

CONTROL_KINDS = ("server_info", "flush_cache", "health", "kv_snapshot")

# server_info fields that describe a replica or the model rather than count something
NOT_SUMMED = frozenset(
    {
        "max_context",
        "vocab_size",
        "page_size",
        "max_waiting_requests",
        "threads",
        "replica",
        "scheduler_pid",
        "gc_frozen_objects",
        "hit_rate",
        "hicache_block_tokens",
    }
)


def sub_id(qid: str, replica: int) -> str:
    return f"{qid}/{replica}"


def split_id(req_id: str) -> tuple[str, int | None]:
    qid, _, tail = req_id.rpartition("/")
    return (qid, int(tail)) if qid and tail.isdigit() else (req_id, None)


class Gather:
    """A control request awaiting its replicas' replies; ``deliver`` gets the answer once:
    combined data (a dict) or the first ``ErrorReply``."""

    def __init__(
        self,
        kind: str,
        replicas: set[int],
        deliver: Callable[[dict | ErrorReply], None],
        identity: bytes | None = None,
    ) -> None:
        self.kind, self.waiting, self.deliver = kind, set(replicas), deliver
        self.identity = identity  # the ZeroMQ client that asked (None: HTTP, or internal)
        self.replies: dict[int, dict] = {}
        self.error: ErrorReply | None = None

    def reply(self, replica: int, msg: ControlReply | ErrorReply) -> bool:
        """Take one replica's reply; True once the gather is complete (and delivered)."""
        if isinstance(msg, ErrorReply):
            self.error = self.error or msg
        else:
            self.replies[replica] = msg.data
        return self.drop(replica)

    def drop(self, replica: int) -> bool:
        """Stop waiting for ``replica`` (it replied or went down); True once complete."""
        self.waiting.discard(replica)
        if self.waiting:
            return False
        self.deliver(self.error if self.error is not None else self.result())
        return True

    def result(self) -> dict:
        if self.kind == "server_info":
            return combine(self.replies)
        if self.kind == "health":
            return {"ok": True, "replicas_up": len(self.replies)}
        return next(iter(self.replies.values()), {"ok": True})


def combine(replies: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One server_info from the replicas' own (each kept under ``replicas``, by index)."""
    if not replies:
        return {"replicas": []}
    ordered = [replies[i] for i in sorted(replies)]
    out = dict(ordered[0])
    for r in ordered[1:]:  # a counter a replica has not counted yet is missing from its data
        for key, value in r.items():
            out.setdefault(key, value)
    for key, value in list(out.items()):
        if key in NOT_SUMMED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = sum(r.get(key, 0) for r in ordered)
    prompt = out.get("prompt_tokens", 0)
    out["hit_rate"] = out.get("cached_tokens", 0) / prompt if prompt else 0.0
    out.pop("replica", None)
    out.pop("scheduler_pid", None)
    out["replicas"] = ordered
    return out


class Controls:
    """The control requests in flight, each a ``Gather`` under its own qid."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.gathers: dict[str, Gather] = {}
        self.qids = itertools.count()

    def fan_out(
        self,
        kind: str,
        deliver: Callable[[dict | ErrorReply], None],
        identity: bytes | None = None,
        replica: int = 0,
    ) -> None:
        """Send control request ``kind`` to every replica that is up (``kv_snapshot``: to
        ``replica``); ``deliver`` gets the answer, at once an ErrorReply when no replica can
        take it. ``identity``: the ZeroMQ client waiting for it, if any."""
        ups = {r.index for r in self.replicas.up}
        targets = {replica} & ups if kind == "kv_snapshot" else ups
        if not targets:
            why = f"replica {replica} is not serving" if kind == "kv_snapshot" else "no replica"
            code = ErrorCode.UNAVAILABLE
            return deliver(ErrorReply(req_id="", code=code, message=f"{kind}: {why}"))
        qid = f"q{next(self.qids)}"
        self.gathers[qid] = Gather(kind, targets, deliver, identity)
        for i in targets:
            self.replicas[i].send(encode(ControlRequest(req_id=sub_id(qid, i), kind=kind)))

    def on_reply(self, msg: ControlReply | ErrorReply) -> None:
        """A replica's answer to one of the gathers (others are ignored)."""
        qid, replica = split_id(msg.req_id)
        gather = self.gathers.get(qid)
        if gather is not None and replica is not None and gather.reply(replica, msg):
            del self.gathers[qid]

    def on_replica_down(self, replica: int) -> None:
        """Answer the gathers without ``replica``."""
        for qid, gather in list(self.gathers.items()):
            if gather.drop(replica):
                del self.gathers[qid]

    def drop_client(self, identity: bytes) -> None:
        """Forget the gathers a vanished ZeroMQ client waits for."""
        for qid in [q for q, g in self.gathers.items() if g.identity == identity]:
            del self.gathers[qid]

    def clients(self) -> set[bytes]:
        """The ZeroMQ clients waiting for a control answer."""
        return {g.identity for g in self.gathers.values() if g.identity is not None}
