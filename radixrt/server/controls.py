"""Control requests fanned out to the data-parallel replicas, and their answers combined.

A ``Gather`` is one control request (``server_info``, ``flush_cache``,
``health``) sent to every replica that is up, under sub-ids ``QID/i``. It is
answered once each of them replied or went down: the first error if any
replica refused, else the combined data. ``kv_snapshot`` goes to one
replica. ``combine`` merges per-replica ``server_info`` data: counters and
gauges summed, the hit rate recomputed from the sums, the model's limits
taken from one replica, and every replica's own data under ``replicas``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixrt.protocol import ControlReply, ErrorReply

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
