"""The scheduler loop: schedule → forward → process output.

One ``step()`` runs one model forward:
- a prefill (extend) batch when waiting requests can be admitted (or a chunked
  prompt continues), which also carries every running request's next token (a
  mixed step; not with ``disable_mixed_chunk``), otherwise
- a decode batch of every running request (continuous batching).
A step's prompt tokens are bounded by the token budgets (``max_prefill_tokens``,
``chunked_prefill_size``) and by time: ``max_prefill_step_ms``, converted to tokens
with what steps cost on this machine (``step_cost``, measured at start and as it
runs), and where a waiting prompt arrived after some running requests were streaming,
``ITL_FACTOR`` times those streams' decode step, so their inter-token latency stays
bounded during a burst of prompts (a burst's own members do not hold up its prefill).
A prompt the budget cannot take whole is chunked, and a request's first token is
sampled in the step that completes its own prompt.
Admission is also bounded by ``max_running_requests`` and the KV
that running requests are still expected to need. When decode runs out of KV
it evicts, then retracts the requests with the fewest generated tokens; they
re-queue and resume from the tree.

Fault isolation: an exception from the forward pass (runner, backend, prompt
logprobs) finishes every request of that batch with reason "error" (message
in ``Req.error``), but for the running requests riding along in a mixed step,
which decode again next step; the slots allocated for the failed batch are freed, never
cached, and ``forward_failures`` counts consecutive failures (reset by the
next good forward) so the caller can give up. An exception while finishing
one request's step (e.g. its stop-string check) fails only that request;
one from the batched sampler fails the requests it was sampling for.
Either way the failed requests' earlier, good KV goes to the tree as on abort.

Structured outputs: a request with a constraint waits in ``GrammarWait`` until its grammar
is compiled (off this loop), then queues as any other; one whose grammar fails finishes with
"error" (``error_code`` "invalid_grammar"). Each step, the constrained rows' disallowed tokens
are masked before sampling (the other rows are not touched), the sampled token advances the
request's matcher, and a grammar that terminates finishes the request with "stop". A
constrained request's draft holds only tokens its grammar takes, and each of its
verification rows is masked as decoding would mask that position, so speculation changes
neither its tokens nor where its grammar ends it.

Embedding requests (``Req.pooling``) are prompts that sample nothing: a step that computes
rows they pool runs ``runner.forward_hidden``, which also returns the final hidden state of
those rows, and such a request pools them as its prompt completes, then leaves like any
finished prefill (its KV cached).

The scheduler is independent of how requests arrive: ``radixrt.Engine`` calls
it in-process; the server runs the same loop behind sockets.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable

import torch

from radixrt.attention.base import ForwardMode
from radixrt.cache.hicache import HierarchicalCache
from radixrt.cache.radix_cache import common_prefix_len
from radixrt.config import EngineConfig
from radixrt.grammar import GrammarCompiler, mask_branch_logits, mask_logits
from radixrt.sampling import Sampler, topk_logprobs
from radixrt.scheduler.batch import DraftRows, ScheduledBatch
from radixrt.scheduler.grammar_wait import GrammarWait
from radixrt.scheduler.policy import order_waiting
from radixrt.scheduler.req import Req, ReqState
from radixrt.scheduler.speculative import make_speculator
from radixrt.scheduler.step_cost import StepCost, attention_pairs, for_runner
from radixrt.scheduler.swa_kv import kv_manager
from radixrt.spec.verify import Verdict, verify

# A waiting request sharing at least this many more tokens with a request admitted
# in the same round than it hits in the tree waits one round (in-batch prefix caching).
DEDUP_MIN_TOKENS = 32
# A step's first prompt computes at least this many tokens, whatever the time budget says ...
MIN_PREFILL_TOKENS = 64
# ... and at least this many in a step held to ITL_FACTOR times streaming requests' decode step.
MIN_CAPPED_TOKENS = 16
# A mixed step takes at most this many times the decode step of the streams a prompt interrupts.
ITL_FACTOR = 4.0
# A prompt's chunk takes its rest too where the rest is at most this share of the chunk.
TAIL_FRACTION = 0.25
GRAMMAR_POLL_S = 0.005  # how long an otherwise idle step waits for a grammar to compile


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner,
        decode_fn: Callable[[list[int]], str],
        max_context: int,
        grammars: GrammarCompiler | None = None,
        hicache: HierarchicalCache | None = None,
        step_cost: StepCost | None = None,
    ) -> None:
        """``step_cost``: what steps cost (None: measured on ``runner`` by
        ``step_cost.for_runner``)."""
        self.config = config
        self.runner = runner
        self.decode_fn = decode_fn
        self.max_context = max_context
        self.kv = kv_manager(runner.pool, config, hicache)
        self.cost = step_cost or for_runner(runner, config, max_context)
        self.spec = make_speculator(config, self.kv, self.cost, runner.pool, max_context)
        self.sampler = Sampler(config.seed)
        self.waiting: list[Req] = []
        self.compiling = GrammarWait(grammars)  # constrained requests until their grammar is ready
        self.decoding: list[Req] = []
        self.chunked: Req | None = None
        self.stats: Counter[str] = Counter()
        self.forward_failures = 0  # consecutive failed forward passes
        self.last_forward_error: str | None = None

    # ------------------------------------------------------------ requests

    def add_request(self, req: Req, arrived_at: float | None = None) -> None:
        """Queue req; ``arrived_at``: when it reached the server (``time.monotonic()``, the
        same clock in every process of the machine), if before now: a request that came while
        a step ran is taken after that step, but arrived before the tokens the step made."""
        now = time.monotonic()
        req.queued_at = now if arrived_at is None else min(arrived_at, now)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(req.prompt_ids)
        if req.params.constraint is not None and req.matcher is None:
            self.compiling.add(req)
        else:
            self.waiting.append(req)  # max_new_tokens == 0: prefill (and cache) only

    def abort(self, rid: str) -> Req:
        """Finish request ``rid`` with reason "abort"; raises KeyError if unknown."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish(req, "abort")
        req = self.compiling.remove(rid)
        if req is not None:
            return self._finish(req, "abort")
        req = self.kv.running.get(rid)
        if req is None:
            raise KeyError(f"unknown request id {rid!r}")
        if req is self.chunked:
            self.chunked = None
        return self._finish(req, "abort")

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.decoding or self.chunked or self.compiling)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; False (and nothing dropped) unless idle with no KV held."""
        if not self.idle or self.kv.running:
            return False
        self.kv.flush()
        return True

    @property
    def kv_capacity(self) -> int:
        """KV slots the pool can hand out: no sequence longer than this fits."""
        return self.kv.allocator.capacity

    # ---------------------------------------------------------------- step

    def step(self) -> list[Req]:
        """Run one forward; return the requests that finished in it."""
        failed = self._take_compiled()
        batch = self._schedule()
        self._prefetch_waiting()
        if batch is None:
            if self.compiling and not failed:
                self.compiling.wait(GRAMMAR_POLL_S)
            return failed
        work, start = batch.work(), time.perf_counter()
        try:
            logits = self._forward(batch)
        except Exception as e:  # fail the batch, keep serving the rest
            return failed + self._fail_batch(batch, e)
        elapsed = time.perf_counter() - start
        self.stats["forward_s"] += elapsed
        self.stats["prefill_forward_s" if batch.prefilling else "decode_forward_s"] += elapsed
        self.forward_failures = 0
        finished = self.process_output(batch, logits)
        self.cost.observe(time.perf_counter() - start, *work, prompt=batch.prefilling)
        return failed + finished

    def _schedule(self) -> ScheduledBatch | None:
        """This step's batch: prompts to prefill (after the running requests' next tokens,
        unless ``disable_mixed_chunk``), else a decode step."""
        if self.config.disable_mixed_chunk:
            return self.schedule_prefill() or self.schedule_decode()
        decode = self.schedule_decode() if self.waiting or self.chunked else None
        prefill = self.schedule_prefill(decode)
        if prefill is None:
            return decode or self.schedule_decode()
        if decode is None:
            return prefill
        self.stats["mixed_steps"] += 1
        return ScheduledBatch(
            ForwardMode.EXTEND,
            decode.reqs + prefill.reqs,
            decode.extend_lens + prefill.extend_lens,
            decode_rows=len(decode.reqs),
            drafts=decode.drafts,
        )

    def _prefetch_waiting(self) -> None:
        """Requests left waiting have their blocks in storage read ahead, once, while this
        step's forward runs."""
        for req in self.waiting:
            if not req.prefetched:
                req.prefetched = True
                self.kv.prefetch(req)

    def _take_compiled(self) -> list[Req]:
        """Queue the requests whose grammar is ready; finish (and return) those whose grammar
        failed."""
        if not self.compiling:
            return []
        ready, failed = self.compiling.take()
        self.waiting.extend(ready)
        return [self._fail(req, why) for req, why in failed]

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[len(batch.reqs), vocab]`` of each request's last computed token, or with
        ``batch.layout`` its rows (prompt scores collected); embedding requests get the final
        hidden state of the rows they pool (``Req.hidden_rows``)."""
        hidden = batch.hidden_layout()
        fb = batch.to_forward_batch(self.runner.pool)
        if hidden is None:
            logits = self.runner.forward(fb)
        else:
            idx = torch.tensor(hidden.indices, dtype=torch.int64)
            logits, rows = self.runner.forward_hidden(fb, idx)
            rows = rows.cpu()  # pooled on the CPU, in a fixed order (``Req.pool_hidden``)
            for i, start, n in hidden.spans:
                batch.reqs[i].hidden_rows.append(rows[start : start + n])
        if batch.layout is not None:
            self._collect_prompt_logprobs(batch, logits)
        return logits

    def schedule_prefill(self, decode: ScheduledBatch | None = None) -> ScheduledBatch | None:
        """Prompts to prefill this step (the chunked one first), within the token budgets and
        the step time left beside ``decode`` (the running requests' rows of a mixed step). While
        no request decodes, a step that completes the chunked prompt holds nothing else, so
        that prompt's first token waits for no other's chunk."""
        if self.chunked is None and not self.waiting:
            return None
        budget = self._step_budget(decode)
        reqs, lens = [], []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            n = self._extend_len(req, budget, first=True)
            if self.kv.alloc(req, n) is None:
                self.chunked = req  # try again after decode frees memory
                return None
            reqs.append(req), lens.append(n)
            budget.take(self.cost, req, n)
            if n < req.fill_len - req.kv_len:
                return self._chunk(req, reqs, lens)
            if not self.decoding:  # its first token ends this step: no request decodes to wait
                return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)
        reserved = self._decode_reservation()
        for req in order_waiting(self.config.schedule_policy, self.waiting, self.kv):
            full = len(self.decoding) + len(reqs) >= self.config.running_limit
            if full or (reqs and budget.spent):  # a step's first prompt always gets a chance
                break
            if reqs and self._shares_unbuilt_prefix(req, reqs):
                continue
            future = math.ceil(req.remaining_new_tokens * self.config.new_token_ratio)
            busy = bool(reqs or self.decoding)
            n = self._admit(req, budget, future + reserved, busy=busy, first=not reqs)
            if n == 0:
                break
            reqs.append(req), lens.append(n)
            budget.take(self.cost, req, n)
            reserved += future
            if n < req.fill_len - req.kv_len:
                return self._chunk(req, reqs, lens)
        if not reqs:
            return None
        self.waiting = [r for r in self.waiting if r.row is None]
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)

    def _chunk(self, req: Req, reqs: list[Req], lens: list[int]) -> ScheduledBatch:
        """The batch ends with a chunk of req, which continues first next step."""
        self.chunked = req
        self.stats["prefill_chunks"] += 1
        self.waiting = [r for r in self.waiting if r.row is None]
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)

    def _step_budget(self, decode: ScheduledBatch | None) -> _Budget:
        """What this step has for prompt tokens: the token budget, and the cost units
        (``step_cost``) that ``max_prefill_step_ms`` buys, less the running requests' rows where
        they decode in it (infinite: no time budget). While a waiting prompt arrived after some
        of them were streaming, the step is held to ``ITL_FACTOR`` times those streams' own
        decode step (the small steps' line: what their tokens cost without the prompt), and
        its first prompt's floor is ``MIN_CAPPED_TOKENS``."""
        tokens = self.config.prefill_budget
        ms = self.config.max_prefill_step_ms
        if ms == 0 or not self.cost.known:
            return _Budget(tokens, math.inf, MIN_PREFILL_TOKENS)
        target = ms / 1e3
        if decode is None:
            return _Budget(tokens, self.cost.budget_units(target), MIN_PREFILL_TOKENS)
        streams, floor = self._interrupted(decode), MIN_PREFILL_TOKENS
        if streams is not None:
            target = min(target, ITL_FACTOR * self.cost.predict_small(*streams.work()))
            floor = MIN_CAPPED_TOKENS
        units = self.cost.budget_units(target) - self.cost.units(*decode.work())
        return _Budget(tokens, units, floor)

    def _interrupted(self, decode: ScheduledBatch) -> ScheduledBatch | None:
        """The rows of ``decode`` whose requests had their first token before a prompt waiting
        now arrived: such prompts may slow those streams by ``ITL_FACTOR`` at most, measured
        against their own decode step. Requests that started streaming after every waiting
        prompt arrived came in one burst with them: they hold up neither the burst's prefill
        nor, by their own rows, the streams before it (None: no such rows)."""
        prompts = self.waiting + ([self.chunked] if self.chunked is not None else [])
        newest = max((r.queued_at for r in prompts if r.queued_at is not None), default=None)
        rows = [
            i
            for i, r in enumerate(decode.reqs)
            if r.first_token_at is not None and (newest is None or r.first_token_at < newest)
        ]
        if not rows:
            return None
        return ScheduledBatch(
            decode.mode,
            [decode.reqs[i] for i in rows],
            [decode.extend_lens[i] for i in rows],
            decode_rows=len(rows) if decode.decode_rows else 0,
            drafts={k: decode.drafts[i] for k, i in enumerate(rows) if i in decode.drafts},
        )

    def _admit(self, req: Req, budget: _Budget, reserve: int, busy: bool, first: bool) -> int:
        """Give req a row, its cached prefix and slots for its next extend; 0 if it can't run
        now."""
        if not self.kv.admit(req):
            return 0
        n = self._extend_len(req, budget, first)
        whole = req.fill_len - req.kv_len
        too_big = n < whole and not self._chunks and busy
        if (
            n == 0
            or too_big
            or (busy and n + reserve > self.kv.free_for_new())
            or self.kv.alloc(req, n) is None
        ):
            self.kv.release(req)
            return 0
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = req.prefix_len
            req.cached_below = req.loaded_tokens
            self.stats["cached_tokens"] += req.prefix_len
        req.state = ReqState.RUNNING
        return n

    @property
    def _chunks(self) -> bool:
        """Whether a prompt may be split over steps (a chunk size or a step time is set)."""
        return self.config.chunked_prefill_size is not None or self.config.max_prefill_step_ms > 0

    def _extend_len(self, req: Req, budget: _Budget, first: bool) -> int:
        """Tokens of req to compute now: everything, or what the budgets leave when chunking
        applies (at least the budget's floor for a step's first prompt). A prompt whose
        rest after the time budget's chunk is at most ``TAIL_FRACTION`` of that chunk is taken
        whole, so its first token does not wait a step for a short tail; the token budgets
        stay hard caps."""
        n = whole = req.fill_len - req.kv_len
        if self.config.max_prefill_step_ms > 0:
            fits = self.cost.prefill_tokens(budget.units, req.kv_len)
            floor = min(budget.floor, self.config.prefill_budget) if first else 0
            n = max(fits, floor)
            if whole - n <= n * TAIL_FRACTION:
                n = whole
        if self.config.chunked_prefill_size is not None:
            n = min(n, max(budget.tokens, 1))
        return min(n, whole)

    def _shares_unbuilt_prefix(self, req: Req, admitted: list[Req]) -> bool:
        """True if req would hit much more of the tree once an admitted request's prompt is in
        it."""
        if self.kv.disabled:
            return False
        ids, salt = req.fill_ids, req.params.cache_salt
        # Only a same-salt request's prompt lands in req's namespace of the tree.
        shared = max(
            (common_prefix_len(ids, r.prompt_ids) for r in admitted if r.params.cache_salt == salt),
            default=0,
        )
        shared = min(shared, req.match_limit)  # e.g. a mean-pooled embedding hits nothing
        return shared - self.kv.prefix_len_hint(req) >= DEDUP_MIN_TOKENS

    def _decode_reservation(self) -> int:
        ratio = self.config.new_token_ratio
        return sum(math.ceil(r.remaining_new_tokens * ratio) for r in self.decoding)

    def schedule_decode(self) -> ScheduledBatch | None:
        if not self.decoding:
            return None
        self._make_room_for_decode()
        for req in list(self.decoding):
            if self.kv.alloc(req, 1) is None:  # a lone request longer than the whole pool
                self._finish(req, "length")
        if not self.decoding:
            return None
        drafts = self.spec.plan(self.decoding, reserved_rows=len(self.waiting))
        if not drafts:
            return ScheduledBatch(ForwardMode.DECODE, list(self.decoding), [1] * len(self.decoding))
        plain = [r for r in self.decoding if r.rid not in drafts]
        drafted = [r for r in self.decoding if r.rid in drafts]
        return ScheduledBatch(
            ForwardMode.EXTEND,
            plain + drafted,
            [1] * len(self.decoding),
            decode_rows=len(self.decoding),
            drafts={len(plain) + j: drafts[r.rid] for j, r in enumerate(drafted)},
        )

    def _make_room_for_decode(self) -> None:
        """Evict, then retract (fewest generated tokens first) until every decoder gets a slot."""
        p = self.kv.page_size
        while True:
            need = sum(p for r in self.decoding if r.kv_len % p == 0)
            if need <= self.kv.free_for_new() or len(self.decoding) == 1:
                return
            victim = min(self.decoding, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        self.decoding.remove(req)
        self.kv.release(req)
        req.state = ReqState.WAITING
        req.num_retractions += 1
        # Its prefix match stops before logprob_start_len, so the re-extend scores the prompt anew.
        req.prompt_logprobs.clear()
        req.prompt_top_logprobs.clear()
        self.stats["retractions"] += 1
        self.waiting.insert(0, req)

    # -------------------------------------------------------------- output

    def _collect_prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Append scored prompt tokens' logprobs (and top logprobs) to their requests."""
        spans = batch.layout.spans
        for req, (start, targets) in zip(batch.reqs, spans):
            if targets:
                rows = logits[start : start + len(targets)]
                tgt = torch.tensor(targets, dtype=torch.int64, device=rows.device)
                logp = torch.log_softmax(rows.float(), dim=-1)
                req.prompt_logprobs.extend(logp.gather(1, tgt[:, None])[:, 0].tolist())
                top = topk_logprobs(logp, req.params.top_logprobs)
                if top is not None:
                    req.prompt_top_logprobs.extend(zip(top[0].tolist(), top[1].tolist()))

    def process_output(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Req]:
        rows, to_sample, finished = [], [], []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if i in batch.drafts:
                continue  # its KV grows by what verification accepts
            req.kv_len += n
            if batch.prefills(i):
                self.stats["prefill_tokens"] += n
                self.kv.cache_computed(req)
            self.kv.advanced(req)
            if req.kv_len == req.fill_len and not req.finished:
                if req.prefill_only:
                    if req.pooling is not None:
                        req.pool_hidden()
                    finished.append(self._finish(req, "length"))
                    continue
                rows.append(i), to_sample.append(req)
        self.stats["prefill_steps" if batch.prefilling else "decode_steps"] += 1
        finished += self._sample(batch, logits, rows, to_sample)
        return finished + self._verify_drafts(batch, logits)

    def _sample(
        self, batch: ScheduledBatch, logits: torch.Tensor, rows: list[int], reqs: list[Req]
    ) -> list[Req]:
        """Sample the next token of each of ``reqs`` (batch.reqs[rows[j]] is reqs[j]) and book
        it; the requests that finished."""
        if not reqs:
            return []
        try:
            at = rows if batch.layout is None else [batch.layout.last_rows[i] for i in rows]
            # a decode step: no copy of [B, vocab] logits
            logits = logits if at == list(range(logits.shape[0])) else logits[at]
            self._mask_constrained(reqs, logits)
            out = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        except Exception as e:  # their KV is computed and good; only this step's tokens are lost
            return [self._fail(r, f"sampling failed: {e!r}") for r in reqs]
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top = [t.tolist() for t in out.top_logprobs] if out.top_logprobs is not None else None
        now, finished = time.monotonic(), []
        for j, req in enumerate(reqs):
            if not req.output_ids:
                req.first_token_at = now
            k = req.params.top_logprobs
            try:
                reason = self._book(
                    req,
                    token_ids[j],
                    logprobs[j] if logprobs is not None else None,
                    (top[0][j][:k], top[1][j][:k]) if k else None,
                )
            except Exception as e:  # this request's fault only
                finished.append(self._fail(req, f"finishing a step failed: {e!r}"))
                continue
            if reason is not None:
                finished.append(self._finish(req, reason))
            elif batch.prefills(rows[j]):
                self.decoding.append(req)
        return finished

    def _book(
        self, req: Req, token: int, logprob: float | None, top: tuple[list, list] | None
    ) -> str | None:
        """Append a sampled token (and its logprob, top logprobs) to req; its finish reason
        (None: it goes on). Raises if its grammar refuses the token or the check fails."""
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        if top is not None:
            req.output_top_logprobs.append(top)
        self.stats["output_tokens"] += 1
        if req.matcher is not None and not req.matcher.accept(token):
            raise RuntimeError(f"its grammar does not take token {token}")
        return self._finish_reason(req)

    def _verify_drafts(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Req]:
        """Accept what each drafted request's rows confirm (``radixrt.spec.verify``; the rows
        of a request with a grammar masked first), book the tokens one by one as decoding
        would, stopping where the request finishes, and settle its KV; the requests that
        finished."""
        finished, mask_error = [], self._mask_drafts(batch, logits)
        for i, draft in batch.drafts.items():
            req, start = batch.reqs[i], batch.layout.draft_rows[i]
            rows = logits[start : start + sum(draft.lens())]
            try:
                if mask_error is not None and req.matcher is not None:
                    raise mask_error
                gen = None if req.params.greedy else self.spec.generator(req)
                verdict = verify(self.sampler, rows, draft.tokens, req.params, gen)
            except Exception as e:  # the last token's KV is computed and good
                self.spec.settle(req, draft, 0, 1)
                finished.append(self._fail(req, f"sampling failed: {e!r}"))
                continue
            m, reason, error = self._book_verdict(req, verdict)
            self.spec.settle(req, draft, verdict.branch, m)
            self.kv.advanced(req)
            self._count_verified(req, draft, len(verdict.tokens) - 1, m)
            if error is not None:
                finished.append(self._fail(req, f"finishing a step failed: {error!r}"))
            elif reason is not None:
                finished.append(self._finish(req, reason))
        return finished

    def _mask_drafts(self, batch: ScheduledBatch, logits: torch.Tensor) -> Exception | None:
        """Mask every drafted request's rows that has a grammar, in one application: row t of
        a branch allows what its matcher allows after the branch's first t tokens, the mask
        decoding would apply at that position. The exception that stopped it, if any."""
        starts, matchers, branches = [], [], []
        for i, draft in batch.drafts.items():
            req, start = batch.reqs[i], batch.layout.draft_rows[i]
            if req.matcher is None:
                continue
            for tokens, n in zip(draft.tokens, draft.lens()):
                starts.append(start), matchers.append(req.matcher), branches.append(tokens)
                start += n
        if not starts:
            return None
        began = time.perf_counter()
        try:
            masked = mask_branch_logits(logits, starts, matchers, branches)
        except Exception as e:  # fails the constrained drafted requests only
            return e
        self.stats["grammar_mask_s"] += time.perf_counter() - began
        self.stats["grammar_masked_rows"] += masked
        return None

    def _book_verdict(self, req: Req, verdict: Verdict) -> tuple[int, str | None, Exception | None]:
        """Book the verdict's tokens until req finishes: (tokens booked, finish reason, the
        exception that failed it)."""
        lp, top = verdict.logprobs, verdict.top_logprobs
        for t, token in enumerate(verdict.tokens):
            try:
                reason = self._book(req, token, lp[t] if lp else None, top[t] if top else None)
            except Exception as e:  # this request's fault only
                return t + 1, None, e
            if reason is not None:
                return t + 1, reason, None
        return len(verdict.tokens), None, None

    def _count_verified(self, req: Req, draft: DraftRows, accepted: int, booked: int) -> None:
        drafted = sum(len(t) for t in draft.tokens)
        req.spec_backoff.record(max(len(t) for t in draft.tokens), accepted)
        req.spec_verify_ct += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += min(accepted, booked)
        self.stats["spec_verify_ct"] += 1
        self.stats["spec_draft_tokens"] += drafted
        self.stats["spec_accepted_tokens"] += min(accepted, booked)

    def _mask_constrained(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Mask the tokens each constrained request's grammar does not allow next (logits
        [len(reqs), V]: row j is reqs[j]'s)."""
        rows = [j for j, r in enumerate(reqs) if r.matcher is not None]
        if rows:
            start = time.perf_counter()
            mask_logits(logits, rows, [reqs[j].matcher for j in rows])
            self.stats["grammar_mask_s"] += time.perf_counter() - start
            self.stats["grammar_masked_rows"] += len(rows)

    def _finish_reason(self, req: Req) -> str | None:
        token = req.output_ids[-1]
        if token in req.stop_ids or (req.matcher is not None and req.matcher.terminated):
            return "stop"
        if req.params.stop and self._hit_stop_string(req):
            return "stop"
        if len(req.output_ids) >= req.params.max_new_tokens or req.fill_len >= self.max_context:
            return "length"
        return None

    def _hit_stop_string(self, req: Req) -> bool:
        window = max(len(s) for s in req.params.stop) + 2
        tail = self.decode_fn(req.output_ids[-window:])
        return any(s in tail for s in req.params.stop)

    def _finish(self, req: Req, reason: str) -> Req:
        if req.row is not None:
            self.kv.release(req)
        if req in self.decoding:
            self.decoding.remove(req)
        req.state, req.finish_reason = ReqState.FINISHED, reason
        self.stats[f"finished_{reason}"] += 1
        return req

    # -------------------------------------------------------------- faults

    def _fail(self, req: Req, message: str) -> Req:
        """Finish req with reason "error"; its computed KV is released like an abort's."""
        if req is self.chunked:
            self.chunked = None
        req.error = message
        return self._finish(req, "error")

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[Req]:
        """The forward of batch raised: free the slots it allocated and fail its requests."""
        self.forward_failures += 1
        self.last_forward_error = f"{type(error).__name__}: {error}"
        self.stats["forward_failures"] += 1
        failed = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if i in batch.drafts:
                self.spec.discard(req, batch.drafts[i])
            self.kv.free_uncomputed(req, n)
            if batch.prefilling and not batch.prefills(i):
                continue  # a running request's row of a mixed step: it retries next step
            failed.append(self._fail(req, f"forward pass failed: {self.last_forward_error}"))
        return failed

    # ---------------------------------------------------------------- misc

    def check_memory(self) -> None:
        self.kv.check(idle=self.idle)

    def get_stats(self) -> dict[str, float]:
        s = dict(self.stats)
        tree = self.kv.tree
        s.update(
            evicted_tokens=self.kv.evicted_tokens,
            cache_tokens=tree.total_size(),
            evictable_tokens=tree.evictable_size,
            protected_tokens=tree.protected_size,
            free_slots=self.kv.allocator.available,
            running=len(self.kv.running),
            waiting=len(self.waiting),
            waiting_tokens=sum(len(r.prompt_ids) for r in self.waiting),
            **self.cost.describe(),
        )
        if self.kv.hicache is not None:
            s.update(self.kv.hicache.get_stats())
        if self.spec.describe()["speculative_algorithm"] is not None:
            for key in ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens"):
                s.setdefault(key, 0)
        s.update(self.kv.stats())
        prompt = s.get("prompt_tokens", 0)
        s["hit_rate"] = s.get("cached_tokens", 0) / prompt if prompt else 0.0
        return s


class _Budget:
    """What a step has left for prompt tokens: ``tokens`` (``max_prefill_tokens``, the chunk
    size) and cost ``units`` (its time, ``step_cost``)."""

    def __init__(self, tokens: int, units: float, floor: int) -> None:
        self.tokens, self.units = tokens, units
        self.floor = floor  # the step's first prompt computes at least this many tokens

    def take(self, cost: StepCost, req: Req, n: int) -> None:
        """req computes n tokens after its kv_len."""
        self.tokens -= n
        self.units -= cost.units(n, attention_pairs(req.kv_len, n))

    @property
    def spent(self) -> bool:
        return self.tokens <= 0 or self.units < 1
