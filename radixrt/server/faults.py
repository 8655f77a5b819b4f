"""Test-only fault injection for the server processes.

Reachable only through the hidden ``radixrt launch --debug-faults SPEC`` flag:
the scheduler and detokenizer processes read SPEC from their
``ServerConfig.debug_faults``. Without it ``parse`` returns None, nothing is
installed and the serving path carries no fault checks at all (zero cost).

SPEC is a comma-separated list of ``KIND`` or ``KIND:always``:

- ``stop_check``: the scheduler's stop-string check raises (one request fails);
- ``detokenize``: the detokenizer raises on the request's token delta (one
  request fails);
- ``forward``: the model forward raises before it runs (every request of the
  batch fails; the batch's KV slots hold garbage).

A bare KIND fires only for requests whose stop strings contain its marker
``"<fault:KIND>"`` (``forward``: for any batch holding such a request), so a
test picks the victims per request. ``KIND:always`` fires for every request
(``forward:always``: every forward pass fails). Examples::

    --debug-faults stop_check,detokenize,forward
    --debug-faults forward:always

An unknown kind or mode raises ``ValueError`` at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixrt.output import Detokenizer
    from radixrt.scheduler.scheduler import Scheduler

KINDS = ("stop_check", "detokenize", "forward")
MODES = ("marker", "always")


class InjectedFault(RuntimeError):
    """The exception every injected fault raises."""


def marker(kind: str) -> str:
    """The stop string that arms ``kind`` for one request."""
    return f"<fault:{kind}>"


@dataclass(frozen=True, slots=True)
class Faults:
    armed: dict[str, str]  # kind -> mode

    def fires(self, kind: str, stop: list[str] | None) -> bool:
        """Whether ``kind`` fires for a request with stop strings ``stop``."""
        mode = self.armed.get(kind)
        if mode is None:
            return False
        return mode == "always" or marker(kind) in (stop or ())

    def check(self, kind: str, rid: str, stop: list[str] | None) -> None:
        if self.fires(kind, stop):
            raise InjectedFault(f"injected {kind} fault (request {rid})")


def parse(spec: str | None) -> Faults | None:
    """The armed faults of SPEC (see the module docstring); None for None or ""."""
    if not spec:
        return None
    armed = {}
    for item in spec.split(","):
        kind, _, mode = item.strip().partition(":")
        mode = mode or "marker"
        if kind not in KINDS or mode not in MODES:
            raise ValueError(
                f"bad --debug-faults item {item!r}: expected KIND or KIND:always "
                f"with KIND one of {', '.join(KINDS)}"
            )
        armed[kind] = mode
    return Faults(armed)


def install_in_scheduler(scheduler: Scheduler, faults: Faults) -> None:
    """Arm the scheduler-side faults by wrapping (on this instance only) the hooks they hit."""
    if "forward" in faults.armed:
        scheduler.runner = _FaultyRunner(scheduler, faults)
    if "stop_check" in faults.armed:
        hit_stop_string = scheduler._hit_stop_string

        def checked(req) -> bool:
            faults.check("stop_check", req.rid, req.params.stop)
            return hit_stop_string(req)

        scheduler._hit_stop_string = checked


def install_in_detokenizer(detok: Detokenizer, faults: Faults) -> None:
    if "detokenize" not in faults.armed:
        return
    delta = detok.delta

    def checked(item):
        st = detok.states.get(item.rid)
        faults.check("detokenize", item.rid, item.stop if st is None else st.stop)
        return delta(item)

    detok.delta = checked


class _FaultyRunner:
    """The scheduler's runner, whose forward raises for a batch holding an armed request."""

    def __init__(self, scheduler: Scheduler, faults: Faults) -> None:
        self._runner, self._scheduler, self._faults = scheduler.runner, scheduler, faults

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def forward(self, batch):
        rows = set(batch.req_rows.tolist())
        for req in self._scheduler.kv.running.values():
            if req.row in rows:
                self._faults.check("forward", req.rid, req.params.stop)
        return self._runner.forward(batch)
