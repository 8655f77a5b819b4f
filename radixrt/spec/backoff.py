"""When a request drafts: its acceptance so far, and an exponential back-off when it is low.

Contract (``Backoff``, one per request):
- ``take_turn()``: whether the request drafts this step; False while it waits out a pause
  (each call spends one step of it).
- ``record(drafted, accepted)``: a verified round's outcome. A round is low when it accepts
  fewer than ``max(1, LOW_ACCEPTANCE * drafted)`` tokens; after ``LOW_ROUNDS`` low rounds in
  a row the request pauses for ``2**level`` steps and ``level`` grows (up to ``MAX_LEVEL``);
  a round that is not low resets the count and the level (text that copies again after an
  edit drafts at once; ``p`` and the cost rule keep the next drafts short). A step whose
  proposer found nothing is no round: it verified nothing and cost only the look-up, so the
  request asks again next step (text that starts repeating is drafted at once).
- ``p``: the chance that the request's next draft token is accepted once the ones before it
  were, an exponential moving average over the draft tokens its rounds examined (each
  accepted one a 1, the first refused one a 0; ``PRIOR`` before any). The scheduler's cost
  rule drafts ``tokens_worth(price, cap)`` tokens: the j-th is worth its chance ``p**j``,
  against the ``price`` of one more row in the step (``radixrt.scheduler.speculative``).
  Each step without a round (``take_turn``) moves ``p`` ``DRIFT`` of the way back up toward
  ``PRIOR``, so a request the cost rule stopped drafting for low acceptance tries again now
  and then: text that starts repeating late is still drafted, and text that never does
  costs one short round every few steps.
"""

from __future__ import annotations

import math

LOW_ACCEPTANCE = 0.25
LOW_ROUNDS = 2
MAX_LEVEL = 7  # the longest pause: 2**7 steps
PRIOR = 0.6
EMA = 0.2  # weight of the newest draft token
DRIFT = 0.05


class Backoff:
    __slots__ = ("p", "level", "low", "wait")

    def __init__(self) -> None:
        self.p = PRIOR
        self.low = 0  # low rounds in a row
        self.level = 0
        self.wait = 0  # steps left without drafting

    def take_turn(self) -> bool:
        if self.p < PRIOR:
            self.p += DRIFT * (PRIOR - self.p)
        if self.wait:
            self.wait -= 1
            return False
        return True

    def tokens_worth(self, price: float, cap: int) -> int:
        """How many draft tokens (at most ``cap``) have a chance ``p**j`` above ``price``."""
        if price <= 0 or self.p >= 1:
            return cap
        if price >= 1 or self.p <= 0:
            return 0
        # p**j > price  <=>  j < log(price) / log(p); the bound itself is not worth it
        bound = math.log(price) / math.log(self.p)
        return max(0, min(cap, math.ceil(bound) - 1))

    def record(self, drafted: int, accepted: int) -> None:
        """A round that verified ``drafted`` tokens on its longest branch, ``accepted`` of them."""
        for seen in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            self.p += EMA * (seen - self.p)
        if accepted >= max(1.0, LOW_ACCEPTANCE * drafted):
            self.low, self.level = 0, 0
            return
        self.low += 1
        if self.low >= LOW_ROUNDS:
            self.wait, self.low = 2**self.level, 0
            self.level = min(self.level + 1, MAX_LEVEL)
