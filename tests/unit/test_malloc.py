"""A CPU ModelRunner has glibc keep freed large blocks for reuse (``keep_freed_memory``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only"
)

# Frees and re-allocates three 8 MiB blocks; prints the page faults of 4 such rounds.
PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    if sys.argv[1] == "tuned":
        from radixrt.model.runner import keep_freed_memory
        assert keep_freed_memory()
    def round_trip():
        blocks = [np.ones(8 << 20, dtype=np.uint8) for _ in range(3)]
        del blocks
    round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        round_trip()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return int(out.stdout.split()[-1])


@linux_only
def test_freed_blocks_are_reused_without_page_faults() -> None:
    default = _faults("default")  # glibc's adaptive thresholds: each round maps fresh pages
    if default < 1000:
        pytest.skip(
            f"this libc reuses freed 8 MiB blocks by default ({default} faults): nothing to show"
        )
    assert _faults("tuned") < 100


@linux_only
def test_cpu_engine_tunes_malloc(tiny_llama: str) -> None:
    from radixrt import Engine

    with Engine(model=tiny_llama, dtype="float32", max_total_tokens=256) as eng:
        assert eng.runner.malloc_tuned
