"""What a step costs on this machine, learned as it runs, and the prefill a step time buys.

A step (forward and sampling) over T new tokens whose attention reads A (query, key) pairs
takes ``fixed + per_unit * units`` seconds, with ``units = T + attention_weight * A``:
- ``attention_weight`` is the model's attention FLOPs per pair over its linear FLOPs per
  token, times ``ATTENTION_EFFICIENCY`` (attention does less per second than a linear);
- ``fixed`` is what a step costs whatever its size (streaming the weights of a small step,
  per-layer calls, sampling), learned from steps of at most ``SMALL_STEP_TOKENS`` tokens that
  compute no prompt (decode steps);
- ``per_unit`` is learned from the other steps, once ``fixed`` is taken off.
Both are exponential moving averages of what the steps took, seeded by ``probe`` (a few
forwards timed at start-up), so the first burst is budgeted by this machine's speed too.

Small steps without a prompt (decode, decode with speculative drafts) get a line of their own,
``predict_small``: ``seconds = a + b * units``, since a few rows more cost a decode step
more per unit than a prefill's units do (row-wise kernel paths, attention over the whole
context per row). Its slope is an average of the slopes between consecutive small steps
whose units differ by ``MIN_SPREAD`` or more (a step far slower than the line, another
process taking the CPU, counts as ``OUTLIER`` times it); until two such steps came,
``per_unit`` stands in.

``prefill_tokens(target_s, used_units, prefix)``: the new tokens of one request (after
``prefix`` cached or computed tokens) that fit in a step of ``target_s`` seconds beside
``used_units`` already in it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

ATTENTION_EFFICIENCY = 3.0
SMALL_STEP_TOKENS = 64
EMA = 0.2  # weight of the newest step
PROBE_SECONDS = 0.25  # how long the larger probe forward should take
PROBE_TOKENS = (16, 256)  # the probes' sizes: the smaller, and the most the larger takes
SLOPE_EMA = 0.1
MIN_SPREAD = 1.0  # units between two small steps that measure a slope
OUTLIER = 2.0


def attention_pairs(prefix: int, n: int) -> int:
    """(query, key) pairs of n new causal tokens after ``prefix`` tokens."""
    return n * prefix + n * (n + 1) // 2


class _Line:
    """``y = a + b * x`` learned from a stream of points: ``b`` from consecutive points whose
    x differ by ``MIN_SPREAD`` or more (their slope, an exponential moving average), so a
    level that drifts while x stays put does not bend it; ``a`` from every point given ``b``.
    None until two such points came."""

    def __init__(self) -> None:
        self.a = 0.0
        self.b: float | None = None
        self.last: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        if self.last is not None and abs(x - self.last[0]) >= MIN_SPREAD:
            slope = max((y - self.last[1]) / (x - self.last[0]), 0.0)
            if self.b is None:
                self.b = slope
            else:
                self.b += SLOPE_EMA * (min(slope, OUTLIER * self.b) - self.b)
        self.last = (x, y)
        if self.b is not None:
            self.a = _blend(self.a, max(y - self.b * x, 0.0))

    def at(self, x: float) -> float | None:
        return None if self.b is None else self.a + self.b * x


class StepCost:
    def __init__(self, attention_weight: float, fixed: float = 0.0, per_unit: float = 0.0):
        """``per_unit`` 0: unknown until a step is observed (no budget is given meanwhile)."""
        self.attention_weight = attention_weight
        self.fixed, self.per_unit = fixed, per_unit
        self.small = _Line()

    @classmethod
    def for_model(cls, cfg) -> StepCost:
        """An unseeded cost for a model config (``radixrt.model.hf_config.ModelConfig``)."""
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h = cfg.hidden_size
        linear = 2 * (h * (2 * q + 2 * kv) + 3 * h * cfg.intermediate_size)  # qkv, o, mlp
        attention = 4 * q  # q·k and p·v for every head
        return cls(ATTENTION_EFFICIENCY * attention / linear)

    @property
    def known(self) -> bool:
        return self.per_unit > 0

    def units(self, tokens: int, pairs: int) -> float:
        return tokens + self.attention_weight * pairs

    def predict(self, tokens: int, pairs: int) -> float:
        """Seconds of a step of ``tokens`` new tokens reading ``pairs`` (query, key) pairs."""
        return self.fixed + self.per_unit * self.units(tokens, pairs)

    def predict_small(self, tokens: int, pairs: int) -> float:
        """Seconds of a step of at most ``SMALL_STEP_TOKENS`` tokens (the small steps' line)."""
        units = self.units(tokens, pairs)
        line = self.small.at(units)
        return self.predict(tokens, pairs) if line is None else line

    def unit_seconds_small(self) -> float:
        """What one more unit adds to a small step: the small steps' slope (``per_unit``
        until it is fitted)."""
        return self.per_unit if self.small.b is None else self.small.b

    def observe(self, seconds: float, tokens: int, pairs: int, prompt: bool = False) -> None:
        """A step of ``tokens`` new tokens reading ``pairs`` pairs took ``seconds``;
        ``prompt``: some of its tokens were a prompt's (a prefill or mixed step)."""
        units = self.units(tokens, pairs)
        if tokens <= SMALL_STEP_TOKENS and not prompt:
            line = self.small.at(units)
            self.small.add(units, seconds if line is None else min(seconds, OUTLIER * line))
            self.fixed = _blend(self.fixed, max(seconds - self.per_unit * units, 0.0))
        elif seconds > self.fixed:
            self.per_unit = _blend(self.per_unit, (seconds - self.fixed) / units)

    def budget_units(self, target_s: float) -> float:
        """Units a step of ``target_s`` seconds holds (infinite while the cost is unknown)."""
        if not self.known:
            return math.inf
        return max(target_s - self.fixed, 0.0) / self.per_unit

    def prefill_tokens(self, units_left: float, prefix: int) -> int:
        """The most new tokens n after ``prefix`` with units(n) <= units_left (0 if none)."""
        if math.isinf(units_left):
            return 1 << 62
        if units_left < 1:
            return 0
        # n + w * (n * prefix + n * (n + 1) / 2) <= left
        w = self.attention_weight
        a, b = w / 2, 1 + w * prefix + w / 2
        n = units_left / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * units_left)) / (2 * a)
        n = int(n)
        while n > 0 and self.units(n, attention_pairs(prefix, n)) > units_left:
            n -= 1
        return n

    def probe(
        self,
        forward: Callable[[int], None],
        max_tokens: int,
        timed: Callable[[Callable[[int], None], int], float] | None = None,
    ) -> None:
        """Seed ``fixed`` and ``per_unit`` by timing ``forward(n)`` (one request's extend of n
        tokens, synchronised) at a small n and a larger one sized to ``PROBE_SECONDS``; each
        the faster of two runs, after one that pays one-off costs. ``timed(forward, n)``:
        the seconds of one run (tests give their own)."""
        timed = timed or _timed
        small = min(PROBE_TOKENS[0], max_tokens)
        forward(small)
        t_small = min(timed(forward, small), timed(forward, small))
        u_small = self.units(small, attention_pairs(0, small))
        guess = t_small / u_small
        large = int(min(PROBE_TOKENS[1], max_tokens, max(2 * small, PROBE_SECONDS / guess)))
        if large <= small:
            self.fixed, self.per_unit = 0.0, guess
            return
        t_large = min(timed(forward, large), timed(forward, large))
        u_large = self.units(large, attention_pairs(0, large))
        self.per_unit = max((t_large - t_small) / (u_large - u_small), t_large / u_large / 2)
        self.fixed = max(t_small - self.per_unit * u_small, 0.0)

    def describe(self) -> dict[str, float]:
        return {
            "step_fixed_ms": round(self.fixed * 1e3, 3),
            "step_per_token_ms": round(self.per_unit * 1e3, 4),
            "small_step_per_token_ms": round(self.unit_seconds_small() * 1e3, 4),
        }


def for_runner(runner, config, max_context: int) -> StepCost:
    """The cost of ``runner``'s steps, probed on it where a time budget is set and the runner
    can be probed (a ``ModelRunner``); otherwise learned from the first steps."""
    cfg = getattr(runner, "model_cfg", None)
    cost = StepCost.for_model(cfg) if cfg is not None else StepCost(0.0)
    if config.max_prefill_step_ms > 0 and hasattr(runner, "probe_forward"):
        cost.probe(runner.probe_forward, max(max_context - 1, 1))
    return cost


def _blend(old: float, new: float) -> float:
    return new if old <= 0 else (1 - EMA) * old + EMA * new


def _timed(forward: Callable[[int], None], n: int) -> float:
    start = time.perf_counter()
    forward(n)
    return time.perf_counter() - start
