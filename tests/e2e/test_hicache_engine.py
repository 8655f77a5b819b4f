"""The hierarchical cache through the Engine (tiny model, float32, greedy): the same outputs
whether a prefix stayed on the device, came back from host memory or storage, or was
recomputed with the cache off; and whatever happens to the storage directory."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from radixrt import Engine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
# Two groups of three prompts; each group shares a 64-token prefix.
PREFIXES = [[(11 * g + 5 * i) % 1900 + 40 for i in range(64)] for g in range(2)]
GROUPS = [[prefix + [7 + q, 100 + q, 200 + q] for q in range(3)] for prefix in PREFIXES]
POOL = 128  # tokens: one group's prompts and outputs fit, not both


def run(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    eng.check_memory()
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[list[int]]]:
    with Engine(model=tiny_llama, dtype="float32", disable_radix_cache=True) as eng:
        return [run(eng, group) for group in GROUPS]


def tiered(model: str, page: int, storage, **kw) -> Engine:
    return Engine(
        model=model,
        dtype="float32",
        page_size=page,
        max_total_tokens=POOL,
        enable_hierarchical_cache=True,
        hicache_storage_dir=str(storage),
        **kw,
    )


@pytest.mark.parametrize("page", [1, 16])
def test_outputs_are_the_same_from_every_tier(tiny_llama, tmp_path, reference, page):
    with Engine(model=tiny_llama, dtype="float32", page_size=page) as eng:  # kept on the device
        for _ in range(2):
            assert [run(eng, g) for g in GROUPS] == reference
        assert eng.stats()["cached_tokens"] > 0
    with tiered(tiny_llama, page, tmp_path) as eng:
        for _ in range(2):  # each group evicts the other: the second round loads from host
            assert [run(eng, g) for g in GROUPS] == reference
        stats = eng.stats()
        assert stats.get("hicache_host_hit_tokens", 0) >= 2 * 48
        assert stats["evicted_tokens"] > 0
    with tiered(tiny_llama, page, tmp_path, hicache_size=1e-6) as eng:  # a restart: storage
        assert [run(eng, g) for g in GROUPS] == reference
        stats = eng.stats()
        assert stats.get("hicache_storage_hit_tokens", 0) >= 2 * 48
        assert stats["prefill_tokens"] < stats["prompt_tokens"] / 2


def test_write_back_outputs_match(tiny_llama, tmp_path, reference):
    with tiered(tiny_llama, 1, tmp_path, hicache_write_policy="write_back") as eng:
        for _ in range(2):
            assert [run(eng, g) for g in GROUPS] == reference
        assert eng.stats().get("hicache_host_hit_tokens", 0) >= 2 * 48
    with tiered(tiny_llama, 1, tmp_path) as eng:  # the host blocks were flushed at shutdown
        assert [run(eng, g) for g in GROUPS] == reference
        assert eng.stats().get("hicache_storage_hit_tokens", 0) >= 2 * 48


def fill(model: str, storage) -> list:
    """Serve every group once with a storage tier; the files it wrote."""
    with tiered(model, 1, storage) as eng:
        for group in GROUPS:
            run(eng, group)
    files = sorted(storage.glob("*/*.kv"))
    assert len(files) >= 6
    return files


def test_waiting_requests_have_their_blocks_read_ahead(tiny_llama, tmp_path, reference):
    fill(tiny_llama, tmp_path)
    with tiered(tiny_llama, 1, tmp_path, hicache_size=1e-6, max_running_requests=1) as eng:
        # one call: the second group waits while the first runs
        assert run(eng, GROUPS[0] + GROUPS[1]) == reference[0] + reference[1]
        stats = eng.stats()
        assert stats["hicache_storage_prefetched_blocks"] > 0
        assert stats["hicache_storage_hit_tokens"] >= 2 * 48


def test_damaged_files_are_recomputed(tiny_llama, tmp_path, reference):
    files = fill(tiny_llama, tmp_path)
    raw = files[0].read_bytes()
    files[0].write_bytes(raw[: len(raw) // 3])  # truncated
    raw = bytearray(files[1].read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit flipped
    files[1].write_bytes(bytes(raw))
    files[2].write_bytes(b"")  # a torn write's empty file
    with tiered(tiny_llama, 1, tmp_path, hicache_size=1e-6) as eng:
        assert [run(eng, g) for g in GROUPS] == reference
        stats = eng.stats()
        assert stats.get("hicache_storage_corrupt_blocks", 0) >= 1
        assert stats.get("hicache_storage_hit_tokens", 0) > 0  # the intact files still served


def test_a_removed_directory_is_recomputed_and_made_again(tiny_llama, tmp_path, reference):
    fill(tiny_llama, tmp_path)
    with tiered(tiny_llama, 1, tmp_path, hicache_size=1e-6) as eng:
        shutil.rmtree(tmp_path)  # gone under a running engine
        assert [run(eng, g) for g in GROUPS] == reference
        assert [run(eng, g) for g in GROUPS] == reference
    assert list(tmp_path.glob("*/*.kv"))  # written anew


def test_a_read_only_directory_still_serves(tiny_llama, tmp_path, reference):
    storage = tmp_path / "kv"
    storage.mkdir()
    storage.chmod(0o555)
    immutable = subprocess.run(["chattr", "+i", str(storage)], capture_output=True).returncode == 0
    try:
        if (storage / "probe").exists() or _writable(storage):
            pytest.skip("cannot make a directory read-only here")
        with tiered(tiny_llama, 1, storage) as eng:
            for _ in range(2):
                assert [run(eng, g) for g in GROUPS] == reference
            assert eng.stats().get("hicache_storage_write_errors", 0) > 0
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(storage)], check=False)
        storage.chmod(0o755)


def _writable(path) -> bool:
    try:
        (path / "probe").touch()
    except OSError:
        return False
    (path / "probe").unlink()
    return True


def test_the_storage_limit_holds(tiny_llama, tmp_path, reference):
    limit_gb = 3 * (16 * 4096 + 64) / 1e9  # three blocks of the tiny model
    with tiered(tiny_llama, 1, tmp_path, hicache_size=1e-6, hicache_storage_size=limit_gb) as eng:
        for _ in range(2):
            assert [run(eng, g) for g in GROUPS] == reference
        eng.scheduler.kv.hicache.storage.flush()
        stats = eng.stats()
        assert stats.get("hicache_storage_bytes", 0) <= limit_gb * 1e9
        assert stats.get("hicache_storage_deleted_blocks", 0) > 0
    assert len(list(tmp_path.glob("*/*.kv"))) <= 3


def test_bad_settings_name_the_problem(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="hicache_storage_dir needs enable_hierarchical_cache"):
        Engine(model=tiny_llama, hicache_storage_dir=str(tmp_path))
    with pytest.raises(ValueError, match="hicache_write_policy"):
        Engine(model=tiny_llama, enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="hicache_ratio"):
        Engine(model=tiny_llama, enable_hierarchical_cache=True, hicache_ratio=0)
