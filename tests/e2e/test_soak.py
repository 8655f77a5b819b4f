"""bench/soak.py in its short mode, as CI runs it: its own server on the tiny model, a mix of
streamed / unary / chat / shared-prefix requests, aborts, and a client process SIGKILLed
mid-stream. No request may be lost, and once idle the server's KV pool must be whole."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
# Bounded so that a run where something went wrong still ends: load, the 120 s request
# timeout, the hung-worker margin, the idle wait, startup and the server's drain.
RUN_TIMEOUT_S = 420


def test_soak_short_loses_nothing_and_leaks_no_kv(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        str(SOAK),
        "--short",
        "--duration",
        "40",
        "--clients",
        "6",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "journals"),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    print(proc.stdout)
    print(proc.stderr[-4000:], file=sys.stderr)
    print(f"soak wall time {time.monotonic() - t0:.1f} s")
    assert out.exists(), f"soak.py wrote no JSON (exit {proc.returncode})"
    result = json.loads(out.read_text())["result"]
    summary, kv = result["summary"], result["kv_idle"]
    print(
        json.dumps(
            {
                "summary": summary,
                "kv_idle": kv,
                "server_rss_mb": result["server_rss_mb"],
                "workers": result["workers"],
            },
            indent=2,
        )
    )

    assert summary["lost"] == 0, result["lost_requests"]
    assert kv["ok"], kv
    assert (
        kv["protected_tokens"] == 0 and kv["free_slots"] + kv["evictable_tokens"] == kv["kv_slots"]
    ), kv
    assert summary["completed"] > 0 and summary["aborted"] > 0, (
        summary
    )  # the faults really happened
    assert result["workers"]["killed"] > 0, result["workers"]
    assert summary["sent"] == sum(
        summary[o] for o in ("completed", "aborted", "errored", "killed", "lost")
    )
    assert not result["journal_anomalies"], result["journal_anomalies"]
    assert proc.returncode == 0, proc.stdout[-2000:]
