"""The front's table of requests in flight.

Each request has a server rid (``"0"``, ``"1"``, ...), the client that asked
(a ZeroMQ identity, or an HTTP handler's identity with a sink), the client's
own ``req_id``, and a route (the replica running it, booked in the
``Router``). A client's ``req_id`` is unique among its requests in flight.
Every request leaves the table through ``forget``, which also ends its route.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time

from radixrt.server.routing import Replica, Router


class ClientReq:
    """One request in flight: who asked, and what it has produced so far."""

    __slots__ = (
        "identity",
        "req_id",
        "stream",
        "texts",
        "token_ids",
        "logprobs",
        "sink",
        "index",
        "arrived",
        "last_token_at",
        "generated",
    )

    def __init__(
        self,
        identity: bytes,
        req_id: str,
        stream: bool,
        sink: asyncio.Queue | None = None,
        index: int = 0,
    ) -> None:
        self.identity, self.req_id, self.stream = identity, req_id, stream
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None
        self.sink, self.index = sink, index  # HTTP: the handler's queue, and this choice's index
        self.arrived = time.monotonic()
        self.last_token_at: float | None = None
        self.generated = 0


class RequestTable:
    """Requests in flight by rid, by (client, req_id), and counted per client."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.reqs: dict[str, ClientReq] = {}  # server rid -> state
        self.rids: dict[tuple[bytes, str], str] = {}  # (identity, req_id) -> rid
        self.counts: collections.Counter[bytes] = collections.Counter()  # identity -> requests
        self.next_rid = itertools.count()

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, st: ClientReq, replica: Replica, ids: list[int], cache_salt: str | None) -> str:
        """Book a request sent to ``replica``; its new rid."""
        rid = str(next(self.next_rid))
        self.rids[(st.identity, st.req_id)] = rid
        self.reqs[rid] = st
        self.counts[st.identity] += 1
        self.router.routed(rid, replica, ids, cache_salt)
        return rid

    def get(self, rid: str) -> ClientReq | None:
        return self.reqs.get(rid)

    def rid_of(self, identity: bytes, req_id: str) -> str | None:
        """The rid of client ``identity``'s request ``req_id`` while in flight."""
        return self.rids.get((identity, req_id))

    def rids_of(self, identity: bytes) -> list[str]:
        return [rid for (ident, _), rid in self.rids.items() if ident == identity]

    def all_rids(self) -> list[str]:
        return list(self.reqs)

    def in_flight(self, identity: bytes) -> int:
        """How many requests client ``identity`` has in flight."""
        return self.counts[identity]

    def rpc_clients(self) -> set[bytes]:
        """The ZeroMQ clients with requests in flight (HTTP requests have a sink)."""
        return {st.identity for st in self.reqs.values() if st.sink is None}

    def replica_of(self, rid: str) -> Replica | None:
        """The replica a request in flight was sent to."""
        return self.router.replica_of(rid)

    def started(self, rid: str) -> None:
        """The request produced output: its prefill is done (see ``Router.started``)."""
        self.router.started(rid)

    def forget(self, rid: str) -> ClientReq | None:
        """Remove a request (finished, failed or aborted) and end its route; its state, or
        None if it was not in flight."""
        st = self.reqs.pop(rid, None)
        self.router.finished(rid)
        if st is not None:
            self.rids.pop((st.identity, st.req_id), None)
            self.counts[st.identity] -= 1
            if not self.counts[st.identity]:
                del self.counts[st.identity]
        return st
