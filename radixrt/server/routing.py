"""Which data-parallel replica a request goes to, and what the front knows of each.

``Replica``: one scheduler process as the front sees it: its socket, whether
it serves (``up``), its tree as a ``ReplicaMirror`` built from its KV events,
and its load: the requests routed to it, and the prompt tokens it has still
to prefill (``waiting_tokens``: each request's prompt less the prefix it was
expected to hit, counted from routing until its first output).

``Router.choose`` applies ``load_balance_method``:
- ``round_robin``: the next replica that is up;
- ``shortest_queue``: the fewest waiting tokens (then requests in flight);
- ``cache_aware``: when the load is out of balance (the most loaded replica
  waits on more than ``balance_abs_threshold`` tokens more than the least
  loaded, and more than ``balance_rel_threshold`` times as many), the least
  loaded; else the replica holding the longest prefix of the prompt, if it
  covers at least ``cache_threshold`` of it; else the least loaded. A
  replica's prefix is the longer of its mirror's match (exact, as of the
  last event batch applied) and the longest common prefix with a request
  routed to it that has not produced output yet (whose KV the tree gains
  once its prefill runs, before the events arrive).

A ``routing_key`` pins requests to the replica its first request went to
(kept for the latest ``PINNED_KEYS`` keys, dropped when the replica goes
down): a program's forks and a batch reach the replica holding their
parent's prefix, whatever the load.
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import numpy as np
import zmq

from radixrt.cache.mirror import ReplicaMirror
from radixrt.config import ServerConfig

PINNED_KEYS = 65536


class Route(NamedTuple):
    replica: int
    waiting_tokens: int  # counted in the replica's load until the first output
    cache_salt: str | None
    ids: np.ndarray | None  # the prompt, while it waits (for pending matches)


class Replica:
    def __init__(self, index: int, sock: zmq.Socket) -> None:
        self.index, self.sock = index, sock
        self.up = False  # until its SchedulerReady
        self.info: dict = {}
        self.mirror = ReplicaMirror(index)
        self.in_flight = 0
        self.waiting_tokens = 0
        self.pending: dict[str, Route] = {}  # rid -> route, until its first output
        self.routed = 0  # requests sent here, ever

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def load(self) -> tuple[int, int, int]:
        return (self.waiting_tokens, self.in_flight, self.index)

    def cached_len(self, ids: np.ndarray, cache_salt: str | None) -> int:
        """The longest prefix of ``ids`` this replica holds or is about to."""
        best = self.mirror.match(ids, cache_salt)
        for route in self.pending.values():
            if route.cache_salt == cache_salt and route.ids is not None:
                best = max(best, common_prefix(ids, route.ids))
        return best


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Router:
    def __init__(self, server: ServerConfig, replicas: list[Replica]) -> None:
        self.server, self.replicas = server, replicas
        self.method = server.load_balance_method
        self.routes: dict[str, Route] = {}  # rid -> route, while in flight
        self.pins: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.turn = itertools.count()

    @property
    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def choose(self, ids: list[int], cache_salt: str | None, routing_key: str | None) -> Replica:
        """The replica for a prompt (at least one must be up: see ``up``)."""
        ups = self.up
        pinned = self.pins.get(routing_key) if routing_key is not None else None
        if pinned is not None and self.replicas[pinned].up:
            self.pins.move_to_end(routing_key)
            return self.replicas[pinned]
        if len(ups) == 1:
            chosen = ups[0]
        elif self.method == "round_robin":
            chosen = ups[next(self.turn) % len(ups)]
        elif self.method == "shortest_queue":
            chosen = min(ups, key=Replica.load)
        else:
            chosen = self.cache_aware(ups, np.asarray(ids, dtype=np.int64), cache_salt)
        if routing_key is not None:
            self.pins[routing_key] = chosen.index
            if len(self.pins) > PINNED_KEYS:
                self.pins.popitem(last=False)
        return chosen

    def cache_aware(self, ups: list[Replica], ids: np.ndarray, cache_salt: str | None) -> Replica:
        least = min(ups, key=Replica.load)
        most = max(r.waiting_tokens for r in ups)
        low = least.waiting_tokens
        s = self.server
        if most - low > s.balance_abs_threshold and most > s.balance_rel_threshold * low:
            return least
        hits = [(r.cached_len(ids, cache_salt), r) for r in ups]
        hit, best = max(hits, key=lambda h: (h[0], [-x for x in h[1].load()]))
        return best if hit and hit >= s.cache_threshold * len(ids) else least

    def routed(self, rid: str, replica: Replica, ids: list[int], cache_salt: str | None) -> None:
        """Book a request sent to ``replica`` (with one replica, its load only: nothing else
        is chosen from)."""
        if len(self.replicas) == 1:
            route = Route(replica.index, len(ids), cache_salt, None)
        else:
            arr = np.asarray(ids, dtype=np.int64)
            route = Route(
                replica.index, len(ids) - replica.cached_len(arr, cache_salt), cache_salt, arr
            )
        waiting = route.waiting_tokens
        self.routes[rid] = route
        replica.pending[rid] = route
        replica.in_flight += 1
        replica.waiting_tokens += waiting
        replica.routed += 1

    def started(self, rid: str) -> None:
        """The request produced its first output: its prefill is done."""
        route = self.routes.get(rid)
        if route is None:
            return
        replica = self.replicas[route.replica]
        if replica.pending.pop(rid, None) is None:
            return
        replica.waiting_tokens -= route.waiting_tokens
        self.routes[rid] = route._replace(waiting_tokens=0, ids=None)

    def finished(self, rid: str) -> Replica | None:
        """The request left (finished, failed or aborted); the replica it ran on."""
        self.started(rid)
        route = self.routes.pop(rid, None)
        if route is None:
            return None
        replica = self.replicas[route.replica]
        replica.in_flight -= 1
        return replica

    def replica_of(self, rid: str) -> Replica | None:
        route = self.routes.get(rid)
        return None if route is None else self.replicas[route.replica]

    def down(self, index: int) -> list[str]:
        """Replica ``index`` stopped serving: the rids it held (still booked here; the caller
        fails and forgets each)."""
        replica = self.replicas[index]
        replica.up = False
        replica.mirror.reset()
        for key in [k for k, i in self.pins.items() if i == index]:
            del self.pins[key]
        return [rid for rid, route in self.routes.items() if route.replica == index]
