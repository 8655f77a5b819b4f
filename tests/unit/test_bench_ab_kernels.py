"""bench/ab_kernels.py: two builds of this tree's kernels (the same flags: one library) give
the same outputs in every case, and a folder without the kernels' sources is refused."""

from __future__ import annotations

import json

import pytest

from radixrt_kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(
    cpu_library.compiler() is None,
    reason="no C compiler: the CPU kernels cannot be built here",
)


@pytest.fixture(scope="module")
def ab(bench_module):
    return bench_module("ab_kernels")


def test_a_null_ab_runs_every_case_with_equal_outputs(ab, tmp_path):
    out = tmp_path / "ab.json"
    argv = ["--rows", "1", "3", "--runs", "2", "--requests", "3", "--keys", "96"]
    rows = ab.main([*argv, "--out", str(out)])
    cases = [r["case"] for r in rows]
    assert len(cases) == 6 and cases[0].startswith("linear") and cases[-1].startswith("attention")
    kinds = [c.split(",")[0].split()[-1] for c in cases[2:]]
    assert kinds == ["decode", "decode", "extend", "prefill"]
    assert all(r["same"] and r["a_ms"] > 0 and r["b_ms"] > 0 for r in rows)
    assert json.loads(out.read_text())["cases"] == rows


def test_a_folder_without_the_sources_is_refused(ab, tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        ab.build(tmp_path, "")
