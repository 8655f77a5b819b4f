"""Prometheus metrics of the server (``GET /metrics``), with ``prometheus-client``.

Two sources, read where they already are:
- the TokenizerManager observes every request it answers (ZeroMQ and HTTP
  alike): finished requests by finish reason, prompt / cached / generated
  tokens, and the TTFT, inter-token and end-to-end latency histograms (and
  with speculative decoding, each drafted request's tokens per verification);
- the scheduler's ``server_info`` counters and gauges, fetched once per
  scrape (``SchedulerCollector``): hit rate, evicted tokens, KV slots free /
  evictable / protected, running and waiting requests; with the hierarchical
  cache (only then), the tokens and bytes loaded from its host and storage
  tiers, the seconds loading took, the blocks each tier holds and the storage
  tier's writes, reads and failures; with speculative decoding (only then),
  the verification steps and the draft tokens verified and accepted. Nothing
  on the decode path waits for a scrape beyond answering that one control
  message between two steps. Each is
  given for the whole server (no labels) and for each data-parallel replica
  (label ``replica``), beside the front's view of each replica: whether it
  serves, the requests routed to it, the prompt tokens waiting there and the
  tokens its mirrored tree holds.

Every name starts with ``radixrt:``, as SGLang's start with ``sglang:``.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: the process start time says as much

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TOKEN_GAP_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)

ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 32.0, 65.0)

# server_info key -> (metric name, help); counters, then gauges
SCHEDULER_COUNTERS = {
    "evicted_tokens": ("radixrt:evicted_tokens", "Tokens evicted from the prefix cache"),
    "prefill_tokens": (
        "radixrt:prefill_tokens",
        "Prompt tokens computed (not served from the cache)",
    ),
    "retractions": ("radixrt:retractions", "Running requests retracted for lack of KV"),
}
SCHEDULER_GAUGES = {
    "hit_rate": ("radixrt:cache_hit_rate", "Cached share of all prompt tokens so far"),
    "kv_slots": ("radixrt:kv_slots", "KV slots in the pool"),
    "free_slots": ("radixrt:kv_slots_free", "KV slots on the free list"),
    "evictable_tokens": ("radixrt:kv_slots_evictable", "KV slots held by unlocked cached prefixes"),
    "protected_tokens": (
        "radixrt:kv_slots_protected",
        "KV slots held by prefixes running requests lock",
    ),
    "cache_tokens": ("radixrt:cache_tokens", "Tokens held by the radix tree"),
    "running": ("radixrt:num_running_reqs", "Requests running in the scheduler"),
    "waiting": ("radixrt:num_waiting_reqs", "Requests waiting in the scheduler"),
}

# With the hierarchical cache (given only when the scheduler reports them): its host tier ...
HICACHE_COUNTERS = {
    "hicache_host_hit_tokens": (
        "radixrt:hicache_host_hit_tokens",
        "Prompt tokens loaded from the host tier instead of computed",
    ),
    "hicache_storage_hit_tokens": (
        "radixrt:hicache_storage_hit_tokens",
        "Prompt tokens loaded from the storage tier instead of computed",
    ),
    "hicache_loaded_bytes": (
        "radixrt:hicache_loaded_bytes",
        "KV bytes read from the host and storage tiers",
    ),
    "hicache_load_s": (
        "radixrt:hicache_load_seconds",
        "Seconds spent loading KV from the host and storage tiers",
    ),
}
HICACHE_GAUGES = {
    "hicache_host_blocks": ("radixrt:hicache_host_blocks", "KV blocks held in the host tier"),
    "hicache_host_capacity_blocks": (
        "radixrt:hicache_host_capacity_blocks",
        "KV blocks the host tier can hold",
    ),
}
# ... and its storage tier (with --hicache-storage-dir)
STORAGE_COUNTERS = {
    "hicache_storage_written_blocks": (
        "radixrt:hicache_storage_written_blocks",
        "KV blocks written to the storage tier",
    ),
    "hicache_storage_read_blocks": (
        "radixrt:hicache_storage_read_blocks",
        "KV blocks read from the storage tier",
    ),
    "hicache_storage_corrupt_blocks": (
        "radixrt:hicache_storage_corrupt_blocks",
        "Storage files that failed a check (recomputed and deleted)",
    ),
    "hicache_storage_write_errors": (
        "radixrt:hicache_storage_write_errors",
        "Storage writes that failed (the block was not stored)",
    ),
}
STORAGE_GAUGES = {
    "hicache_storage_blocks": ("radixrt:hicache_storage_blocks", "KV blocks in the storage tier"),
    "hicache_storage_bytes": ("radixrt:hicache_storage_bytes", "Bytes of the storage tier's files"),
}
# With speculative decoding (--speculative-algorithm)
SPEC_COUNTERS = {
    "spec_verify_ct": ("radixrt:spec_verify_steps", "Verification forwards of drafted requests"),
    "spec_draft_tokens": ("radixrt:spec_draft_tokens", "Draft tokens verified"),
    "spec_accepted_tokens": ("radixrt:spec_accepted_tokens", "Draft tokens accepted"),
}
# each table pair, and the server_info key whose presence says the scheduler reports it
SCHEDULER_TABLES = (
    (None, SCHEDULER_COUNTERS, SCHEDULER_GAUGES),
    ("spec_verify_ct", SPEC_COUNTERS, {}),
    ("hicache_host_capacity_blocks", HICACHE_COUNTERS, HICACHE_GAUGES),
    ("hicache_storage_bytes", STORAGE_COUNTERS, STORAGE_GAUGES),
)

# the front's view of each replica: key of ``ReplicaView`` -> (metric name, help, is a counter)
REPLICA_METRICS = {
    "up": ("radixrt:replica_up", "1 while the replica serves", False),
    "routed": ("radixrt:routed_requests", "Requests the front sent to the replica", True),
    "waiting_tokens": (
        "radixrt:routing_waiting_tokens",
        "Prompt tokens routed to the replica and not yet prefilled",
        False,
    ),
    "mirror_tokens": (
        "radixrt:mirror_cache_tokens",
        "Tokens in the front's mirror of the replica's radix tree",
        False,
    ),
}


class SchedulerCollector:
    """Yields the scheduler's figures from the ``server_info`` taken for this scrape, in total
    and per replica, and the front's ``replica_views`` (dicts with ``REPLICA_METRICS`` keys)."""

    def __init__(self) -> None:
        self.stats: dict = {}
        self.replica_views: list[dict] = []

    def collect(self):
        for marker, counters, gauges in SCHEDULER_TABLES:
            if marker is None or marker in self.stats:
                yield from self.families(counters, CounterMetricFamily)
                yield from self.families(gauges, GaugeMetricFamily)
        for key, (name, doc, counter) in REPLICA_METRICS.items():
            metric = (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, doc, labels=["replica"]
            )
            for view in self.replica_views:
                metric.add_metric([str(view["replica"])], float(view[key]))
            yield metric

    def families(self, table: dict, family: type):
        """One metric per ``table`` entry: the server's figure (no labels) and each replica's."""
        per_replica = self.stats.get("replicas", [])
        for key, (name, doc) in table.items():
            metric = family(name, doc, labels=["replica"])
            total = metric.name + ("_total" if family is CounterMetricFamily else "")
            metric.add_sample(total, {}, float(self.stats.get(key, 0)))
            for r in per_replica:
                metric.add_metric([str(r.get("replica", 0))], float(r.get(key, 0)))
            yield metric


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "radixrt:requests",
            "Finished requests by finish reason",
            ["finish_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "radixrt:prompt_tokens", "Prompt tokens of finished requests", registry=reg
        )
        self.cached_tokens = Counter(
            "radixrt:cached_tokens", "Prompt tokens served from the prefix cache", registry=reg
        )
        self.generation_tokens = Counter(
            "radixrt:generation_tokens", "Generated tokens", registry=reg
        )
        self.ttft = Histogram(
            "radixrt:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "radixrt:inter_token_latency_seconds",
            "Time between two output tokens",
            buckets=TOKEN_GAP_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "radixrt:e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.spec_accept_length = Histogram(
            "radixrt:spec_accept_length",
            "Per finished drafted request: tokens emitted per verification (accepted + 1)",
            buckets=ACCEPT_LENGTH_BUCKETS,
            registry=reg,
        )
        self.scheduler = SchedulerCollector()
        reg.register(self.scheduler)

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_tokens(self, gap: float, count: int) -> None:
        """``count`` tokens that arrived ``gap`` seconds after the previous ones."""
        per_token = gap / count
        for _ in range(count):
            self.itl.observe(per_token)

    def on_finish(
        self,
        reason: str,
        prompt: int,
        cached: int,
        generated: int,
        latency: float,
        spec_verify_ct: int = 0,
        spec_accepted_tokens: int = 0,
    ) -> None:
        if spec_verify_ct:
            self.spec_accept_length.observe(1 + spec_accepted_tokens / spec_verify_ct)
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        self.e2e.observe(latency)

    def render(self, scheduler_stats: dict, replica_views: list[dict] = ()) -> bytes:
        self.scheduler.stats = scheduler_stats
        self.scheduler.replica_views = list(replica_views)
        return generate_latest(self.registry)
