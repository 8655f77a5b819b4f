"""Sampling parameters and the batched sampler.

Contract:
- ``SamplingParams`` is a plain dataclass (msgspec encodes/decodes it; msgspec
  runs ``__post_init__`` on decode). ``__post_init__`` validates every field and
  raises ``ValueError`` naming the field and the bad value, including for wrong
  types. It normalizes: ``stop`` → ``list[str]`` of non-empty strings,
  ``stop_token_ids`` → ``list[int]``, ``top_k`` 0 → -1 (disabled),
  ``temperature``/``top_p``/``min_p`` → ``float``.
- ``cache_salt`` (None or a non-empty str of at most ``MAX_CACHE_SALT_LEN``
  chars) namespaces the prefix cache: a request reuses only KV computed for
  requests with the same salt (None shares with None), so tenants with
  different salts cannot observe each other's cached prefixes by timing.
- ``Sampler.sample(logits [B, V], params, generators)`` returns one token per
  row. A row is greedy when ``temperature == 0`` or ``top_k == 1``: it takes the
  argmax of the raw logits (first index on ties) and draws no random numbers.
  Other rows: ``(logits - rowmax) / temperature`` in float32, then top-k, top-p
  (nucleus over the top-k renormalized distribution; the top token is always
  kept), min-p (keep ``p >= min_p * p_max``), then one draw from the
  renormalized distribution by Gumbel-max (an exponential race):
  ``argmax(masked_logits + G)``, ``G = -log(-log U)``, ``U ~ U[0, 1)`` i.i.d. per
  vocab entry. No normalization enters the draw, so rows that filter nothing
  give the same token whether or not the batch takes the sort path.
- Seeds: a row with a ``torch.Generator`` (see ``make_generator``) draws its
  ``V`` uniforms from that generator alone, one call per sampled step, in
  vocabulary order; everything else about the row is computed row-wise. So a
  seeded request gets the same tokens whatever else is in the batch (exactly
  on CPU; on GPU up to reduction-order effects of batch size on the filter
  masks). Rows without a generator share the sampler's own (seeded with
  ``EngineConfig.seed``, ``--random-seed``), or the global RNG of the logits' device.
- Logprobs: when any row asks for them, ``SampleOutput.logprobs[i]`` is
  ``log_softmax(logits[i].float())[token_i]`` (the model's distribution at
  temperature 1, unfiltered) for every row; otherwise it is ``None``.
- Constraints: at most one of ``json_schema`` and ``structural_tag`` (a dict or JSON
  text; kept as JSON text), ``regex`` and ``ebnf`` (strings) per request; the output
  then follows that grammar (``radixrt.grammar``: a grammar that does not parse raises
  ``GrammarError``, a ``ValueError``). Each step the disallowed tokens' logits are set to
  -inf before every other step above, so greedy, sampled and seeded rows all decode within
  the grammar, and logprobs are those of the constrained logits.
- Top logprobs: ``top_logprobs`` (an int in ``[0, MAX_TOP_LOGPROBS]``; > 0 needs
  ``logprobs=True``) asks for that many most likely tokens per position. When
  any row asks, ``SampleOutput.top_logprobs`` is ``(ids, logprobs)``, int64 and
  float32 ``[B, K]`` with ``K = min(max top_logprobs over rows, V)``: the
  ``torch.topk`` of that same log_softmax for every row, sorted descending
  (each row keeps its own first ``top_logprobs`` columns); otherwise ``None``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from radixrt import grammar
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import sampling_ops

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
MAX_CACHE_SALT_LEN = 256
MAX_TOP_LOGPROBS = 20


def _bad(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"SamplingParams.{name} must be {want}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request decoding parameters (validated; see the module docstring)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    cache_salt: str | None = None
    top_logprobs: int = 0
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._check_lengths()
        self._check_filters()
        self.stop = _norm_stop(self.stop)
        self.stop_token_ids = _norm_stop_token_ids(self.stop_token_ids)
        self._check_flags()
        self._check_constraint()

    def _check_constraint(self) -> None:
        if isinstance(self.json_schema, (dict, bool)):
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        given = [k for k in grammar.KINDS if getattr(self, k) is not None]
        for kind in given:
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                json_kind = kind in ("json_schema", "structural_tag")
                want = "None, a dict or a JSON string" if json_kind else "None or a str"
                raise _bad(kind, getattr(self, kind), f"{want} (not empty)")
        if len(given) > 1:
            raise ValueError(
                f"SamplingParams.{given[1]}: give at most one of {', '.join(grammar.KINDS)} "
                f"(got {' and '.join(given)})"
            )
        c = grammar.constraint(self)
        if c is not None:
            try:
                grammar.check(c)
            except grammar.GrammarError as e:
                raise grammar.GrammarError(f"SamplingParams.{c.kind}: {e}") from None

    @property
    def constraint(self) -> grammar.Constraint | None:
        """The output's grammar constraint, or None."""
        return grammar.constraint(self)

    def _check_lengths(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise _bad("max_new_tokens", self.max_new_tokens, "an int >= 0")
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise _bad("temperature", t, "a finite number >= 0")
        self.temperature = float(t)

    def _check_filters(self) -> None:
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an int >= 1, or -1/0 (disabled)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "a number in [0, 1]")
        self.top_p = float(self.top_p)
        self.top_k = -1 if self.top_k == 0 else self.top_k
        self.min_p = float(self.min_p)

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        s = self.seed
        if s is not None and (not _is_int(s) or not _SEED_MIN <= s <= _SEED_MAX):
            raise _bad("seed", s, f"None or an int in [{_SEED_MIN}, {_SEED_MAX}]")
        salt = self.cache_salt
        if salt is not None and (
            not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_LEN
        ):
            raise _bad(
                "cache_salt", salt, f"None or a non-empty str of at most {MAX_CACHE_SALT_LEN} chars"
            )
        self._check_top_logprobs()

    def _check_top_logprobs(self) -> None:
        k = self.top_logprobs
        if not _is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", k, f"an int in [0, {MAX_TOP_LOGPROBS}]")
        if k > 0 and not self.logprobs:
            raise _bad("top_logprobs", k, "0 unless SamplingParams.logprobs is True")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def filters(self) -> bool:
        """True when top-k, top-p or min-p removes tokens (needs a sort)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the (normalized) fields; ``from_dict`` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a dict; unknown keys raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}")
        return cls(**data)


def _norm_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise _bad("stop", stop, "None, a str or a list of str")
    for s in items:
        if not isinstance(s, str) or not s:
            raise _bad("stop", stop, "None, a non-empty str or a list of non-empty str")
    return list(items)


def _norm_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise _bad("stop_token_ids", ids, "None or a list of ints >= 0")
    return list(ids)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one seeded request, on the device of its logits."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class SampleOutput(NamedTuple):
    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B], or None when no row asked
    # (ids int64 [B, K], logprobs float32 [B, K]), descending; None when every row has 0
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    """Batched sampler. A seeded request's RNG state lives in its generator; rows without one
    share the sampler's own generator (seeded with ``seed``), or with ``seed`` None the global
    RNG of the logits' device."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # one per device, made on first use

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if device not in self._shared:
            self._shared[device] = make_generator(self.seed, device)
        return self._shared[device]

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
    ) -> SampleOutput:
        bsz = logits.shape[0]
        if logits.dim() != 2 or len(params) != bsz:
            raise ValueError(
                f"logits must be [B, V] with B == len(params) "
                f"(got {tuple(logits.shape)}, {len(params)} params)"
            )
        generators = [None] * bsz if generators is None else generators
        if len(generators) != bsz:
            raise ValueError(f"got {len(generators)} generators for {bsz} rows")
        tokens = self._tokens(logits, params, generators)
        if not any(p.logprobs for p in params):
            return SampleOutput(tokens, None)
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return SampleOutput(
            tokens, chosen, topk_logprobs(logp, max(p.top_logprobs for p in params))
        )

    def _tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:  # fast path: one argmax
            return _argmax(logits)
        shared = self._shared_generator(logits.device)
        if len(rows) == len(params):
            return _sample_rows(logits.float(), params, generators, shared)
        tokens = _argmax(logits)
        idx = torch.tensor(rows, device=logits.device)
        sub = _sample_rows(
            logits[idx].float(), [params[i] for i in rows], [generators[i] for i in rows], shared
        )
        return tokens.index_copy_(0, idx, sub)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), through the CPU kernels' library where the process has it (same
    result, a tenth of the time)."""
    lib = cpu_library.loaded()
    if lib is not None and logits.dim() == 2 and sampling_ops.usable(logits):
        return sampling_ops.argmax(lib, logits)
    return logits.argmax(dim=-1)


def topk_logprobs(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids int64 [n, K], logprobs float32 [n, K]) of the K = min(k, V) largest entries of
    each row of ``logp`` [n, V], descending, equal values in ascending id order (so a row's
    answer does not depend on the rows beside it, as ``topk``'s order among ties may); None
    when k == 0."""
    if k == 0:
        return None
    n, k = logp.shape[0], min(k, logp.shape[1])
    kth = logp.topk(k, dim=-1).values[:, -1:]
    rows, cols = (logp >= kth).nonzero(as_tuple=True)  # row-major: ids ascending in a row
    values = logp[rows, cols]
    order = values.sort(descending=True, stable=True).indices
    order = order[rows[order].sort(stable=True).indices]  # by row, then value, then id
    counts = torch.bincount(rows, minlength=n)
    first = torch.cumsum(counts, 0) - counts
    keep = order[torch.arange(len(order), device=logp.device) - first[rows[order]] < k]
    return cols[keep].view(n, k), values[keep].view(n, k)


def _sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row of float32 ``logits``; no row is greedy."""
    temp = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = (logits - logits.amax(dim=1, keepdim=True)) / temp.unsqueeze(1)
    rows = [i for i, p in enumerate(params) if p.filters]
    if len(rows) == len(params):
        scaled.masked_fill_(_filter_mask(scaled, params), float("-inf"))
    elif rows:  # sort only the rows that filter
        idx = torch.tensor(rows, device=logits.device)
        sub = scaled[idx]
        sub.masked_fill_(_filter_mask(sub, [params[i] for i in rows]), float("-inf"))
        scaled.index_copy_(0, idx, sub)
    return (scaled + _gumbel(scaled.shape, logits.device, generators, shared)).argmax(dim=1)


def _filter_mask(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Bool [n, V], True where top-k / top-p / min-p removes the token."""
    dev, vocab = scaled.device, scaled.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    sorted_logits, order = scaled.sort(dim=1, descending=True, stable=True)
    pos = torch.arange(vocab, device=dev)
    remove = pos.unsqueeze(0) >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=1)
    before = probs.cumsum(dim=1) - probs  # mass strictly above each token
    remove |= before >= top_p.unsqueeze(1)
    remove |= probs < min_p.unsqueeze(1) * probs[:, :1]
    remove[:, 0] = False  # the top token always survives
    return torch.empty_like(remove).scatter_(1, order, remove)


def _gumbel(
    shape: torch.Size,
    device: torch.device,
    generators: list[torch.Generator | None],
    shared: torch.Generator | None = None,
) -> torch.Tensor:
    """Gumbel noise [n, V] (``-log E``, ``E ~ Exp(1)``), float32.

    Seeded rows draw ``V`` uniforms from their own generator; the others share
    one draw from ``shared`` (None: the global RNG). Uniforms are float64 so the noise's upper
    tail (which decides low-probability tokens) is not quantized; on CPU this
    is also faster than ``exponential_``. ``U == 0`` gives ``-inf``.
    """
    u = torch.empty(shape, dtype=torch.float64, device=device)
    if any(g is None for g in generators):
        u.uniform_(generator=shared)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row].uniform_(generator=gen)
    return u.log_().neg_().log_().neg_().float()
