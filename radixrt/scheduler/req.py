"""Request state inside the scheduler.

KV ownership of a running request (row r of req_to_token):
- ``table[r, :prefix_len]`` are slots of tree nodes, locked through ``last_node``;
- ``table[r, prefix_len:kv_len]`` are the request's private slots (with
  page_size > 1, together with the rest of their last page).
``fill_ids = prompt_ids + output_ids``; tokens ``fill_ids[kv_len:]`` still need
computing. While decoding, ``kv_len == len(fill_ids) - 1``: the newest token's
KV is written by the next step.

An embedding request (``pooling`` "last" or "mean") computes its prompt and samples
nothing (``max_new_tokens`` 0): each step hands it the final hidden state of the rows it
pools (``hidden_rows``; "last": the prompt's last token, "mean": every prompt token, so
its prefix match stops at 0), and ``pool_hidden`` turns them into ``embedding`` as it
finishes.
"""

from __future__ import annotations

import enum

import torch

from radixrt.cache.radix_cache import TreeNode
from radixrt.config import EMBEDDING_POOLINGS
from radixrt.grammar import Matcher
from radixrt.sampling import SamplingParams
from radixrt.spec.backoff import Backoff


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Req:
    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
        logprob_start_len: int | None = None,
        pooling: str | None = None,
    ) -> None:
        if pooling not in (*EMBEDDING_POOLINGS, None):
            raise ValueError(
                f"pooling must be one of {EMBEDDING_POOLINGS} or None, got {pooling!r}"
            )
        if pooling is not None and params.max_new_tokens != 0:
            raise ValueError("an embedding request (pooling set) needs max_new_tokens 0")
        self.rid = rid
        self.pooling = pooling
        self.hidden_rows: list[torch.Tensor] = []  # float32 [n, hidden] per step, in order
        self.embedding: torch.Tensor | None = None  # float32 [hidden], once pooled
        # Prompt scoring: log p(prompt_ids[j] | prompt_ids[:j]) for j >= logprob_start_len
        # is collected into prompt_logprobs (positions j-1 are always recomputed), and with
        # params.top_logprobs = k the k most likely (ids, logprobs) there into prompt_top_logprobs.
        # A retraction clears both: the request's re-extend scores those positions again.
        self.logprob_start_len = logprob_start_len
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[tuple[list[int], list[float]]] = []
        self.prompt_ids = prompt_ids
        self.params = params
        self.eos_ids = () if params.ignore_eos else eos_ids
        self.stop_ids = set(params.stop_token_ids or ()) | set(self.eos_ids)
        self.generator = generator
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        # One (ids, logprobs) per output token when params.top_logprobs > 0, descending.
        self.output_top_logprobs: list[tuple[list[int], list[float]]] = []
        self.state = ReqState.WAITING
        self.queued_at: float | None = None  # time.monotonic() it arrived (add_request)
        self.first_token_at: float | None = None  # time.monotonic() when output_ids[0] was sampled
        self.finish_reason: str | None = None
        self.error: str | None = None  # why, when finish_reason == "error"
        self.error_code: str | None = None  # an ErrorCode for it (None: internal)
        # Structured outputs: the request's place in its grammar (None: unconstrained, or its
        # grammar is still compiling). Retraction keeps output_ids, so it keeps the matcher.
        self.matcher: Matcher | None = None
        self.cached_tokens = 0  # tokens hit in the tree at first admission
        self.cached_below = (0, 0)  # of those, loaded from the (host, storage) tier
        self.admitted = False
        self.prefetched = False  # its blocks in storage were asked to be read ahead
        self.num_retractions = 0
        # Speculative decoding: steps that verified a draft of this request, the draft tokens
        # they verified, and how many of those were accepted (each step also emits one more).
        self.spec_verify_ct = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_backoff = Backoff()
        self.reset_kv()

    def reset_kv(self) -> None:
        """Forget KV placement (on creation and after retraction)."""
        self.row: int | None = None
        self.last_node: TreeNode | None = None
        self.prefix_len = 0
        self.kv_len = 0
        self.loaded_tokens = (0, 0)  # of prefix_len, loaded from the (host, storage) tier
        self.swa_released = 0  # sliding-window models: positions before it hold no SWA KV

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building fill_ids (cheap in decode)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.fill_ids[start:end]

    @property
    def match_limit(self) -> int:
        """Longest prefix that may come from the tree (the rest is computed)."""
        limit = self.fill_len - 1
        if self.pooling == "mean":  # every prompt position's hidden state is computed
            return 0
        if self.logprob_start_len is not None:
            limit = min(limit, self.logprob_start_len - 1)
        return limit

    @property
    def prefill_only(self) -> bool:
        """Compute (and cache) the prompt, sample nothing (max_new_tokens == 0)."""
        return self.params.max_new_tokens == 0

    def pooled_rows(self, n: int) -> range:
        """Which of the n tokens this request computes next (from ``kv_len``) it pools."""
        if self.pooling == "mean":
            return range(n)
        if self.pooling == "last" and self.kv_len + n == self.fill_len:
            return range(n - 1, n)
        return range(0)

    def pool_hidden(self) -> None:
        """``embedding`` from the collected rows: the last one, or their mean (summed in
        order, in float64); the rows are dropped."""
        rows = torch.cat(self.hidden_rows)
        assert self.pooling == "last" or rows.shape[0] == len(self.prompt_ids), (
            f"mean pooling over {rows.shape[0]} of {len(self.prompt_ids)} prompt tokens"
        )
        if self.pooling == "last":
            self.embedding = rows[-1].clone()
        else:
            total = rows.double().cumsum(0)[-1]  # a fixed order, whatever the thread count
            self.embedding = (total / rows.shape[0]).float()
        self.hidden_rows = []

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
            f"kv={self.kv_len}, prefix={self.prefix_len}, {self.state.value})"
        )
