"""When a request drafts: its acceptance so far, and an exponential back-off when it is low.

Contract (``Backoff``, one per request):
- ``take_turn()``: whether the request drafts this step; False while it waits out a pause
  (each call spends one step of it).
- ``record(drafted, accepted)``: a verified round's outcome. A round is low when it accepts
  fewer than ``max(1, LOW_ACCEPTANCE * drafted)`` tokens; after ``LOW_ROUNDS`` low rounds in
  a row the request pauses for ``2**level`` steps and ``level`` grows (up to ``MAX_LEVEL``);
  a round that is not low resets the count and lowers ``level`` by one (text where drafts
  only now and then hit stays paused long). A step whose proposer found nothing is no round: it
  verified nothing and cost only the look-up, so the request asks again next step (text
  that starts repeating is drafted at once).
- ``expected``: the accepted draft tokens a round of this request is expected to give, an
  exponential moving average of its rounds (``PRIOR`` before any), for the scheduler's
  cost rule (``radixrt.scheduler.speculative``). Each step without a round (``take_turn``)
  moves it ``DRIFT`` of the way back up toward ``PRIOR``, so a request the cost rule
  stopped drafting for low acceptance tries again now and then: text that starts repeating
  late is still drafted, and text that never does costs one round every few steps.
"""

from __future__ import annotations

LOW_ACCEPTANCE = 0.25
LOW_ROUNDS = 2
MAX_LEVEL = 7  # the longest pause: 2**7 steps
PRIOR = 3.0
EMA = 0.3  # weight of the newest round
DRIFT = 0.05


class Backoff:
    __slots__ = ("expected", "level", "low", "wait")

    def __init__(self) -> None:
        self.expected = PRIOR
        self.low = 0  # low rounds in a row
        self.level = 0
        self.wait = 0  # steps left without drafting

    def take_turn(self) -> bool:
        if self.expected < PRIOR:
            self.expected += DRIFT * (PRIOR - self.expected)
        if self.wait:
            self.wait -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.expected = (1 - EMA) * self.expected + EMA * accepted
        if accepted >= max(1.0, LOW_ACCEPTANCE * drafted):
            self.low, self.level = 0, max(self.level - 1, 0)
            return
        self.low += 1
        if self.low >= LOW_ROUNDS:
            self.wait, self.low = 2**self.level, 0
            self.level = min(self.level + 1, MAX_LEVEL)
