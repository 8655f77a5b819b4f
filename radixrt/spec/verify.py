"""Which draft tokens a request keeps, from the logits of its verification rows.

A request's draft is verified as rows: branch b is the request's last token followed by the
branch's tokens, and row t of it holds the logits after its first t + 1 tokens. ``verify``
samples each row exactly as decoding would sample that position (``Sampler.sample``, the
request's parameters), accepts a branch's tokens while they equal what was sampled, and
returns the longest accepted run (the first such branch on a tie) followed by the token
sampled after it (the bonus: at least one token always comes out).

Greedy requests take the argmax, so the tokens, logprobs and top logprobs are those of
decoding token by token, bit for bit (each row's logits are, in exact mode).

Sampled requests: decoding draws a position's token as ``argmax(scaled logits + Gumbel
noise)`` from V uniforms of the request's generator, one draw per position. ``verify``
gives row t of every branch the draw decoding would use for output position t (the
generator rewound to where it stood before the step for each branch), and after the step
leaves the generator advanced by exactly the positions emitted. So each emitted token is
the one decoding would have drawn: a seeded request's tokens do not depend on drafts. This
is speculative sampling for a point-mass draft: draft token x is accepted with probability
p(x) (the sampled token equals x), and on rejection the emitted token is the sample given
that it is not x, i.e. a draw from p with x removed and renormalised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixrt.sampling import SampleOutput, Sampler, SamplingParams


class Verdict(NamedTuple):
    branch: int  # the branch whose tokens were accepted
    tokens: list[int]  # its accepted tokens, then the token sampled after them
    logprobs: list[float] | None  # per token of ``tokens`` (when the request asks)
    top_logprobs: list[tuple[list[int], list[float]]] | None


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    branches: list[list[int]],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """The tokens a request keeps. ``logits`` [sum(len(b) + 1), V]: its rows, branch after
    branch; ``generator``: the request's (needed unless ``params.greedy``)."""
    starts = [sum(len(b) + 1 for b in branches[:i]) for i in range(len(branches))]
    if params.greedy:
        out = sampler.sample(logits, [params] * logits.shape[0])
        sampled = out.token_ids.tolist()
        kept = [_accepted(sampled[s:], b) for s, b in zip(starts, branches)]
        best = kept.index(max(kept))
        return _verdict(best, out, starts[best], kept[best] + 1, params)
    if generator is None:
        raise ValueError("verifying a sampled request needs its generator")
    before = generator.get_state()
    kept = []
    for s, b in zip(starts, branches):
        generator.set_state(before)
        out = _sample(sampler, logits[s : s + len(b) + 1], params, generator)
        kept.append(_accepted(out.token_ids.tolist(), b))
    best = kept.index(max(kept))
    n = kept[best] + 1
    if best != len(branches) - 1 or n != len(branches[best]) + 1:
        generator.set_state(before)  # draw the emitted positions again: the generator ends there
        out = _sample(sampler, logits[starts[best] : starts[best] + n], params, generator)
    return _verdict(best, out, 0, n, params)


def _sample(
    sampler: Sampler, rows: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> SampleOutput:
    """Each row sampled as a decoding step would, one draw of ``generator`` per row in order."""
    n = rows.shape[0]
    return sampler.sample(rows, [params] * n, [generator] * n)


def _accepted(sampled: list[int], draft: list[int]) -> int:
    """How many leading tokens of ``draft`` equal what was sampled before each."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n


def _verdict(branch: int, out: SampleOutput, start: int, n: int, params: SamplingParams) -> Verdict:
    """Rows ``start .. start + n - 1`` of ``out`` as the verdict for ``branch``."""
    end = start + n
    logprobs = out.logprobs[start:end].tolist() if out.logprobs is not None else None
    top = None
    if k := params.top_logprobs:
        ids, values = out.top_logprobs[0][start:end], out.top_logprobs[1][start:end]
        top = [(i[:k], v[:k]) for i, v in zip(ids.tolist(), values.tolist())]
    return Verdict(branch, out.token_ids[start:end].tolist(), logprobs, top)
