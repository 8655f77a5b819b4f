"""The SIGTERM drain of the front.

The launcher sends SIGUSR1 on a first SIGTERM: from then on new requests fail
with ``shutting_down`` (``Admission.check`` reads ``requested``); the running
ones may finish for ``grace_period`` seconds, after which each of them is
aborted once. When no request is in flight and every HTTP response is
written, ``Drained`` (with the number aborted) goes to the launcher.
"""

from __future__ import annotations

import time

import zmq

from radixrt.protocol import AbortRid, Drained, encode
from radixrt.server.replicas import ReplicaSet
from radixrt.server.request_table import RequestTable


class Drain:
    def __init__(
        self,
        grace_period: float,
        requests: RequestTable,
        replicas: ReplicaSet,
        launcher: zmq.Socket | None,
    ) -> None:
        self.grace_period = grace_period
        self.requests, self.replicas, self.launcher = requests, replicas, launcher
        self.requested = False
        self.open_responses = 0  # HTTP responses not yet fully written
        self.deadline: float | None = None
        self.aborted = 0
        self.done = False

    def request(self) -> None:
        """Start draining (the SIGUSR1 handler); ``step`` advances it."""
        self.requested = True

    def step(self) -> None:
        """Advance a requested drain: wait, abort what outlives the grace period, report."""
        if not self.requested or self.done:
            return
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.grace_period
        if not len(self.requests) and not self.open_responses:
            self.done = True
            if self.launcher is not None:
                self.launcher.send(encode(Drained(aborted=self.aborted)))
        elif now >= self.deadline and not self.aborted:
            rids = self.requests.all_rids()
            self.aborted = len(rids)
            for rid in rids:
                self.replicas.send(rid, AbortRid(rid=rid))
