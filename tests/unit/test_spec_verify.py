"""Speculative decoding without a model: the draft tree's pruning, the own-tokens proposer, the
back-off, acceptance (``radixrt.spec.verify``), the scheduler's verification steps, and requests
with a grammar (drafts cut where the grammar refuses, verification rows masked per position;
real xgrammar matchers over a small vocabulary of strings).

The fake runner writes each token id into K at its slot and predicts every position from the
ids read back through the row's slots, so a branch row with a wrong prefix copy, a slot freed
while in use or kept by the wrong branch changes the outputs."""

from __future__ import annotations

import functools
import math
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixrt.attention.base import ForwardBatch
from radixrt.cache import KVPool, KVSlotAllocator, RadixCache
from radixrt.config import EngineConfig
from radixrt.grammar import Matcher, mask_branch_logits, mask_logits
from radixrt.sampling import Sampler, SamplingParams, make_generator
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.speculative import NoSpeculation, make_speculator
from radixrt.scheduler.step_cost import StepCost
from radixrt.spec import backoff
from radixrt.spec.backoff import Backoff
from radixrt.spec.draft import DraftTree
from radixrt.spec.ngram import NgramProposer
from radixrt.spec.proposer import make_proposer
from radixrt.spec.verify import verify

VOCAB = 97
# The sampled fake model's next-token distribution, whatever came before.
PROBS = [0.45, 0.3, 0.15, 0.1]


def next_token(ids: list[int]) -> int:
    h = 0
    for t in ids:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def copy_token(ids: list[int]) -> int:
    """An induction head: what followed the latest earlier occurrence of the last token."""
    for j in range(len(ids) - 2, -1, -1):
        if ids[j] == ids[-1]:
            return ids[j + 1]
    return next_token(ids)


def reference(prompt: list[int], n: int, rule=next_token) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(rule(ids))
    return ids[len(prompt) :]


class FakeRunner:
    """Logits for every position ``logits_indices`` asks for (default: each row's last):
    one-hot at ``rule`` of the ids read through the row's slots, or (``sampled``)
    ``log(PROBS)`` on tokens 0..3 whatever the ids."""

    def __init__(
        self, num_slots: int, max_running: int = 32, sampled: bool = False, rule=next_token
    ) -> None:
        self.pool = KVPool(num_slots, 1, 1, 1, torch.float32, max_running, 512)
        self.sampled, self.rule = sampled, rule

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        k = batch.input_ids.to(torch.float32).view(-1, 1, 1)
        self.pool.store_kv(0, batch.out_cache_loc, k, k)
        table, kbuf = self.pool.req_to_token, self.pool.k_buffers[0]
        seqs = []  # per token of the batch: the ids up to and including it
        for row, seq_len, n in zip(batch.req_rows.tolist(), batch.seq_lens, batch.extend_lens):
            ids = kbuf[table[row, :seq_len], 0, 0].long().tolist()
            seqs += [ids[: seq_len - n + t + 1] for t in range(n)]
        at = batch.logits_indices
        at = at.tolist() if at is not None else (torch.tensor(batch.extend_lens).cumsum(0) - 1)
        return torch.stack([self.logits(seqs[int(i)]) for i in at])

    def logits(self, ids: list[int]) -> torch.Tensor:
        out = torch.full((VOCAB,), -40.0)
        if self.sampled:
            out[: len(PROBS)] = torch.tensor(PROBS).log()
        else:
            out[self.rule(ids)] = 1.0
        return out


class Oracle:
    """Drafts from what decoding will give: ``right``, ``partly`` right (the third token off),
    ``wrong``, or a ``tree`` whose first branch goes wrong after one token and whose second is
    right."""

    def __init__(self, mode: str, k: int = 5) -> None:
        self.mode, self.k = mode, k
        self.calls = 0

    def propose(self, tokens, salt) -> DraftTree:
        self.calls += 1
        right = reference(list(tokens), self.k)
        bad = [(t + 1) % VOCAB for t in right]
        if self.mode == "partly" and len(right) > 2:
            right[2] = bad[2]
        if self.mode == "wrong":
            return DraftTree.chain(bad)
        if self.mode == "tree" and len(right) >= 3:
            return DraftTree([right[0], bad[1], right[1], right[2]], [-1, 0, 0, 2])
        return DraftTree.chain(right)


class Unlearned(StepCost):
    """A step cost that stays as given (the fake runner's times would teach it nonsense)."""

    def observe(self, seconds: float, tokens: int, pairs: int, prompt: bool = False) -> None:
        pass


def make(
    num_slots=4096,
    proposer=None,
    sampled=False,
    max_running=32,
    rule=next_token,
    runner=FakeRunner,
    **cfg,
) -> Scheduler:
    cfg.setdefault("speculative_algorithm", "NGRAM")
    sched = Scheduler(
        EngineConfig(**cfg),
        runner(num_slots, max_running, sampled, rule),
        decode_fn=lambda ids: " ".join(map(str, ids)),
        max_context=512,
        step_cost=Unlearned(0.0),
    )
    if proposer is not None:
        sched.spec.proposer = proposer
    return sched


def run(sched: Scheduler, reqs: list[Req]) -> list[Req]:
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in reqs):
        sched.step()
        sched.check_memory()
    return reqs


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


# ------------------------------------------------------------------ drafts and proposers


def test_pruning_keeps_parents_before_children():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, 0, -1])
    assert tree.branches() == [[0, 1, 2], [0, 3], [4]]
    assert tree.pruned(5, 2) == DraftTree([1, 2, 4, 5], [-1, 0, 0, -1])
    assert tree.pruned(2, 9) == DraftTree([1, 2], [-1, 0])
    assert tree.pruned(0, 9) == DraftTree()
    assert len(DraftTree.chain([7, 8, 9]).pruned(8, 1)) == 1


def test_make_proposer_drafts_from_own_tokens_and_the_cache():
    """NGRAM's proposer: the request's own earlier occurrence, and (with the cache) a cached
    sequence's continuation; the settings reach it."""
    cfg = EngineConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    own = make_proposer(cfg)
    assert isinstance(own, NgramProposer) and own.index is None
    assert own.propose([2, 3, 4, 9, 1, 3, 4, 7, 2, 3, 4], None).tokens[:4] == [9, 1, 3, 4]
    assert len(own.propose([1, 2, 3], None)) == 0
    alloc = KVSlotAllocator(64)
    cache = RadixCache(alloc)
    cache.insert([5, 6, 7, 8, 9], alloc.alloc(5))
    tree = make_proposer(cfg, cache).propose([5, 6, 7], None)
    assert tree.branches()[0] == [0, 1] and tree.tokens[:2] == [8, 9]
    short = EngineConfig(
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        speculative_ngram_branch_length=2,
        speculative_ngram_min_match_window_size=2,
    )
    assert make_proposer(short).propose([1, 2, 3, 4, 5, 1, 2], None).tokens == [3, 4]


def test_backoff_pauses_longer_after_each_low_run_and_starts_over_on_a_good_round():
    b = Backoff()
    pauses = []
    for _ in range(9):
        for _ in range(backoff.LOW_ROUNDS):
            assert b.take_turn()
            b.record(8, 0)
        wait = 0
        while not b.take_turn():
            wait += 1
        pauses.append(wait)
    assert pauses == [1, 2, 4, 8, 16, 32, 64, 128, 128]
    b.record(8, 4)  # a good round: the pauses start over, the count reset
    assert (b.level, b.low, b.wait) == (0, 0, 0) and b.p > 0
    b.record(2, 1)  # one of two: not low
    b.record(8, 1)
    assert b.low == 1


# ------------------------------------------------------------------ acceptance


def test_greedy_verification_takes_the_longest_branch_and_its_bonus():
    # Rows: branch [5, 6] (root, after 5, after 6), then branch [5, 7].
    argmax = [5, 6, 3, 5, 7, 8]
    logits = torch.full((6, 10), -1.0)
    logits[torch.arange(6), argmax] = 1.0
    sp = SamplingParams(temperature=0, logprobs=True, top_logprobs=2)
    v = verify(Sampler(0), logits, [[5, 6], [5, 7]], sp, None)
    assert (v.branch, v.tokens) == (0, [5, 6, 3])
    v = verify(Sampler(0), logits, [[5, 9], [5, 7]], sp, None)
    assert (v.branch, v.tokens) == (1, [5, 7, 8])
    want = torch.log_softmax(logits[3:], -1)
    assert v.logprobs == want.gather(1, torch.tensor([[5], [7], [8]]))[:, 0].tolist()
    assert v.top_logprobs[0][0][0] == 5 and len(v.top_logprobs[0][0]) == 2
    v = verify(Sampler(0), logits, [[4], [1]], sp, None)
    assert (v.branch, v.tokens) == (0, [5])


def test_sampled_verification_emits_what_decoding_draws_and_leaves_the_generator_there():
    sampler, sp = Sampler(0), SamplingParams(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 12, generator=gen)
    for seed in range(30):
        rows = logits[seed % 10 : seed % 10 + 6]
        g = make_generator(seed)
        decoded = [sampler.sample(rows[i : i + 1], [sp], [g]).token_ids.item() for i in range(6)]
        after_all = g.get_state()
        off = [(t + 1) % 12 for t in decoded]  # a token decoding does not draw there
        for drafts in ([decoded[:5]], [decoded[:2] + off[2:4]], [off[:1], decoded[:3]], [off[:1]]):
            g = make_generator(seed)  # branch b's row t: the logits after its first t tokens
            branch_rows = torch.cat([rows[: len(d) + 1] for d in drafts])
            v = verify(sampler, branch_rows, drafts, sp, g)
            assert v.tokens == decoded[: len(v.tokens)]
            assert v.tokens[:-1] == drafts[v.branch][: len(v.tokens) - 1]
            g2 = make_generator(seed)  # the generator stands where decoding's would
            for i in range(len(v.tokens)):
                sampler.sample(rows[i : i + 1], [sp], [g2])
            assert torch.equal(g.get_state(), g2.get_state())
        assert v.tokens == decoded[:1] and not torch.equal(g.get_state(), after_all)


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


# The 0.999 quantile of chi-square with 3 and with 15 degrees of freedom.
CHI2_3, CHI2_15 = 16.27, 37.70


def test_sampled_tokens_follow_the_model_whatever_the_drafts():
    """Drafts of the likely token 0, a less likely 2, or the impossible 9: the first token, and
    the second after an accepted first, stay distributed as the model says. Emitting a fresh
    draw on a rejection (not one from the residual) pushes token 0 from 0.45 to about 0.7."""
    sampler, sp = Sampler(0), SamplingParams(temperature=1.0)
    logits = torch.full((4, 12), -40.0)
    logits[:, :4] = torch.tensor(PROBS).log()
    for draft in ([0, 0, 0], [2, 0, 2], [9, 9, 9]):
        first, second = [0] * 4, [0] * 4
        for seed in range(3000):
            v = verify(sampler, logits, [draft], sp, make_generator(seed * 7 + 1))
            first[v.tokens[0]] += 1
            if len(v.tokens) > 1:  # the first draft token was accepted
                second[v.tokens[1]] += 1
        assert chi_square(first, PROBS) < CHI2_3, (draft, first)
        if draft[0] < len(PROBS):
            assert chi_square(second, PROBS) < CHI2_3, (draft, second)
        else:
            assert sum(second) == 0


def test_a_sampled_request_needs_its_generator():
    with pytest.raises(ValueError, match="generator"):
        verify(Sampler(0), torch.zeros(2, 4), [[1]], SamplingParams(temperature=1.0), None)


# ------------------------------------------------------------------ the scheduler


@pytest.mark.parametrize("mode", ["right", "partly", "wrong", "tree"])
@pytest.mark.parametrize(
    "cfg",
    [{}, {"disable_mixed_chunk": True}, {"chunked_prefill_size": 8}, {"disable_radix_cache": True}],
)
def test_greedy_outputs_equal_decoding(mode, cfg):
    ps = prompts(6)
    oracle = Oracle(mode)
    sched = make(proposer=oracle, **cfg)
    reqs = run(sched, [Req(str(i), p, greedy(20)) for i, p in enumerate(ps)])
    assert [r.output_ids for r in reqs] == [reference(p, 20) for p in ps]
    verified = sum(r.spec_verify_ct for r in reqs)
    accepted = sum(r.spec_accepted_tokens for r in reqs)
    assert verified > 0 and sched.get_stats()["spec_verify_ct"] == verified
    if mode == "wrong":
        assert accepted == 0
    else:
        assert accepted > 0
    if mode == "right":  # every draft token is accepted
        assert all(r.spec_accepted_tokens == r.spec_draft_tokens for r in reqs)


def test_requests_without_drafts_decode_in_the_same_forward():
    class Some(Oracle):
        def propose(self, tokens, salt):
            return super().propose(tokens, salt) if tokens[0] % 2 else DraftTree()

    ps = [[1, 5, 9], [2, 5, 9], [3, 4], [4, 4, 4, 4]]
    sched = make(proposer=Some("right"))
    reqs = run(sched, [Req(str(i), p, greedy(15)) for i, p in enumerate(ps)])
    assert [r.output_ids for r in reqs] == [reference(p, 15) for p in ps]
    assert [r.spec_verify_ct > 0 for r in reqs] == [True, False, True, False]


def test_the_own_tokens_proposer_on_repetitive_prompts():
    """A model that repeats what it has seen: the proposer drafts it right; and one that does
    not: drafts from the prompt are wrong."""
    ps = [[1, 2, 3, 4] * 6, [5, 6, 7, 5, 9, 8] * 4, [8] * 12, prompts(1)[0] * 2]
    for model in (copy_token, next_token):
        sched = make(rule=model)
        assert isinstance(sched.spec.proposer, NgramProposer)
        reqs = run(sched, [Req(str(i), p, greedy(30)) for i, p in enumerate(ps)])
        assert [r.output_ids for r in reqs] == [reference(p, 30, model) for p in ps]
        if model is copy_token:
            assert all(r.spec_accepted_tokens >= 20 for r in reqs)
            assert sched.get_stats()["decode_steps"] < 15


@pytest.mark.parametrize("mode", ["right", "tree"])
def test_stops_inside_an_accepted_run(mode):
    p = [4, 8, 15, 16, 23, 42]
    out = reference(p, 30)
    stop_at = 7  # index into out; the draft covers it
    assert out[stop_at] not in out[:stop_at]
    cases = [
        (greedy(30, stop_token_ids=[out[stop_at]]), stop_at + 1, "stop"),
        (greedy(stop_at + 1), stop_at + 1, "length"),
        (greedy(30, stop=f" {out[stop_at]} {out[stop_at + 1]}"), stop_at + 2, "stop"),
        (
            SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[out[stop_at]]),
            stop_at + 1,
            "stop",
        ),
    ]
    for sp, n, reason in cases:
        sched = make(proposer=Oracle(mode, k=8))
        (req,) = run(sched, [Req("a", list(p), sp)])
        assert (req.output_ids, req.finish_reason) == (out[:n], reason)
        assert req.spec_accepted_tokens >= 1
    sched = make(proposer=Oracle(mode, k=8))
    sp = SamplingParams(max_new_tokens=30, temperature=0)
    (req,) = run(sched, [Req("a", list(p), sp, eos_ids=(out[stop_at],))])
    assert (req.output_ids, req.finish_reason) == (out[: stop_at + 1], "stop")


def test_the_context_bounds_a_draft():
    sched = make(proposer=Oracle("right", k=8))
    p = prompts(1)[0]
    (req,) = run(sched, [Req("a", p, greedy(600))])
    assert req.output_ids == reference(p, 512 - len(p)) and req.finish_reason == "length"


def test_drafts_need_spare_rows_and_slots():
    """Branches beyond the first need spare rows; a pool too full for a draft decodes."""
    sched = make(proposer=Oracle("tree"), max_running=2)
    reqs = run(sched, [Req(str(i), p, greedy(12)) for i, p in enumerate(prompts(2))])
    assert [r.output_ids for r in reqs] == [reference(p, 12) for p in prompts(2)]
    assert all(r.spec_verify_ct for r in reqs)
    sched = make(num_slots=70, proposer=Oracle("right", k=8))
    ps = [list(range(i, i + 20)) for i in range(3)]
    reqs = run(sched, [Req(str(i), p, greedy(20)) for i, p in enumerate(ps)])
    assert [r.output_ids for r in reqs] == [reference(p, 20) for p in ps]


def test_a_failed_verification_forward_frees_the_drafts():
    sched = make(proposer=Oracle("right"))
    req = Req("a", prompts(1)[0], greedy(20))
    sched.add_request(req)
    sched.step()
    forward = sched.runner.forward
    sched.runner.forward = lambda batch: 1 / 0
    (failed,) = sched.step()
    assert failed is req and req.finish_reason == "error" and "forward" in req.error
    sched.runner.forward = forward
    sched.check_memory()


def test_backoff_stops_drafting_wrong_guesses():
    oracle = Oracle("wrong")
    sched = make(proposer=oracle)
    (req,) = run(sched, [Req("a", prompts(1)[0], greedy(100))])
    assert req.spec_accepted_tokens == 0 and req.spec_verify_ct < 25 and oracle.calls < 25


def test_the_cost_rule_drops_drafts_of_a_large_batch():
    """A step whose fixed part is small next to its tokens' cost gains nothing from drafts."""
    ps = prompts(8)
    for fixed, drafting in ((100.0, True), (0.0, False)):
        sched = make(proposer=Oracle("right"))
        sched.cost = sched.spec.cost = Unlearned(0.0, fixed=fixed, per_unit=1.0)
        reqs = run(sched, [Req(str(i), p, greedy(10)) for i, p in enumerate(ps)])
        assert [r.output_ids for r in reqs] == [reference(p, 10) for p in ps]
        assert (sum(r.spec_verify_ct for r in reqs) > 0) == drafting


@pytest.fixture
def one_thread():
    """Small tensors of a wide batch: splitting them between threads only costs here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sampled_frequencies_with_and_without_speculation_agree(one_thread):
    """Over many seeds (different ones for each engine), each output position's token and
    each pair of successive tokens are distributed alike: a chi-square statistic at a
    fixed seed set, two-sample, with the own-tokens proposer drafting the frequent tokens."""
    n, new = 400, 6
    counts = {}
    for spec in (None, "NGRAM"):
        sched = make(sampled=True, speculative_algorithm=spec, max_running=64)
        base = 0 if spec is None else n
        sp = [
            SamplingParams(max_new_tokens=new, temperature=1.0, seed=base + i, ignore_eos=True)
            for i in range(n)
        ]
        reqs = run(sched, [Req(str(i), [0, 1, 0, 1, 0], sp[i]) for i in range(n)])
        if spec:
            assert (
                sum(r.spec_verify_ct for r in reqs) > n
                and sum(r.spec_accepted_tokens for r in reqs) > n / 2
            )
        pairs = [0] * 16
        for r in reqs:
            for a, b in zip(r.output_ids, r.output_ids[1:]):
                pairs[4 * a + b] += 1
        counts[spec] = pairs
    a, b = counts[None], counts["NGRAM"]
    stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)
    assert stat < CHI2_15, (a, b)
    marginal = [sum(b[4 * i : 4 * i + 4]) for i in range(4)]
    assert chi_square(marginal, PROBS) < CHI2_3, marginal


# ------------------------------------------------------------------ grammars

# A vocabulary of VOCAB strings for xgrammar: characters, a few multi-character pieces, two
# tokens no grammar below takes (FORBIDDEN), fillers and the stop token.
GRAMMAR_VOCAB = list('0123456789abcdefghijklmnopqrstuvwxyz ,{}":') + [
    "ab",
    "cd",
    '", "',
    '": ',
    "12",
    "ok",
    '{"',
    '"}',
    "Q",
    "X",
]
GRAMMAR_VOCAB += [f"<f{i}>" for i in range(VOCAB - 1 - len(GRAMMAR_VOCAB))] + ["</s>"]
STOP, FORBIDDEN = VOCAB - 1, GRAMMAR_VOCAB.index("Q")
RECORD = r'\{"[a-z]{1,4}": \d{1,3}(, "[a-z]{1,4}": \d{1,3}){0,2}\}'
WORDS = r"[a-z]{2,5}( [a-z]{2,5}){1,3}"


@functools.cache
def compiled(regex: str):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(
        GRAMMAR_VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[STOP]
    )
    return xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_regex(regex))


class GradedRunner(FakeRunner):
    """The fake model with a ranking under its argmax: the other tokens' logits fall with
    their distance after it, so a grammar's mask changes the pick to the allowed token
    nearest after it."""

    def logits(self, ids: list[int]) -> torch.Tensor:
        if self.sampled:
            return super().logits(ids)
        return -0.25 * ((torch.arange(VOCAB) - self.rule(ids)) % VOCAB).float()


class Replay:
    """Drafts from known outputs (prompt -> output ids): ``right``; ``forbidden``, the third
    token one the grammar refuses; ``first_forbidden``; ``allowed_wrong``, the third token
    one the grammar may take but decoding did not pick; a ``tree`` whose first branch holds
    a refused token after one right one and whose second is right."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], mode: str, k: int = 5):
        self.outputs, self.mode, self.k = outputs, mode, k

    def propose(self, tokens, salt) -> DraftTree:
        prompt = next(p for p in self.outputs if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt)
        right = list(self.outputs[prompt][done : done + self.k])
        if self.mode == "first_forbidden":
            return DraftTree.chain([FORBIDDEN, *right])
        if len(right) < 3:
            return DraftTree.chain(right)
        if self.mode == "tree":
            return DraftTree([right[0], FORBIDDEN, right[1], right[2]], [-1, 0, 0, 2])
        if self.mode in ("forbidden", "allowed_wrong"):
            right[2] = FORBIDDEN if self.mode == "forbidden" else (right[2] + 1) % VOCAB
        return DraftTree.chain(right)


class Fixed:
    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree

    def propose(self, tokens, salt) -> DraftTree:
        return self.tree


def constrained(rid: str, prompt: list[int], sp: SamplingParams, seed: int | None = None) -> Req:
    req = Req(rid, prompt, sp, eos_ids=(STOP,))
    if seed is not None:
        req.generator = make_generator(seed)
    if sp.regex is not None:
        req.matcher = Matcher(compiled(sp.regex))
    return req


def grammar_requests(ps: list[list[int]], sps: list[SamplingParams], seeded: bool) -> list[Req]:
    return [
        constrained(str(i), p, sp, i if seeded else None) for i, (p, sp) in enumerate(zip(ps, sps))
    ]


def mask_of(matcher: Matcher) -> torch.Tensor:
    xgr = pytest.importorskip("xgrammar")
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask


def test_a_constrained_draft_is_cut_at_the_first_token_its_grammar_refuses():
    sched = make()
    sp = SamplingParams(max_new_tokens=40, temperature=0, regex=RECORD)
    req = constrained("a", [5, 6], sp)
    v = GRAMMAR_VOCAB.index
    for token in (v('{"'), v("ab"), v('": ')):
        assert req.matcher.accept(token)
    before = mask_of(req.matcher)
    cases = [  # a draft tree -> the branches drafted
        (DraftTree.chain([1, 2, v('", "'), 3]), [[1, 2]]),
        (DraftTree.chain([1, v("}"), STOP, 4]), [[1, v("}"), STOP]]),  # none after the end
        (DraftTree.chain([FORBIDDEN, 1]), []),
        (DraftTree([1, FORBIDDEN, 2, 3], [-1, 0, 0, 2]), [[1], [1, 2, 3]]),
        (DraftTree([1, 2, FORBIDDEN, 7], [-1, 0, 0, -1]), [[1, 2], [7]]),  # [1] is in [1, 2]
    ]
    for tree, branches in cases:
        sched.spec.proposer = Fixed(tree)
        assert sched.spec._propose(req, sched.spec.max_tokens) == branches
        assert torch.equal(mask_of(req.matcher), before)  # the matcher is where it was
    assert not req.matcher.terminated


def test_each_verification_row_gets_the_mask_of_its_position():
    """Rows of two branches masked in one application equal, row by row, ``mask_logits``
    after the matcher took the branch's tokens; a row after the stop token is not touched."""
    v = GRAMMAR_VOCAB.index
    branches = [[v('{"'), v("ab"), v('": '), 1], [v('{"'), v("ok"), v('"}')][:2]]
    final = [v('{"'), v("cd"), v('": '), 4, v("}"), STOP]
    logits = torch.randn(4 + 1 + 2 + 1 + 6 + 1, VOCAB)
    masked = logits.clone()
    matcher = Matcher(compiled(RECORD))
    rows = mask_branch_logits(masked, [0, 5, 8], [matcher] * 3, [*branches, final])
    assert rows == 5 + 3 + 6
    assert torch.equal(masked[14], logits[14])  # after the stop token
    for start, tokens in zip([0, 5, 8], [*branches, final]):
        for t in range(len(tokens) + (tokens[-1] != STOP)):
            one, want = Matcher(compiled(RECORD)), logits[start + t : start + t + 1].clone()
            assert all(one.accept(x) for x in tokens[:t])
            mask_logits(want, [0], [one])
            assert torch.equal(masked[start + t], want[0])
    assert torch.equal(mask_of(matcher), mask_of(Matcher(compiled(RECORD))))


@pytest.mark.parametrize(
    "mode, sampled",
    [(m, False) for m in ("right", "forbidden", "first_forbidden", "allowed_wrong", "tree")]
    + [("allowed_wrong", True), ("tree", True)],
)
def test_constrained_outputs_equal_decoding(mode, sampled):
    """Constrained (and unconstrained) requests, greedy or seeded, decode the same tokens and
    logprobs with drafts as without; the grammar ends them where it did, its text valid."""
    ps = prompts(6, 11)
    sps = [
        SamplingParams(
            max_new_tokens=64, temperature=1.0 if sampled else 0, regex=regex, logprobs=True
        )
        for regex in [RECORD, WORDS, None, RECORD, WORDS, RECORD]
    ]
    plain = make(runner=GradedRunner, sampled=sampled, speculative_algorithm=None)
    want = run(plain, grammar_requests(ps, sps, sampled))
    outputs = {tuple(p): r.output_ids for p, r in zip(ps, want)}
    sched = make(runner=GradedRunner, sampled=sampled, proposer=Replay(outputs, mode))
    got = run(sched, grammar_requests(ps, sps, sampled))
    for w, g in zip(want, got):
        assert (g.output_ids, g.output_logprobs) == (w.output_ids, w.output_logprobs)
        assert g.finish_reason == w.finish_reason
        if g.params.regex is not None and g.finish_reason == "stop":
            text = "".join(GRAMMAR_VOCAB[t] for t in g.output_ids[:-1])
            assert g.output_ids[-1] == STOP and re.fullmatch(g.params.regex, text), text
    assert sum(r.finish_reason == "stop" for r in got if r.matcher is not None) >= 3
    accepted = [r.spec_accepted_tokens for r in got if r.matcher is not None]
    assert all(a == 0 for a in accepted) if mode == "first_forbidden" else all(accepted)
    assert sched.get_stats()["grammar_masked_rows"] > 0


def test_constrained_requests_retracted_while_drafting_resume_as_decoding():
    """A pool too small for every constrained request: retracted ones resume with their
    matcher where it was, drafting again, with decoding's tokens."""
    ps = prompts(6, 11)
    sps = [SamplingParams(max_new_tokens=64, temperature=0, regex=RECORD)] * len(ps)
    plain = make(runner=GradedRunner, speculative_algorithm=None)
    want = run(plain, grammar_requests(ps, sps, False))
    outputs = {tuple(p): r.output_ids for p, r in zip(ps, want)}
    for mode in ("forbidden", "tree"):
        sched = make(
            num_slots=100, runner=GradedRunner, proposer=Replay(outputs, mode), new_token_ratio=0.0
        )
        got = run(sched, grammar_requests(ps, sps, False))
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert sched.get_stats()["retractions"] > 0
        assert all(r.spec_accepted_tokens for r in got)


# ------------------------------------------------------------------ a random trace


class SpecTrace(RuleBasedStateMachine):
    """Requests decode with drafts right, partly right and wrong, are aborted, evicted and
    retracted from a small pool: the KV invariant after every step, and every request that
    finishes has decoding's tokens."""

    @initialize(slots=st.sampled_from([48, 96, 4096]), mixed=st.booleans())
    def setup(self, slots, mixed):
        self.sched = make(
            num_slots=slots,
            proposer=Oracle("right"),
            max_running=6,
            disable_mixed_chunk=not mixed,
            new_token_ratio=0.0,  # admit without reserving: decoding runs out and retracts
        )
        self.reqs: list[Req] = []
        self.count = 0

    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
        new=st.integers(1, 16),
        shared=st.booleans(),
    )
    def add(self, prompt, new, shared):
        if shared and self.reqs:
            prompt = self.reqs[-1].prompt_ids[:20] + prompt[:5]
        req = Req(str(self.count), prompt, greedy(new))
        self.count += 1
        self.reqs.append(req)
        self.sched.add_request(req)

    @rule(seed=st.integers(0, 99))
    def crowd(self, seed):
        """Three long requests at once: a small pool runs out while they decode."""
        for p in prompts(3, seed):
            self.add((p * 8)[:20], 16, shared=False)

    @rule(mode=st.sampled_from(["right", "partly", "wrong", "tree"]), k=st.integers(1, 8))
    def change_drafts(self, mode, k):
        self.sched.spec.proposer = Oracle(mode, k)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.sched.step()
            self.sched.check_memory()

    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.reqs if not r.finished]
        if live:
            self.sched.abort(data.draw(st.sampled_from(live)).rid)

    @rule(n=st.integers(1, 64))
    def evict(self, n):
        self.sched.kv.evict(n)

    @invariant()
    def finished_requests_decoded(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_memory()
        for r in self.reqs:
            if r.finish_reason == "length":
                assert r.output_ids == reference(r.prompt_ids, r.params.max_new_tokens)

    def teardown(self):
        if hasattr(self, "sched"):
            while not self.sched.idle:
                self.sched.step()
                self.sched.check_memory()
            self.sched.check_memory()
            self.finished_requests_decoded()


SpecTrace.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSpecTrace = SpecTrace.TestCase


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm 'EAGLE' is not implemented"),
        ({"speculative_algorithm": "ngram"}, "speculative_algorithm 'ngram'"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0}, "in \\[1, 64\\]"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 65}, "in \\[1, 64\\]"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": True}, "an integer"),
        ({"speculative_num_draft_tokens": 4}, "needs speculative_algorithm"),
        ({"speculative_algorithm": "NGRAM", "page_size": 4}, "needs page_size 1"),
        ({"speculative_algorithm": "NGRAM", "device": "cuda"}, "CPU only"),
        ({"speculative_ngram_min_match_window_size": 0}, "min_match_window_size must be"),
        (
            {
                "speculative_ngram_min_match_window_size": 5,
                "speculative_ngram_max_match_window_size": 4,
            },
            "max_match_window_size \\(4\\) is below",
        ),
        ({"speculative_ngram_max_bfs_breadth": 0}, "max_bfs_breadth \\(0\\) is below"),
        ({"speculative_ngram_branch_length": 0}, "branch_length must be"),
    ],
)
def test_bad_speculative_settings_are_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**cfg)


def test_acceptance_falls_with_bad_rounds_and_drifts_back():
    b = Backoff()
    assert b.p == backoff.PRIOR
    b.record(8, 0)
    b.record(8, 0)
    b.record(8, 0)
    low = b.p
    assert low < backoff.PRIOR * 0.6
    for _ in range(20):
        b.take_turn()
    assert low < b.p < backoff.PRIOR  # tried again after a while, never above the prior
    b.record(8, 8)
    assert b.p > backoff.PRIOR  # eight accepted tokens: above the prior
    b.record(3, 3)  # all of a short draft: no refusal counted
    assert b.p > 0.9


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("price", [0.0, 0.05, 0.25, 0.6, 1.0, 2.0])
def test_tokens_worth_drafting_are_those_whose_chance_beats_the_price(p, price):
    b = Backoff()
    b.p = p
    k = b.tokens_worth(price, 8)
    assert 0 <= k <= 8
    assert all(p**j > price for j in range(1, k + 1))
    assert k == 8 or p ** (k + 1) <= price


def test_defaults_and_refused_pools():
    assert EngineConfig().draft_tokens == 0
    assert EngineConfig(speculative_algorithm="NGRAM").draft_tokens == 16
    config = EngineConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    assert config.draft_tokens == 3
    sched = make(speculative_algorithm=None)
    assert isinstance(sched.spec, NoSpeculation) and sched.spec.plan(sched.decoding) == {}

    class Sliding:
        sliding = [True]
        device = torch.device("cpu")

    class OnMeta:
        device = torch.device("meta")

    kv, cost = make().kv, StepCost(0.0)
    with pytest.raises(ValueError, match="sliding-window layers' KV pool"):
        make_speculator(config, kv, cost, Sliding(), 512)
    with pytest.raises(ValueError, match="CPU only"):
        make_speculator(config, kv, cost, OnMeta(), 512)
    assert math.isclose(backoff.PRIOR, Backoff().p)
