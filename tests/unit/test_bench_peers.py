"""bench/peers.py without servers: the workloads' shapes, the burst run's gate (through a fake
streaming backend and a fake Engine), the figures of a run and the issue's checks."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest


@pytest.fixture(scope="module")
def peers(bench_module):
    return bench_module("peers")


# ------------------------------------------------------------ workloads


def test_full_sizes_are_the_issue_workloads(peers):
    sz = peers.sizes(1.0)
    w1 = peers.make_workload("w1", sz, 49152, 0)
    assert len(w1.requests) == 32
    assert {len(r.ids) for r in w1.requests} == {544}
    assert len({tuple(r.ids[:512]) for r in w1.requests}) == 4  # 4 shared prefixes
    assert {r.max_new_tokens for r in w1.requests} == {32}
    w2 = peers.make_workload("w2", sz, 49152, 0)
    assert len(w2.requests) == 32 and {len(r.ids) for r in w2.requests} == {544}
    assert len({r.ids[0] for r in w2.requests}) > 16  # unrelated prompts
    assert all(r.at == 0 and not r.gated for r in w1.requests + w2.requests)
    single = peers.make_workload("single", sz, 49152, 0).requests
    assert [(len(r.ids), r.max_new_tokens) for r in single] == [(128, 256)]


def test_workloads_are_seeded(peers):
    sz = peers.sizes(0.25)
    a = peers.make_workload("w2", sz, 49152, 0)
    assert a == peers.make_workload("w2", sz, 49152, 0)
    assert a != peers.make_workload("w2", sz, 49152, 1)
    assert all(10 <= t < 49152 - 10 for r in a.requests for t in r.ids)


def test_poisson_arrivals(peers):
    sz = peers.sizes(1.0)
    wl = peers.make_workload("poisson", sz, 49152, 0, rate=4.0)
    ats = [r.at for r in wl.requests]
    assert len(ats) == 64 and ats == sorted(ats) and ats[0] > 0
    assert 64 / 4.0 * 0.6 < ats[-1] < 64 / 4.0 * 1.5  # about n / rate
    assert peers.sizes(1.0, poisson_requests=10).poisson_requests == 10
    with pytest.raises(ValueError, match="rate"):
        peers.make_workload("poisson", sz, 49152, 0)


def test_burst_shape(peers):
    wl = peers.make_workload("burst", peers.sizes(1.0), 49152, 0)
    streams = [r for r in wl.requests if not r.gated]
    assert [(len(r.ids), r.max_new_tokens) for r in streams] == [(128, 256)] * 4
    assert sum(r.gated for r in wl.requests) == 32 and wl.gate_tokens == 64


def test_llama_slots_hold_the_widest_workload(peers):
    sz = peers.sizes(1.0)
    wls = [peers.make_workload(w, sz, 100, 0, rate=1.0) for w in ("w1", "single", "burst")]
    slots, ctx = peers.llama_slots(wls)
    assert slots == 36 and ctx == 36 * (544 + 32 + 16)


# ------------------------------------------------------------ the gate


class FakeBackend:
    """Streams ``max_new_tokens`` chunks, one every ``gap`` s; notes when each request went."""

    def __init__(self, gap: float) -> None:
        self.gap, self.sent = gap, {}

    async def request(self, kwargs, sp, stream, rec):
        t0 = time.perf_counter()
        self.sent[tuple(kwargs["input_ids"])] = t0
        last = t0
        for _ in range(sp["max_new_tokens"]):
            await asyncio.sleep(self.gap)
            now = time.perf_counter()
            if rec.ttft:
                rec.itl.append(now - last)
            else:
                rec.ttft = now - t0
            last = now
            rec.output_tokens += 1
        return rec, "x" * rec.output_tokens


def test_gated_requests_wait_for_the_streams(peers):
    R = peers.Request
    wl = peers.Workload(
        "burst", [R([1], 20), R([2], 20), R([3], 2, gated=True), R([4], 2, 0.05, gated=True)], 5
    )
    backend = FakeBackend(0.005)
    run = asyncio.run(peers.run_client(backend, wl))
    first_stream_tokens = peers.token_times(run.samples[0])
    assert run.gate_at >= first_stream_tokens[4] - 1e-3  # 5 tokens streamed first
    assert run.gate_at < first_stream_tokens[-1]
    assert run.samples[2].sent >= run.gate_at
    assert run.samples[3].sent >= run.gate_at + 0.05
    assert [s.rec.output_tokens for s in run.samples] == [20, 20, 2, 2]


class FakeReq:
    def __init__(self, ids, params) -> None:
        self.prompt_ids, self.params = ids, params
        self.output_ids, self.first_token_at = [], None
        self.cached_tokens, self.error = 0, None

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.params.max_new_tokens


class FakeEngine:
    """A token per running request per step; notes which requests each step ran."""

    def __init__(self) -> None:
        self.reqs, self.steps = [], []

    def add_request(self, ids, params):
        self.reqs.append(FakeReq(ids, params))
        return self.reqs[-1]

    def step(self) -> None:
        time.sleep(0.002)
        running = [r for r in self.reqs if not r.finished]
        for r in running:
            r.output_ids.append(7)
            r.first_token_at = r.first_token_at or time.monotonic()
        self.steps.append([r.prompt_ids[0] for r in running])

    def make_output(self, req):
        return type("Out", (), {"text": "y" * len(req.output_ids)})()


def test_engine_run_opens_the_gate_after_the_streams_tokens(peers):
    R = peers.Request
    wl = peers.Workload("burst", [R([1], 10), R([2], 10), R([3], 3, gated=True)], 4)
    eng = FakeEngine()
    samples, gate_at = peers.EngineRun(eng, wl).run()
    joined = next(i for i, step in enumerate(eng.steps) if 3 in step)
    assert joined == 4  # after the streams' 4th token
    assert [s[1].output_tokens for s in samples] == [10, 10, 3]
    assert [len(s[1].itl) for s in samples] == [9, 9, 2]
    assert samples[2][0] >= gate_at > 0
    assert samples[0][2] == "y" * 10


def test_engine_run_waits_for_arrivals(peers):
    R = peers.Request
    wl = peers.Workload("poisson", [R([1], 2, 0.0), R([2], 2, 0.05)])
    samples, gate_at = peers.EngineRun(FakeEngine(), wl).run()
    assert gate_at is None
    assert samples[1][0] >= 0.05 and samples[1][1].ttft > 0


# ------------------------------------------------------------ figures


def sample(peers, sent, ttft, itl, out=None, error=None):
    rec = peers.serving.Record(
        prompt_tokens=10,
        output_tokens=len(itl) + 1 if out is None else out,
        ttft=ttft,
        itl=list(itl),
        latency=ttft + sum(itl),
        error=error,
    )
    return peers.Sample(sent, rec, "")


def test_summary_counts_short_and_failed_requests(peers):
    R = peers.Request
    wl = peers.Workload("w2", [R([1], 3), R([2], 3), R([3], 3)])
    run = peers.Run(
        [
            sample(peers, 0.0, 1.0, [0.5, 0.5]),
            sample(peers, 0.0, 2.0, [0.5], out=2),
            sample(peers, 0.0, 0.0, [], out=0, error="boom"),
        ],
        None,
    )
    s = peers.summarize(wl, run)
    assert (s["errors"], s["short"], s["wall_s"]) == (1, 1, 2.5)
    assert s["ttft_first_s"] == 1.0 and s["first_error"] == "boom"
    assert s["decode_tok_s"] == 2.0
    assert "itl_p99_ratio" not in s


def test_burst_summary_splits_the_streams_itl_at_the_gate(peers):
    """The streams' ITL alone starts once every stream has its first token: a gap during
    another stream's prefill is start-up, not streaming alone."""
    R = peers.Request
    wl = peers.Workload("burst", [R([1], 6), R([1], 3), R([2], 2, gated=True)], 2)
    stream = sample(peers, 0.0, 0.1, [0.3, 0.1, 0.5, 0.5, 0.5])  # at .1 .4 .5 1.0 1.5 2.0
    late = sample(peers, 0.0, 0.2, [0.1, 0.1])  # at .2 .3 .4: the gap .1 -> .4 is start-up
    burst = sample(peers, 0.5, 0.4, [0.6])  # from 0.5 to 1.5
    s = peers.burst_summary(wl, peers.Run([stream, late, burst], 0.5))
    assert s["itl_alone_p99_ms"] == pytest.approx(100) and s["itl_burst_samples"] == 2
    assert s["itl_burst_p99_ms"] == pytest.approx(500)
    assert s["itl_p99_ratio"] == pytest.approx(5.0)
    assert s["burst_ttft_first_s"] == pytest.approx(0.4)


# ------------------------------------------------------------ checks


def summary(wall, ttft_p50=1.0, first=0.5):
    return {"wall_s": wall, "ttft_p50_s": ttft_p50, "ttft_first_s": first, "errors": 0}


def test_checks_against_vllms_better_dtype(peers):
    book = peers.Book()
    book.runs = {
        "radixrt-http": {"w1": [summary(4.0)], "w2": [summary(10.0, ttft_p50=2.0)]},
        "radixrt-engine": {"w1": [summary(3.8)], "w2": [summary(11.0)]},
        "vllm-fp32": {"w1": [summary(8.0)], "w2": [summary(20.0, ttft_p50=5.0)]},
        "vllm-bf16": {"w1": [summary(5.0)], "w2": [summary(40.0, ttft_p50=3.0)]},
    }
    got = {c.name: c for c in peers.checks(book)}
    w1 = got["radixrt-http w1 throughput / vLLM's best"]
    assert w1.value == pytest.approx(5.0 / 4.0) and not w1.passed
    w2 = got["radixrt-http w2 throughput / vLLM's best"]
    assert w2.value == pytest.approx(2.0) and w2.passed
    ttft = got["radixrt-http w2 TTFT p50 / vLLM's best"]
    assert ttft.value == pytest.approx(2.0 / 3.0) and not ttft.passed
    front = got["radixrt-http / engine throughput, w1"]
    assert front.value == pytest.approx(3.8 / 4.0) and front.passed
    assert not got["radixrt-http / engine throughput, w2"].value < 1.0


def test_paired_ratio_is_the_median_of_the_repeats(peers):
    runs = {
        "a": {"w1": [summary(1.0), summary(2.0), summary(1.0)]},
        "b": {"w1": [summary(1.0), summary(1.0), summary(3.0)]},
    }
    assert peers.paired_ratio(runs, "a", "b", "w1") == pytest.approx(1.0)
    assert peers.paired_ratio(runs, "a", "b", "w2") is None


def test_differing_outputs_are_counted(peers):
    R = peers.Request
    wl = peers.Workload("w2", [R([1], 1), R([2], 1)])
    book = peers.Book()
    for target, texts in (("radixrt-http", "ab"), ("radixrt-rpc", "ab"), ("radixrt-engine", "ac")):
        samples = [peers.Sample(0.0, peers.serving.Record(output_tokens=1), t) for t in texts]
        book.add(target, wl, peers.Run(samples, None))
    book.add(
        "vllm-fp32", wl, peers.Run([peers.Sample(0.0, peers.serving.Record(), "zz")] * 2, None)
    )
    assert book.differing() == {"differing": 1, "by_workload": {"w2": (1, 2)}}
    assert not {c.name: c for c in peers.checks(book)}["radixrt outputs differing"].passed


def test_table_marks_missing_workloads(peers):
    book = peers.Book()
    book.runs = {"vllm-fp32": {"w1": [summary(8.0) | {"short": 1}]}}
    row = peers.table(book).splitlines()[2]
    assert row.startswith("| vllm-fp32 | 8.00 | 1.000 | - |") and row.endswith("| 1 |")


def test_cpu_list(peers, monkeypatch):
    monkeypatch.setattr(peers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5, 8, 9})
    assert peers.cpu_list() == "0-2,5,8-9"


# ------------------------------------------------------------ --isa avx2


def test_avx2_site_hides_avx512_from_a_peer(peers):
    """A process on avx2_site()'s path sees no AVX-512 or AMX through torch.cpu (where vLLM
    picks its extension and attention)."""
    import subprocess

    probe = (
        "import torch.cpu as c; print(c._is_avx512_supported(), "
        "c._is_avx512_bf16_supported(), c._is_amx_tile_supported())"
    )
    env = peers.peer_env(PYTHONPATH=str(peers.avx2_site()))
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False", "False"]


def test_isa_avx2_refuses_llama_server(peers, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--isa", "avx2", "--targets", "radixrt-engine,llama-server"])
    assert "llama-server" in capsys.readouterr().err
    assert peers.parse_args(["--isa", "avx2", "--targets", "radixrt-engine"]).isa == "avx2"


def test_isa_avx2_runs_the_script_again_narrowed(peers, monkeypatch):
    calls = []
    monkeypatch.setattr(peers.os, "execve", lambda *a: calls.append(a))
    for k in peers.AVX2_ENV:
        monkeypatch.delenv(k, raising=False)
    peers.narrowed_to_avx2(["--isa", "avx2"])
    ((exe, argv, env),) = calls
    assert argv[1:] == [peers.__file__, "--isa", "avx2"] and env.items() >= peers.AVX2_ENV.items()
    for k, v in peers.AVX2_ENV.items():
        monkeypatch.setenv(k, v)
    peers.narrowed_to_avx2(["--isa", "avx2"])  # already narrowed: runs on
    assert len(calls) == 1


def test_mapped_libraries_of_a_process_tree(peers):
    """A library loaded by a grandchild is found from the top process (vLLM's engine core
    runs in a child of its server)."""
    import subprocess

    child = f"{sys.executable} -c 'import _decimal, time; print(1, flush=True); time.sleep(60)'"
    proc = subprocess.Popen(["sh", "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"
        assert any(n.startswith("_decimal") for n in peers.mapped_libraries(proc.pid, "_decimal"))
        assert peers.mapped_libraries(proc.pid, "no-such-library") == []
    finally:
        subprocess.run(["pkill", "-P", str(proc.pid)])
        proc.kill()
        proc.wait()
