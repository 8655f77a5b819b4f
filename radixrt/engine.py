"""``radixrt.Engine``: the scheduler loop in-process, for offline batches and tests."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from radixrt.cache.hicache import make_hierarchical_cache
from radixrt.config import EngineConfig, engine_config
from radixrt.grammar import GrammarCompiler, GrammarError, preload
from radixrt.model.default_model import resolve_model_path
from radixrt.model.hf_config import ModelConfig
from radixrt.model.runner import ModelRunner
from radixrt.model.weights import model_fingerprint
from radixrt.output import embedding_output, make_output
from radixrt.protocol import GenerateOutput
from radixrt.sampling import SamplingParams, make_generator
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import Scheduler


class Engine:
    """Generate with prefix caching in this process.

    ``Engine(config=None, **overrides)``: ``config`` is an ``EngineConfig`` (None: the
    defaults, which load SmolLM2-135M-Instruct), and each keyword replaces one of its fields:
    ``Engine(model="path", dtype="float32")``, ``Engine(config, max_total_tokens=4096)``. A
    keyword that is no ``EngineConfig`` field is a TypeError naming it, raised before any
    model is loaded.

    ``Engine(speculative_algorithm="NGRAM")`` decodes speculatively
    (``radixrt.scheduler.speculative``): the outputs are those of decoding without it (greedy
    and seeded requests bit for bit), and each ``GenerateOutput`` counts its verifications
    (``spec_verify_ct``, ``spec_draft_tokens``, ``spec_accepted_tokens``).

    ``encode`` (SGLang's name) answers embedding requests: each prompt's final hidden state,
    pooled by ``embedding_pooling``, with the same exactness as generated tokens.

    A request the scheduler failed (a forward pass of its batch raised, or its
    own step did; see ``radixrt.scheduler.scheduler``) finishes with
    finish_reason "error" and the message in ``Req.error``. ``generate`` and
    ``score`` then raise ``RuntimeError`` naming the first failed request,
    after every request of the call has finished (its KV released, the engine
    still usable); ``make_output`` returns finish_reason "error" for it.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        self.config = engine_config(config, **overrides)
        self.model_path = resolve_model_path(self.config.model, self.config.dtype)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.runner = ModelRunner(self.config, self.model_path, self.model_config)
        preload()
        self.grammars = GrammarCompiler(
            self.tokenizer,
            self.model_config.vocab_size,
            list(self.model_config.eos_token_ids),
            any_whitespace=not self.config.constrained_json_disable_any_whitespace,
        )
        self.hicache = make_hierarchical_cache(
            self.config, self.runner.pool, functools.partial(model_fingerprint, self.model_path)
        )
        self.scheduler = Scheduler(
            self.config,
            self.runner,
            self._decode,
            self.runner.max_context,
            self.grammars,
            self.hicache,
        )
        self._rids = itertools.count()

    # ----------------------------------------------------------------- API

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[GenerateOutput]:
        """One GenerateOutput per prompt, in order (a list also for a single str)."""
        ids = self._prompt_ids(prompts, input_ids)
        params = self._per_prompt_params(sampling_params, len(ids))
        reqs = self._run([self._make_req(p, sp) for p, sp in zip(ids, params)])
        return [self.make_output(r) for r in reqs]

    def encode(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
    ) -> dict | list[dict]:
        """Each prompt's embedding, as SGLang's ``Engine.encode`` gives it: ``{"embedding":
        [float, ...], "meta_info": {"id", "prompt_tokens", "cached_tokens"}}``, one dict for a
        str prompt, else a list of them in order.

        The embedding is the prompt's final hidden state (after the final norm: what the LM
        head reads), in float32, pooled by ``embedding_pooling``: the last token's ("last",
        which reuses a cached prefix) or the mean over every prompt token ("mean", which
        computes the whole prompt). Its bits depend on the prompt alone, never on the batch
        or the cache. The prompt's KV is cached as any finished prefill's.
        """
        ids = self._prompt_ids(prompt, input_ids)
        sp = SamplingParams(max_new_tokens=0)
        pooling = self.config.embedding_pooling
        reqs = self._run([self._make_req(p, sp, pooling) for p in ids])
        outs = [embedding_output(r) for r in reqs]
        return outs[0] if isinstance(prompt, str) else outs

    def score(
        self,
        prefix_ids: Sequence[int],
        continuations: Sequence[Sequence[int]],
        *,
        cache_salt: str | None = None,
    ) -> list[tuple[float, int]]:
        """(summed log-likelihood, token count) of each continuation after ``prefix_ids``.

        The prefix is prefilled once (and cached, under ``cache_salt``); each
        continuation then runs as a prefill-only request that hits it and
        computes only its own tokens.
        """
        prefix = list(map(int, prefix_ids))
        conts = [list(map(int, c)) for c in continuations]
        if not prefix or any(not c for c in conts):
            raise ValueError("score needs a non-empty prefix and non-empty continuations")
        sp = SamplingParams(max_new_tokens=0, cache_salt=cache_salt)
        self.generate(input_ids=[prefix], sampling_params=sp)
        reqs = [self.add_request(prefix + c, sp, logprob_start_len=len(prefix)) for c in conts]
        self._run(reqs, added=True)
        return [(sum(r.prompt_logprobs), len(c)) for r, c in zip(reqs, conts)]

    def add_request(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        logprob_start_len: int | None = None,
    ) -> Req:
        """Queue one request (validated); drive it with ``step()``, read it with ``make_output``."""
        ids = list(map(int, input_ids))
        self._validate_ids(0, ids)
        if logprob_start_len is not None and not 1 <= logprob_start_len < len(ids):
            raise ValueError(f"logprob_start_len {logprob_start_len} outside [1, {len(ids)})")
        req = self._make_req(ids, sampling_params)
        req.logprob_start_len = logprob_start_len
        self.scheduler.add_request(req)
        return req

    def step(self) -> list[Req]:
        """One scheduler step; the requests that finished in it."""
        return self.scheduler.step()

    def make_output(self, req: Req) -> GenerateOutput:
        """Everything req produced (``radixrt.output.make_output``); "abort" while unfinished."""
        return make_output(req, self._decode)

    def stats(self) -> dict[str, float]:
        return self.scheduler.get_stats()

    def check_memory(self) -> None:
        """Raise AssertionError if the KV invariant is broken (call at idle)."""
        self.scheduler.check_memory()

    def flush_cache(self) -> None:
        """Drop every cached prefix (the engine must be idle)."""
        if not self.scheduler.flush_cache():
            raise RuntimeError("flush_cache needs an idle engine (no request waiting or running)")

    def shutdown(self) -> None:
        """Stop the engine's threads; the storage tier's queued writes are written first."""
        if self.scheduler is not None:
            self.grammars.close()
            if self.hicache is not None:
                self.hicache.close()
        self.scheduler = None
        self.runner = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------ helpers

    def _prompt_ids(self, prompts, input_ids) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts or input_ids")
        if input_ids is not None:
            ids = [list(map(int, x)) for x in input_ids]
        else:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            ids = [self.tokenizer.encode(t) for t in texts]
        for i, x in enumerate(ids):
            self._validate_ids(i, x)
        return ids

    def _validate_ids(self, i: int, ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) >= self.runner.max_context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; the context is {self.runner.max_context} tokens"
            )
        capacity = self.scheduler.kv_capacity
        if len(ids) >= capacity:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; the KV pool holds {capacity}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )

    @staticmethod
    def _per_prompt_params(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
        return sp

    def _make_req(self, ids: list[int], sp: SamplingParams, pooling: str | None = None) -> Req:
        gen = make_generator(sp.seed) if sp.seed is not None else None
        eos = self.model_config.eos_token_ids
        return Req(str(next(self._rids)), ids, sp, eos, gen, pooling=pooling)

    def _run(self, reqs: list[Req], added: bool = False) -> list[Req]:
        """Queue reqs (unless ``added``) and step until every one has finished; raise if one
        failed (``_raise_if_failed``)."""
        if not added:
            for req in reqs:
                self.scheduler.add_request(req)
        while not all(r.finished for r in reqs):
            self.scheduler.step()
        self._raise_if_failed(reqs)
        return reqs

    @staticmethod
    def _raise_if_failed(reqs: list[Req]) -> None:
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            error = GrammarError if failed[0].error_code == "invalid_grammar" else RuntimeError
            raise error(
                f"request {failed[0].rid} failed ({len(failed)} of {len(reqs)} "
                f"in this call): {failed[0].error}"
            )

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
