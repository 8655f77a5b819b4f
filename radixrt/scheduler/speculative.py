"""Speculative decoding in the scheduler: which running requests draft, their slots and rows,
and what a verification keeps.

Each step, ``Speculator.plan`` prices one more row of the step for every running request that
may draft (at least two tokens left to generate, room in the context, not backing off:
``radixrt.spec.backoff``), asks the proposer for a draft as long as the cost rule finds worth
it, and gives each draft its slots and rows (``DraftRows``):
- the draft tree is pruned to that many tokens and the depth the request can still use; its
  branches are taken in rank order while their tokens add up to at most that many and a
  spare row of ``req_to_token`` is free beyond the waiting requests;
- a request with a grammar drafts only what its grammar allows: each branch is cut before
  the first token its matcher would refuse (``Matcher.accepted_prefix``; the matcher is left
  where it was), and a branch the cut leaves empty, or leaves a prefix of an earlier branch,
  is dropped;
- branch 0 runs in the request's own row, after the slot decoding gave its next token;
  every other branch runs in a spare row holding a copy of the request's slots, with a slot
  for the request's last token of its own (shared ancestors are computed once per branch).
Cost rule: a step decoding B requests emits B tokens in the time ``step_cost`` predicts for a
small step of that size (``predict_small``, fitted to this machine's decode and verification
steps). One more row for a request with L tokens of context costs what one more token
attending to L keys adds (the small steps' slope), i.e. ``price`` = that time over the
time per token the step emits. A draft's j-th token is accepted with chance ``p**j``
(``Backoff.p``), so the request drafts the tokens whose chance is above the price
(``Backoff.tokens_worth``; at most ``speculative_num_draft_tokens``): none where rows cost
as much as the tokens they may give, which is where the batch is large or acceptance low.
A step's cost that is not yet known admits every draft.

``settle`` keeps the accepted branch's first ``m`` slots as the request's next KV (copied
into its own row when the branch ran in a spare one) and frees every other slot and spare
row of the draft at once; ``discard`` frees all of them but the decoding slot (a failed
forward). Between steps no draft holds anything, so the KV invariant holds as without
speculation.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from radixrt.config import EngineConfig
from radixrt.sampling import make_generator
from radixrt.scheduler.batch import DraftRows
from radixrt.scheduler.kv import KVManager
from radixrt.scheduler.req import Req
from radixrt.scheduler.step_cost import StepCost, attention_pairs
from radixrt.spec.proposer import Proposer, make_proposer


class NoSpeculation:
    """Speculation off: no request drafts."""

    def plan(self, reqs: list[Req], reserved_rows: int = 0) -> dict[str, DraftRows]:
        return {}

    def describe(self) -> dict:
        return {"speculative_algorithm": None}


class Speculator:
    """Drafts for running requests (``plan``) and what their verification keeps (``settle``)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        cost: StepCost,
        proposer: Proposer,
        max_context: int,
    ) -> None:
        self.kv, self.cost, self.proposer = kv, cost, proposer
        self.settings = {
            name: getattr(config, name)
            for name in config.__dataclass_fields__
            if name.startswith("speculative_")
        } | {"speculative_num_draft_tokens": config.draft_tokens}
        self.max_tokens = config.draft_tokens
        self.max_context = max_context
        self._seeds = random.Random(config.seed)  # generators of unseeded sampled requests

    def describe(self) -> dict:
        """The speculative settings in force (``server_info``)."""
        return dict(self.settings)

    # --------------------------------------------------------------- planning

    def plan(self, reqs: list[Req], reserved_rows: int = 0) -> dict[str, DraftRows]:
        """Drafts (by rid) for the running ``reqs``, each of which already holds its next
        token's slot; ``reserved_rows``: spare rows to leave free (for waiting requests)."""
        drafts = {}
        price = self._pricer(reqs)
        for req in sorted(reqs, key=lambda r: -r.spec_backoff.p):
            if not self._may_draft(req):
                continue
            budget = req.spec_backoff.tokens_worth(
                price(req), min(self.max_tokens, self._depth(req))
            )
            branches = self._propose(req, budget) if budget else []
            draft = self._allocate(req, branches, reserved_rows) if branches else None
            if draft is not None:
                drafts[req.rid] = draft
        return drafts

    def _may_draft(self, req: Req) -> bool:
        return (
            req.remaining_new_tokens >= 2 and self._depth(req) >= 1 and req.spec_backoff.take_turn()
        )

    def _depth(self, req: Req) -> int:
        """Draft tokens req can use in a row: one fewer than it may still emit, in context."""
        return min(req.remaining_new_tokens - 1, self.max_context - req.fill_len - 1)

    def _propose(self, req: Req, budget: int) -> list[list[int]]:
        """The token lists of req's draft branches (cut to what its grammar allows), in rank
        order while their tokens add up to at most ``budget`` (the first always fits: the
        tree is pruned to them)."""
        tree = self.proposer.propose(req.fill_ids, req.params.cache_salt)
        tree = tree.pruned(budget, self._depth(req))
        branches = []
        for path in tree.branches():
            tokens = [tree.tokens[i] for i in path]
            if req.matcher is not None:
                tokens = tokens[: req.matcher.accepted_prefix(tokens)]
            if not tokens or any(b[: len(tokens)] == tokens for b in branches):
                continue
            if len(tokens) > budget:
                break
            branches.append(tokens)
            budget -= len(tokens)
        return branches

    def _pricer(self, reqs: list[Req]) -> Callable[[Req], float]:
        """Price of one more row for a request of ``reqs``' step: the time it adds over the
        time per token the step emits (0 while the step's cost is unknown)."""
        if not self.cost.known or not reqs:
            return lambda req: 0.0
        pairs = sum(attention_pairs(r.kv_len, 1) for r in reqs)
        per_token = self.cost.predict_small(len(reqs), pairs) / len(reqs)
        unit = self.cost.unit_seconds_small()
        return lambda req: unit * self.cost.units(1, req.kv_len + 1) / per_token

    # ------------------------------------------------------------ slots, rows

    def _allocate(
        self, req: Req, branches: list[list[int]], reserved_rows: int
    ) -> DraftRows | None:
        """Slots (and spare rows) for the leading branches that fit; None if none does."""
        table, kv_len = self.kv.pool.req_to_token, req.kv_len
        draft = DraftRows([], [], [])
        for tokens in branches:
            if draft.tokens and not self._spare_row(reserved_rows):
                break
            own = not draft.tokens
            slots = self._slots(len(tokens) + (0 if own else 1))
            if slots is None:
                break
            if own:
                row = req.row
                slots = torch.cat([table[row, kv_len : kv_len + 1], slots])
            else:
                row = self.kv.pool.alloc_row()
                table[row, :kv_len] = table[req.row, :kv_len]
            table[row, kv_len : kv_len + len(slots)] = slots
            draft.tokens.append(tokens), draft.rows.append(row), draft.slots.append(slots)
        return draft if draft.tokens else None

    def _spare_row(self, reserved_rows: int) -> bool:
        return self.kv.pool.free_rows > reserved_rows

    def _slots(self, n: int) -> torch.Tensor | None:
        """n free slots, evicting cached prefixes if needed; None if the pool has none."""
        slots = self.kv.allocator.alloc(n)
        if slots is None:
            self.kv.evict(n)
            slots = self.kv.allocator.alloc(n)
        return slots

    # ----------------------------------------------------------- after a step

    def settle(self, req: Req, draft: DraftRows, branch: int, m: int) -> None:
        """Req keeps branch ``branch``'s first m positions (its kv_len grows by m); every
        other slot and spare row of the draft is freed."""
        table, kv_len = self.kv.pool.req_to_token, req.kv_len
        kept = draft.slots[branch][:m]
        table[req.row, kv_len : kv_len + m] = kept
        freed = [s for b, s in enumerate(draft.slots) if b != branch]
        freed.append(draft.slots[branch][m:])
        self._release(draft, torch.cat(freed))
        req.kv_len += m

    def discard(self, req: Req, draft: DraftRows) -> None:
        """Free the draft's slots and spare rows; the request keeps its decoding slot."""
        self._release(draft, torch.cat([draft.slots[0][1:], *draft.slots[1:]]))

    def _release(self, draft: DraftRows, slots: torch.Tensor) -> None:
        if slots.numel():
            self.kv.allocator.free(slots.clone())
        for row in draft.rows[1:]:
            self.kv.pool.free_row(row)

    def generator(self, req: Req) -> torch.Generator:
        """The generator req's verification draws from: its own, or (unseeded) one of its
        own made from the engine's seed."""
        if req.generator is None:
            req.generator = make_generator(self._seeds.getrandbits(63))
        return req.generator


def make_speculator(
    config: EngineConfig,
    kv: KVManager,
    cost: StepCost,
    pool,
    max_context: int,
    proposer: Proposer | None = None,
) -> Speculator | NoSpeculation:
    """The scheduler's speculation (``NoSpeculation`` unless ``speculative_algorithm``);
    refuses, naming it, what it does not implement: a pool with sliding-window layers' own
    slots, a pool off the CPU. ``proposer``: the drafts' source (default: ``make_proposer``)."""
    if config.speculative_algorithm is None:
        return NoSpeculation()
    if getattr(pool, "sliding", None) is not None:
        raise ValueError(
            f"speculative_algorithm {config.speculative_algorithm}: the sliding-window layers' "
            "KV pool is not supported (set disable_hybrid_swa_memory)"
        )
    if pool.device.type != "cpu":
        raise ValueError(
            f"speculative_algorithm {config.speculative_algorithm}: runs on the CPU only, not "
            f"{pool.device} (untested there)"
        )
    proposer = proposer or make_proposer(config, None if kv.disabled else kv.tree)
    return Speculator(config, kv, cost, proposer, max_context)
