"""Kernel tests run in a child pytest, one child per test module.

Why: a bad index under the Triton interpreter segfaults the whole process,
and ``TRITON_INTERPRET`` must be set before ``triton.jit`` runs (at import).
So in the parent pytest every test here is a proxy: the first one run
starts a child ``python -m pytest`` on all selected kernel tests that share
its environment: ``TRITON_INTERPRET=1`` (unless a CUDA device is present or
the caller set it) updated by the module's ``KERNEL_ENV`` dict, if any. The
child writes one JSON line per test event; each proxy then reports its
test's outcome (pass, skip, or fail with the child's report). A test the
child died in fails with its exit code and output tail, and a new child runs
the tests still pending. Collection must not depend on the environment, so
that parent and child see the same test ids.

``RADIXRT_KERNEL_CHILD=1`` in the environment runs the tests in-process (the
child mode), e.g. ``TRITON_INTERPRET=1 RADIXRT_KERNEL_CHILD=1 pytest tests/kernels``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

CHILD_FLAG = "RADIXRT_KERNEL_CHILD"
REPORT_PATH = "RADIXRT_KERNEL_REPORT"
CHILD_TIMEOUT_S = float(os.environ.get("RADIXRT_KERNEL_TIMEOUT", "900"))
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"


@dataclass
class Outcome:
    status: str  # "passed" | "failed" | "skipped"
    text: str = ""


_results: dict[str, Outcome] = {}  # node id → outcome, filled a child run at a time


# ---- parent: proxy each test ----------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if IN_CHILD:
        return None
    if pyfuncitem.nodeid not in _results:
        env = _child_env(pyfuncitem.module)
        here = Path(__file__).parent
        batch = [
            i.nodeid
            for i in pyfuncitem.session.items
            if i.path.is_relative_to(here)
            and i.nodeid not in _results
            and _child_env(getattr(i, "module", None)) == env
        ]
        _results.update(_run_children(pyfuncitem.config.rootpath, batch, env))
    outcome = _results.get(
        pyfuncitem.nodeid, Outcome("failed", "the child pytest did not report this test")
    )
    if outcome.status == "skipped":
        pytest.skip(outcome.text)
    if outcome.status == "failed":
        pytest.fail(f"[child pytest] {outcome.text}", pytrace=False)
    return True


def _child_env(module: object) -> dict[str, str]:
    env = dict(os.environ)
    if "TRITON_INTERPRET" not in env:
        import torch

        env["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
    env.update(getattr(module, "KERNEL_ENV", {}))
    env[CHILD_FLAG] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a segfault prints the Python stack
    return env


def _run_children(rootdir: Path, nodeids: list[str], env: dict[str, str]) -> dict[str, Outcome]:
    """Run ``nodeids`` in children until each has an outcome; a crash costs one test."""
    results: dict[str, Outcome] = {}
    pending = list(nodeids)
    while pending:
        outcomes, started, rc, tail = _run_child(rootdir, pending, env)
        results.update(outcomes)
        pending = [n for n in pending if n not in results]
        if not pending:
            break
        culprit = started[-1] if started and started[-1] not in results else None
        if culprit is None:  # nothing ran (collection error) or the child lost track: give up
            for nodeid in pending:
                results[nodeid] = Outcome(
                    "failed", f"child pytest exited {rc} without running it:\n{tail}"
                )
            break
        results[culprit] = Outcome("failed", f"child pytest died (exit {rc}) in this test:\n{tail}")
        pending.remove(culprit)
    return results


def _run_child(
    rootdir: Path, nodeids: list[str], env: dict[str, str]
) -> tuple[dict[str, Outcome], list[str], int, str]:
    with tempfile.TemporaryDirectory(prefix="radixrt-kernels-") as tmp:
        report = Path(tmp) / "report.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(rootdir),
            *nodeids,
        ]
        try:
            proc = subprocess.run(
                cmd,
                cwd=rootdir,
                env={**env, REPORT_PATH: str(report)},
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = (
                -1,
                f"timed out after {CHILD_TIMEOUT_S:.0f} s\n{e.stdout or ''}{e.stderr or ''}",
            )
        events = (
            [json.loads(line) for line in report.read_text().splitlines()]
            if report.exists()
            else []
        )
    outcomes: dict[str, Outcome] = {}
    started = []
    for ev in events:
        if ev["event"] == "start":
            started.append(ev["nodeid"])
        elif ev["status"] != "passed" or ev["nodeid"] not in outcomes:
            outcomes[ev["nodeid"]] = Outcome(ev["status"], ev["text"])
    return outcomes, started, rc, output[-4000:]


# ---- child: record each test's events -------------------------------------------------------


def _record(event: dict[str, str]) -> None:
    with open(os.environ[REPORT_PATH], "a") as f:
        f.write(json.dumps(event) + "\n")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if IN_CHILD and REPORT_PATH in os.environ:
        _record({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not (IN_CHILD and REPORT_PATH in os.environ):
        return
    if report.when == "call" or report.outcome != "passed":
        text = report.longreprtext
        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2].removeprefix("Skipped: ")  # (file, line, reason)
        _record(
            {"event": "report", "nodeid": report.nodeid, "status": report.outcome, "text": text}
        )
