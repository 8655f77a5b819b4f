"""bench/gpu_check.py's greedy and serving steps, run on CPU (Triton under its interpreter) in
their quick form: the same code paths the GPU run takes, judged and reported the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPU_CHECK = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_the_cpu_run_compares_backends_and_serves(tmp_path) -> None:
    cmd = [sys.executable, str(GPU_CHECK), "--device", "cpu", "--quick", "--out", str(tmp_path)]
    cmd += ["--steps", "greedy,serving", "--models", "tiny", "--dtypes", "float32"]
    cmd += ["--serving-model", "tiny", "--serving-dtype", "float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    greedy, serving = report["steps"]
    assert greedy["name"] == "greedy tiny float32" and greedy["passed"]
    assert greedy["figures"]["differ"] == 0 and greedy["figures"]["cached_tokens"]["triton"] > 0
    assert greedy["figures"]["backends"]["triton"].startswith("triton")
    assert serving["passed"] and serving["figures"]["errors"] == 0
    assert (tmp_path / "serving_shared_prefix.json").exists()
    assert "| greedy tiny float32 | pass |" in proc.stdout
