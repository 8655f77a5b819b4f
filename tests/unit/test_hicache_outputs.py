"""Where cached tokens came from, as outputs and /metrics give it (no model, no server)."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from radixrt.output import Detokenizer, OutputTracker, cached_tokens_details, make_output
from radixrt.protocol import BatchTokenOut, GenerateOutput, TextDelta, TokenDelta, decode, encode
from radixrt.sampling import SamplingParams
from radixrt.scheduler.req import Req, ReqState
from radixrt.server.controls import combine
from radixrt.server.metrics import ServerMetrics


class DigitTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(str(i % 10) for i in ids)


def finished_req() -> Req:
    req = Req("r", list(range(40)), SamplingParams(max_new_tokens=2))
    req.cached_tokens, req.cached_below = 39, (16, 16)
    req.output_ids = [5, 6]
    req.state, req.finish_reason = ReqState.FINISHED, "length"
    return req


def test_the_details_split_cached_tokens_by_tier():
    assert cached_tokens_details(39, (16, 16)) == {"device": 7, "host": 16, "storage": 16}
    assert cached_tokens_details(5, (0, 0)) == {"device": 5, "host": 0, "storage": 0}


def test_outputs_and_deltas_carry_them():
    req = finished_req()
    want = {"device": 7, "host": 16, "storage": 16}
    assert make_output(req, DigitTokenizer().decode).cached_tokens_details == want
    tracker = OutputTracker()
    tracker.add(req, stream=False)
    [(_, delta)] = tracker.collect()
    wire = decode(encode(BatchTokenOut(items=[delta])))
    [text] = Detokenizer(DigitTokenizer()).process(wire).items
    assert text.cached_below == (16, 16) and text.cached_tokens == 39


def test_messages_without_the_fields_still_decode():
    class OldDelta(msgspec.Struct, kw_only=True):
        rid: str
        text: str
        token_ids: list[int]

    old = msgspec.msgpack.encode(OldDelta(rid="r", text="", token_ids=[1]))
    assert msgspec.msgpack.decode(old, type=TextDelta).cached_below == (0, 0)
    assert msgspec.msgpack.decode(old, type=TokenDelta).cached_below == (0, 0)
    out = GenerateOutput(
        rid="r", text="", token_ids=[], prompt_tokens=1, cached_tokens=0, finish_reason="stop"
    )
    assert out.cached_tokens_details is None


def test_server_info_sums_a_counter_only_some_replicas_have():
    zero = {"replica": 0, "hicache_block_tokens": 16, "hicache_host_blocks": 2}
    one = {**zero, "replica": 1, "hicache_storage_hit_tokens": 32}
    both = combine({0: zero, 1: one})
    assert both["hicache_storage_hit_tokens"] == 32 and both["hicache_host_blocks"] == 4
    assert both["hicache_block_tokens"] == 16  # a size, not a count


def scrape(stats: dict) -> dict[str, float]:
    text = ServerMetrics().render(stats).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()))] = s.value
    return out


def test_metrics_give_the_tiers_only_when_the_scheduler_reports_them():
    plain = {"kv_slots": 8, "replicas": [{"replica": 0, "kv_slots": 8}]}
    assert not any("hicache" in k for k in scrape(plain))
    host = {
        "hicache_host_hit_tokens": 48,
        "hicache_loaded_bytes": 4096,
        "hicache_load_s": 0.5,
        "hicache_host_blocks": 3,
        "hicache_host_capacity_blocks": 64,
        "hicache_block_tokens": 16,
    }
    m = scrape({**plain, **host, "replicas": [{"replica": 0, **host}, {"replica": 1, **host}]})
    assert m["radixrt:hicache_host_hit_tokens_total"] == 48
    assert m["radixrt:hicache_host_hit_tokens_total[replica=1]"] == 48
    assert m["radixrt:hicache_load_seconds_total"] == 0.5
    assert m["radixrt:hicache_host_blocks[replica=0]"] == 3
    assert m["radixrt:hicache_storage_hit_tokens_total"] == 0  # none loaded yet
    assert not any("hicache_storage_bytes" in k for k in m)  # no storage tier
    storage = {**host, "hicache_storage_bytes": 100, "hicache_storage_corrupt_blocks": 1}
    m = scrape({**plain, **storage, "replicas": [{"replica": 0, **storage}]})
    assert m["radixrt:hicache_storage_bytes"] == 100
    assert m["radixrt:hicache_storage_corrupt_blocks_total[replica=0]"] == 1
    assert m["radixrt:hicache_storage_write_errors_total"] == 0
