"""bench/gpu_check.py's CPU-side logic: it refuses loudly without the device it was asked for,
judges Triton against torch by its stated rule, counts kernel test outcomes, and writes its
JSON and table. (Its greedy and serving steps run on CPU in tests/e2e/test_gpu_check_on_cpu.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # torch sees no CUDA device, GPU or not


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gc = _load()


def test_an_absent_device_fails_loudly_and_runs_nothing(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cuda", "--out", str(tmp_path)],
        env=NO_GPU,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--device cuda was requested" in proc.stderr and "nothing was run" in proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] is False and report["steps"] == [] and report["device"] is None
    assert "FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_the_shell_script_passes_its_flags_and_fails_without_a_gpu(tmp_path) -> None:
    env = {**NO_GPU, "RADIXRT_SKIP_INSTALL": "1", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--out", str(tmp_path), "--steps", "kernels"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["config"]["device"] == "cuda" and report["config"]["steps"] == ["kernels"]


def test_unknown_steps_and_dtypes_are_refused_by_name(capsys) -> None:
    with pytest.raises(SystemExit):
        gc.parse_args(["--steps", "kernels,greedyy"])
    assert "unknown step 'greedyy'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.parse_args(["--dtypes", "float8"])
    assert "unknown dtype 'float8'" in capsys.readouterr().err


def _run(backend: str, ids: list[list[int]], gap: float = 5.0, drift: float = 0.0) -> dict:
    """A greedy run: two passes of the same outputs; every logprob -1 - drift."""
    outs = [
        {"ids": s, "logprobs": [-1.0 - drift] * len(s), "top2_gap": [gap] * len(s), "cached": 7}
        for s in ids
    ]
    return {"backend": backend, "passes": [outs, outs]}


def test_the_comparison_passes_equal_runs_and_names_each_figure() -> None:
    fig = gc.compare_runs(_run("torch", [[1, 2, 3]]), _run("triton", [[1, 2, 3]]), 1e-3)
    assert fig["passed"] and fig["sequences"] == 2 and fig["differ"] == 0
    assert fig["cached_tokens"] == {"torch": 14, "triton": 14} and fig["max_abs_dlogprob"] == 0.0


def test_a_different_token_passes_only_at_a_near_tie() -> None:
    got = _run("triton", [[1, 2, 9]])
    fig = gc.compare_runs(_run("torch", [[1, 2, 3]], gap=1e-4), got, 1e-3)
    assert fig["passed"] and fig["differ"] == 2 and fig["near_ties"] == 2
    fig = gc.compare_runs(_run("torch", [[1, 2, 3]], gap=0.5), got, 1e-3)
    assert not fig["passed"] and fig["differ"] == 2 and fig["near_ties"] == 0


@pytest.mark.parametrize(
    "got",
    [
        _run("triton", [[1, 2, 3]], drift=0.01),  # logprobs beyond tolerance
        _run("torch", [[1, 2, 3]]),  # the "triton" run did not run Triton
        _run("triton", [[1, 2]]),  # a shorter output
    ],
)
def test_a_drifted_or_mislabelled_run_fails(got) -> None:
    assert not gc.compare_runs(_run("torch", [[1, 2, 3]]), got, 1e-3)["passed"]


def test_without_cache_hits_the_comparison_fails() -> None:
    ref, got = _run("torch", [[1]]), _run("triton", [[1]])
    for run in (ref, got):
        for p in run["passes"]:
            p[0] = {**p[0], "cached": 0}
    assert not gc.compare_runs(ref, got, 1e-3)["passed"]


def test_the_kernel_step_counts_outcomes_and_fails_on_a_failure(tmp_path) -> None:
    (tmp_path / "test_k.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False, 'kernel mismatch'\n"
        "def test_skip(): pytest.skip('index values are checked only for CPU tensors')\n"
    )
    args = gc.parse_args(["--device", "cpu", "--kernel-tests", str(tmp_path)])
    row = gc.run_kernels(args, tmp_path, "kernels")
    assert not row.passed and row.summary == "1 passed, 1 failed, 1 skipped"
    (failed,) = row.figures["failed_tests"]  # its module named from pytest's rootdir
    assert failed.endswith("test_k::test_bad") and "kernel mismatch" in row.error
    assert "only for CPU tensors" in row.figures["skip_reasons"][0]
    (tmp_path / "test_k.py").write_text("def test_ok(): pass\n")
    assert gc.run_kernels(args, tmp_path, "kernels").passed


def test_steps_past_the_budget_fail_as_not_run(tmp_path) -> None:
    args = gc.parse_args(["--device", "cpu", "--budget-s", "0", "--out", str(tmp_path)])
    report = {"config": {"device": "cpu"}, "environment": {}, "device": {}, "steps": []}
    gc.run_steps(args, report)
    names = ["kernels", "quant", "greedy tiny float32", "greedy tiny bfloat16"]
    names += ["greedy smollm2 float32", "greedy smollm2 bfloat16", "serving shared-prefix smollm2"]
    assert [s["name"] for s in report["steps"]] == names
    assert not any(s["passed"] for s in report["steps"]) and report["passed"] is False
    assert all(s["error"].startswith("not run") for s in report["steps"])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report


def test_the_quant_step_fails_on_any_case_off_the_reference_and_names_it() -> None:
    case = {"type": "Q4_0", "n": 3072, "k": 576, "rows": 1, "exact": True}
    case |= {"us": 10.0, "dense_us": 20.0, "gb_s": 100.0, "tflop_s": 0.1}
    wide = case | {"rows": 512, "tflop_s": 50.0}
    row = gc.quant_row("quant", [case, wide], 1.0)
    assert row.passed and row.error is None
    assert row.summary == "2 of 2 cases bit-exact; Q4_0 100 GB/s, 50.0 TFLOP/s"
    row = gc.quant_row("quant", [case, wide | {"exact": False}], 1.0)
    assert not row.passed and row.error == "not bit-exact: Q4_0 3072x576 M=512"
    assert not gc.quant_row("quant", [], 1.0).passed


def test_the_report_is_one_json_and_one_table(tmp_path) -> None:
    rows = [
        gc.StepResult("kernels", True, 12.5, "3 passed, 0 failed, 0 skipped"),
        gc.StepResult("greedy tiny", False, 3.0, error="exit 1\nTraceback: boom"),
    ]
    report = {
        "config": {"device": "cpu"},
        "environment": {"torch": "2.x", "torch_cuda": None, "triton": "3.x", "commit": "abc"},
        "device": {"name": "cpu"},
        "steps": [gc.asdict(r) for r in rows],
        "passed": False,
    }
    table = gc.write_report(tmp_path, report)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    assert (tmp_path / "gpu_check.md").read_text() == table
    assert table.startswith("# GPU check: FAILED (--device cpu)")
    assert "| kernels | pass | 12.5 | 3 passed, 0 failed, 0 skipped |" in table
    assert "| greedy tiny | FAIL | 3.0 | exit 1 |" in table
