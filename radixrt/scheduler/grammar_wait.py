"""Requests whose output grammar is still compiling: they wait here, not in the queue.

``GrammarWait.add(req)`` starts (or finds cached) the compilation of req's constraint;
``take()`` hands back the requests whose grammar is ready (``req.matcher`` set: they may be
scheduled) and those whose grammar failed (finished by the caller with ``error_code``
"invalid_grammar"). ``wait(timeout)`` sleeps until one is ready, for a scheduler with nothing
else to do. The compilation runs on the compiler's threads, never on the scheduler's loop.
Compiling, matching and masking are ``radixrt.grammar``'s; this module only holds the requests.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from radixrt.grammar import GrammarCompiler, Matcher
from radixrt.protocol import ErrorCode
from radixrt.scheduler.req import Req


class GrammarWait:
    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self.pending: list[tuple[Req, Future | None]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: Req) -> None:
        c = req.params.constraint
        fut = self.compiler.submit(c) if self.compiler is not None else None
        self.pending.append((req, fut))

    def take(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests now ready, (request, why) for those whose grammar failed)."""
        ready, failed, still = [], [], []
        for req, fut in self.pending:
            if fut is None:
                failed.append((req, "structured outputs need the model's tokenizer here"))
            elif not fut.done():
                still.append((req, fut))
            elif fut.exception() is not None:
                failed.append((req, str(fut.exception())))
            else:
                req.matcher = Matcher(fut.result())
                ready.append(req)
        self.pending = still
        for req, _ in failed:
            req.error_code = ErrorCode.INVALID_GRAMMAR
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        for i, (req, _) in enumerate(self.pending):
            if req.rid == rid:
                del self.pending[i]
                return req
        return None

    def wait(self, timeout: float) -> None:
        futures = [f for _, f in self.pending if f is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)
