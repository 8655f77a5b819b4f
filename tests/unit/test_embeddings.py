"""Embedding requests in the scheduler with no model, their setting, and the HTTP encoding.

The fake runner's final hidden state of a token is a function of the sequence up to it, read
back through the KV slots (as ``test_scheduler``'s fake predicts), of its position and of its
id, so a row taken at the wrong token, a prefix matched where mean pooling must compute every
position, or a chunk's rows lost or reordered changes the pooled vector.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import torch
from test_scheduler import FakeRunner, next_token, reference

from radixrt.attention.base import ForwardBatch, ForwardMode
from radixrt.config import EngineConfig, load_config
from radixrt.sampling import SamplingParams
from radixrt.scheduler.batch import DraftRows, ScheduledBatch
from radixrt.scheduler.req import Req
from radixrt.scheduler.scheduler import Scheduler
from radixrt.server.http.embeddings_api import encode_vector

HIDDEN = 4
EMBED = SamplingParams(max_new_tokens=0)


class HiddenRunner(FakeRunner):
    """``FakeRunner`` with the final hidden state of each token: [hash of the sequence up to
    it through the KV, position, token id, 1]."""

    def forward_hidden(self, batch: ForwardBatch, hidden_indices: torch.Tensor):
        logits = self.forward(batch)
        table, kbuf = self.pool.req_to_token, self.pool.k_buffers[0]
        rows = []
        starts = np.cumsum([0, *batch.extend_lens])
        for t in hidden_indices.tolist():
            b = int(np.searchsorted(starts, t, side="right")) - 1
            pos = int(batch.positions[t])
            ids = kbuf[table[int(batch.req_rows[b]), : pos + 1], 0, 0].long().tolist()
            rows.append(expected_row(ids))
        return logits, torch.stack(rows)


def expected_row(seq: list[int]) -> torch.Tensor:
    """The fake's hidden state of the last token of ``seq``."""
    return torch.tensor([next_token(seq), len(seq) - 1, seq[-1], 1.0], dtype=torch.float32)


def expected(prompt: list[int], pooling: str) -> torch.Tensor:
    rows = torch.stack([expected_row(prompt[: j + 1]) for j in range(len(prompt))])
    if pooling == "last":
        return rows[-1]
    return (rows.double().cumsum(0)[-1] / len(prompt)).float()


def make(**cfg) -> Scheduler:
    return Scheduler(EngineConfig(**cfg), HiddenRunner(4096), lambda ids: "", max_context=512)


def drive(sched: Scheduler, reqs: list[Req], running: list[Req] = ()) -> None:
    """Add reqs and step until they and ``running`` (added before) have finished."""
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in [*reqs, *running]):
        sched.step()
        sched.check_memory()
    sched.check_memory()


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(length // 2)]
    return [shared + [rng.randrange(97) for _ in range(length - len(shared))] for _ in range(n)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("cfg", [{}, {"chunked_prefill_size": 7}, {"page_size": 4}])
def test_embeddings_pool_the_prompt_and_hit_the_cache_only_when_last(pooling, cfg):
    sched = make(**cfg)
    ps = prompts(5, 30)
    first = [Req(f"a{i}", p, EMBED, pooling=pooling) for i, p in enumerate(ps)]
    drive(sched, first)
    again = [Req(f"b{i}", p, EMBED, pooling=pooling) for i, p in enumerate(ps)]
    drive(sched, again)
    for r in first + again:
        assert r.finish_reason == "length" and not r.output_ids and not r.hidden_rows
        assert torch.equal(r.embedding, expected(r.prompt_ids, pooling))
    if pooling == "mean":
        assert all(r.cached_tokens == 0 for r in again)
    else:
        page = cfg.get("page_size", 1)
        assert all(r.cached_tokens >= (len(r.prompt_ids) - 1) // page * page for r in again)
    assert sched.kv.tree.total_size() >= 30  # the prompts' KV stays cached


def test_embeddings_ride_in_mixed_steps_beside_decoding_requests():
    sched = make(chunked_prefill_size=9)
    gen_prompts = prompts(3, 12, seed=1)
    sp = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    gens = [Req(f"g{i}", p, sp) for i, p in enumerate(gen_prompts)]
    for r in gens:
        sched.add_request(r)
    sched.step()
    embeds = [
        Req(f"e{i}", p, EMBED, pooling=pool)
        for i, (p, pool) in enumerate(zip(prompts(4, 25, seed=2), ["last", "mean"] * 2))
    ]
    drive(sched, embeds, running=gens)
    assert sched.stats["mixed_steps"] > 0
    assert [r.output_ids for r in gens] == [reference(p, 20) for p in gen_prompts]
    for r in embeds:
        assert torch.equal(r.embedding, expected(r.prompt_ids, r.pooling))


def test_hidden_layout_takes_each_pooled_row_after_decode_and_draft_rows():
    last = Req("l", [1, 2, 3, 4, 5], EMBED, pooling="last")
    chunk = Req("c", [1, 2, 3, 4, 5, 6], EMBED, pooling="last")  # not its last chunk
    mean = Req("m", [7, 8, 9], EMBED, pooling="mean")
    running = Req("r", [1, 2], SamplingParams(max_new_tokens=4))
    running.output_ids = [3]
    drafted = Req("d", [1, 2], SamplingParams(max_new_tokens=4))
    drafted.output_ids = [3]
    draft = DraftRows(tokens=[[4, 5], [6]], rows=[0, 1], slots=[])
    batch = ScheduledBatch(
        ForwardMode.EXTEND,
        [running, drafted, last, chunk, mean],
        [1, 1, 5, 4, 3],
        decode_rows=2,
        drafts={1: draft},
    )
    # tokens: running 0, drafted 1..5 (branches of 3 and 2), last 6..10, chunk 11..14, mean 15..17
    layout = batch.hidden_layout()
    assert layout.indices == [10, 15, 16, 17]
    assert layout.spans == [(2, 0, 1), (4, 1, 3)]
    plain = ScheduledBatch(ForwardMode.EXTEND, [running], [1])
    assert plain.hidden_layout() is None


def test_an_embedding_request_must_sample_nothing_and_pool_a_known_way():
    with pytest.raises(ValueError, match="max_new_tokens 0"):
        Req("x", [1, 2], SamplingParams(max_new_tokens=1), pooling="last")
    with pytest.raises(ValueError, match="pooling must be one of"):
        Req("x", [1, 2], EMBED, pooling="max")
    assert Req("x", [1, 2, 3], EMBED, pooling="mean").match_limit == 0
    assert Req("x", [1, 2, 3], EMBED, pooling="last").match_limit == 2


def test_embedding_pooling_setting_is_checked_and_has_its_flag():
    assert EngineConfig().embedding_pooling == "last"
    with pytest.raises(ValueError, match="embedding_pooling must be one of"):
        EngineConfig(embedding_pooling="cls")
    engine, _ = load_config(flags={"embedding_pooling": "mean"})
    assert engine.embedding_pooling == "mean"


def test_base64_is_little_endian_float32_of_the_same_values():
    values = torch.randn(257, generator=torch.Generator().manual_seed(0)).tolist()
    values += [0.0, -0.0, 1e-38, 3.4e38]
    values = torch.tensor(values, dtype=torch.float32).tolist()
    raw = base64.b64decode(encode_vector(values, "base64"))
    assert len(raw) == 4 * len(values)
    assert np.frombuffer(raw, dtype="<f4").tolist() == values
    assert encode_vector(values, "float") is values
