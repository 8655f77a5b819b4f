"""The front's view of the data-parallel replicas.

``ReplicaSet`` holds one ``Replica`` per scheduler process (its request
socket, whether it serves, its mirrored tree), the ``Router`` that picks one
for each request, and the KV-event sockets: a SUB on every replica's events
(the mirrors are built from them) and, with ``kv_events_endpoint``, a PUB
re-publishing them to outside subscribers. A replica serves from its
``SchedulerReady`` until it goes down; the model's limits are the first
ready replica's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from radixrt.config import ServerConfig
from radixrt.protocol import (
    ErrorCode,
    ErrorReply,
    KVEventBatch,
    KVSnapshot,
    SchedulerReady,
    decode,
    encode,
)
from radixrt.server.common import push, replica_name
from radixrt.server.front_api import RequestError
from radixrt.server.routing import Replica, Router
from radixrt.server.spawn_args import Addresses


class ReplicaSet:
    def __init__(self, ctx: zmq.Context, server: ServerConfig, addrs: Addresses) -> None:
        self.replicas = [Replica(i, push(ctx, a)) for i, a in enumerate(addrs.schedulers)]
        self.router = Router(server, self.replicas)
        self.events_in, self.events_out = kv_event_sockets(ctx, addrs, server)
        self.limits: dict[str, Any] = {}  # the model's, from the first ready replica

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    @property
    def up(self) -> list[Replica]:
        return self.router.up

    @property
    def all_up(self) -> bool:
        return all(r.up for r in self.replicas)

    def on_up(self, msg: SchedulerReady) -> None:
        replica = self.replicas[msg.replica]
        replica.up, replica.info = True, msg.info
        replica.mirror.reset()  # a fresh process: an empty tree, events from seq 1
        self.limits = self.limits or msg.info

    def on_down(self, index: int) -> list[str]:
        """Replica ``index`` stopped serving: route around it; the rids it held (still booked;
        the caller fails and forgets each)."""
        return self.router.down(index)

    def choose(self, ids: list[int], cache_salt: str | None, routing_key: str | None) -> Replica:
        """The replica for a prompt; RequestError when none serves."""
        if not self.router.up:
            raise RequestError(ErrorCode.UNAVAILABLE, "no replica is serving", status=503)
        return self.router.choose(ids, cache_salt, routing_key)

    def send(self, rid: str, msg: msgspec.Struct) -> None:
        """Send ``msg`` to the replica running ``rid`` (nothing if it is gone)."""
        replica = self.router.replica_of(rid)
        if replica is not None and replica.up:
            replica.send(encode(msg))

    def on_kv_events(self, data: bytes) -> Replica | None:
        """A replica's event batch: forwarded to the outside subscribers, applied to its
        mirror; the replica when the mirror saw a gap and needs a snapshot."""
        if self.events_out is not None:
            self.events_out.send(data)
        batch = decode(data)
        if not isinstance(batch, KVEventBatch) or not 0 <= batch.replica < len(self.replicas):
            return None
        replica = self.replicas[batch.replica]
        return replica if replica.up and replica.mirror.on_batch(batch) else None

    def on_snapshot(self, replica: Replica, result: dict | ErrorReply) -> None:
        """The answer to a ``kv_snapshot`` request: the replica's whole tree, into its mirror."""
        if isinstance(result, dict) and replica.up:
            replica.mirror.on_snapshot(msgspec.convert(result["snapshot"], KVSnapshot))

    def pids(self) -> dict[str, int]:
        """The scheduler pid of each replica that serves, by process name."""
        return {replica_name(r.index): r.info["scheduler_pid"] for r in self.replicas if r.up}

    def views(self) -> list[dict]:
        """What the front knows of each replica, for the metrics."""
        return [
            {
                "replica": r.index,
                "up": r.up,
                "routed": r.routed,
                "waiting_tokens": r.waiting_tokens,
                "mirror_tokens": r.mirror.tree.num_tokens,
            }
            for r in self.replicas
        ]


def kv_event_sockets(
    ctx: zmq.Context, addrs: Addresses, server: ServerConfig
) -> tuple[zmq.Socket | None, zmq.Socket | None]:
    """(a SUB connected to every replica's KV events, a PUB re-publishing them on
    ``kv_events_endpoint``); None where not wanted."""
    sub = pub = None
    if addrs.kv_events:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for addr in addrs.kv_events:
            sub.connect(addr)
    if server.kv_events_endpoint is not None:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(server.kv_events_endpoint)
    return sub, pub
