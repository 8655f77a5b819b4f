"""The hierarchical cache through a real server: what a restart keeps, what the outputs and
/metrics say about it, and a scheduler killed while it writes to storage.

Prompts are token ids (blocks of the lower tiers are 16 tokens); the device pool is small
(``--max-total-tokens``), so the first prompts of a round are evicted by the later ones.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server, assert_idle_kv, wait_idle

import radixrt
from radixrt.cache.hicache import block_keys
from radixrt.client import Client
from radixrt.testing import tiny_model_path

POOL = "512"
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
BLOCK = 16  # tokens per lower-tier block (page size 1)


def prompt(i: int, n: int = 100) -> list[int]:
    """A prompt of n token ids of its own (no two prompts share a block)."""
    return np.random.default_rng(i).integers(3, 2000, n).tolist()


PROMPTS = [prompt(i) for i in range(8)]


def hicache_server(storage: Path, *extra: str) -> Server:
    return Server(
        "--max-total-tokens",
        POOL,
        "--enable-hierarchical-cache",
        "--hicache-storage-dir",
        str(storage),
        *extra,
    )


def stop_cleanly(srv: Server) -> None:
    """SIGTERM, as the harness stops a server; the launcher exits 0 after the drain."""
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(20) == 0


def metrics(srv: Server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(srv.http + "/metrics").text):
        for s in family.samples:
            out[s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()))] = s.value
    return out


def reference(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs without the hierarchical cache."""
    with radixrt.Engine(model=tiny_model_path("llama"), dtype="float32") as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=radixrt.SamplingParams(**GREEDY))
    return [list(o.token_ids) for o in outs]


# ------------------------------------------------------------------ restart


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A write_back server that answered PROMPTS, stopped with SIGTERM, and a new server on the
    same storage directory: (the new server, the first server's outputs)."""
    storage = tmp_path_factory.mktemp("kv")
    first = hicache_server(storage, "--hicache-write-policy", "write_back")
    try:
        with Client(first.address, timeout=60) as c:
            before = [c.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS]
            info = wait_idle(c)
        # The host tier kept every evicted block: nothing reached storage before the stop.
        assert info["hicache_host_blocks"] > 0
        assert info.get("hicache_storage_written_blocks", 0) == 0
        stop_cleanly(first)
    finally:
        first.stop()
    assert list(storage.glob("*/*.kv"))  # written on the way out
    second = hicache_server(storage)
    yield second, [list(o.token_ids) for o in before]
    second.stop()


def test_a_restarted_server_loads_the_prefix_from_storage(restarted):
    srv, before = restarted
    with Client(srv.address, timeout=60) as c:
        out = c.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out.cached_tokens == 96  # the prompt's whole blocks before its last token
        assert out.cached_tokens_details == {"device": 0, "host": 0, "storage": 96}
        assert list(out.token_ids) == before[0]
        again = c.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert again.cached_tokens_details == {"device": 99, "host": 0, "storage": 0}
        assert list(again.token_ids) == before[0]
        stream = list(c.generate(input_ids=PROMPTS[0][:50], sampling_params=GREEDY, stream=True))
        assert stream[-1].cached_tokens_details == {"device": 49, "host": 0, "storage": 0}
        assert_idle_kv(c)


def test_generate_meta_info_and_metrics_show_the_tiers(restarted):
    srv, before = restarted
    body = {"input_ids": PROMPTS[1], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    meta = httpx.post(srv.http + "/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["cached_tokens"] == 96
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 96}
    m = metrics(srv)
    assert m["radixrt:hicache_storage_hit_tokens_total"] >= 96
    assert m["radixrt:hicache_storage_hit_tokens_total[replica=0]"] >= 96
    assert m["radixrt:hicache_storage_read_blocks_total"] >= 6
    assert (
        m["radixrt:hicache_loaded_bytes_total"] > 0 and m["radixrt:hicache_load_seconds_total"] > 0
    )
    assert m["radixrt:hicache_host_hit_tokens_total"] == 0
    assert m["radixrt:hicache_storage_corrupt_blocks_total"] == 0
    assert m["radixrt:hicache_storage_write_errors_total"] == 0
    assert m["radixrt:hicache_host_blocks"] >= 6  # the loaded blocks were promoted to host
    assert 0 < m["radixrt:hicache_host_blocks"] <= m["radixrt:hicache_host_capacity_blocks"]
    assert m["radixrt:hicache_storage_bytes"] > 0 and m["radixrt:hicache_storage_blocks"] > 0
    assert "radixrt:hicache_storage_written_blocks_total" in m


# ------------------------------------------------------------------ a kill mid-write


def block_file(storage: Path, tokens: list[int], j: int) -> Path:
    """The storage file of block j of tokens (no cache salt)."""
    (model_dir,) = [d for d in storage.iterdir() if d.is_dir()]
    key = block_keys(np.asarray(tokens, dtype=np.int64), j + 1, BLOCK, None)[j]
    return model_dir / f"{key.hex()}.kv"


def kill_while_writing(storage: Path, prompts: list[list[int]]) -> int:
    """A write_back server with a tiny host tier gets prompts, all at once; its scheduler is
    SIGKILLed once the storage tier has written some blocks while requests still run. The
    killed scheduler's pid."""
    srv = hicache_server(
        storage, "--hicache-write-policy", "write_back", "--hicache-size", "0.0003"
    )
    try:
        with Client(srv.address, timeout=60) as c, Client(srv.address, timeout=60) as load:
            pid = c.server_info()["pids"]["scheduler"]
            for p in prompts:  # sent now, never read: the scheduler dies under them
                load.generate(input_ids=p, sampling_params=GREEDY, stream=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                info = c.server_info()
                if info.get("hicache_storage_written_blocks", 0) >= 12 and info["running"]:
                    break
            else:
                pytest.fail(f"no storage writes while requests ran: {info}")
            os.kill(pid, signal.SIGKILL)
        assert srv.proc.wait(20) != 0
    finally:
        srv.stop()
    return pid


def test_a_scheduler_killed_mid_write_back_leaves_a_usable_directory(tmp_path, engine_factory):
    storage = tmp_path / "kv"
    prompts = [prompt(i, 100 + i) for i in range(24)]
    want = reference(prompts)
    pid = kill_while_writing(storage, prompts)
    stored = [p for p in prompts if block_file(storage, p, 0).exists()]
    assert len(stored) >= 2
    # What a kill can leave at worst: the dead writer's temporary file, a damaged block.
    damaged = block_file(storage, stored[0], 0)
    damaged.write_bytes(b"torn")
    stale = damaged.with_name(f"{block_file(storage, stored[1], 0).name}.{pid}.tmp")
    stale.write_bytes(b"half a block")

    srv = hicache_server(storage, "--hicache-write-policy", "write_back")
    try:
        with Client(srv.address, timeout=60) as c:
            got = c.generate_batch(input_ids=prompts, sampling_params=GREEDY)
            assert [list(o.token_ids) for o in got] == want
            info = assert_idle_kv(c)
            assert info["hicache_storage_corrupt_blocks"] == 1
            assert info["hicache_storage_hit_tokens"] > 0
        assert not stale.exists()
        assert not damaged.exists() or damaged.stat().st_size > len(b"torn")  # written anew
        stop_cleanly(srv)
    finally:
        srv.stop()

    eng = engine_factory(
        tiny_model_path("llama"),
        max_total_tokens=int(POOL),
        enable_hierarchical_cache=True,
        hicache_storage_dir=str(storage),
    )
    outs = eng.generate(input_ids=prompts[:8], sampling_params=radixrt.SamplingParams(**GREEDY))
    assert [list(o.token_ids) for o in outs] == want[:8]
    assert eng.stats()["hicache_storage_hit_tokens"] > 0
    eng.check_memory()
