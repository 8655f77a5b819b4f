"""The GPU check: does the Triton path run, and run right, on a CUDA device? One report.

    bench/gpu_check.sh [--out DIR]         # installs what it needs, then runs this on cuda
    python bench/gpu_check.py --device cuda [--out DIR] [--steps kernels,quant,greedy,serving]
    python bench/gpu_check.py --device cpu --quick --steps greedy --models tiny

Steps, each in a child process (a crash or a hung kernel fails that step, not the check):

- ``kernels``: the Triton kernel tests (``tests/kernels``), compiled for the device
  (``TRITON_INTERPRET=0``; on ``--device cpu`` they run under the interpreter instead).
- ``quant``: the Triton quantized linears (``radixrt_kernels/triton/quant_matmul.py``) per GGUF
  block type on the default model's shapes: bits equal to ``radixrt.quant.arithmetic.linear``'s
  (run on CPU copies) at M = 1 and M = 512, and their times beside a dense bf16 matmul's: M = 1
  as GB/s of the blocks streamed, M = 512 as TFLOP/s. (``--device cpu``: one small shape
  under the interpreter, untimed.)
- ``greedy``: per model and dtype, ``Engine(attention_backend="triton")`` against ``"torch"``
  on the same prompts (they share a prefix and are sent twice, so extend runs without and with
  a cached prefix, then decode), greedy, with logprobs. A sequence whose tokens differ fails the
  step unless the torch run's two best logprobs at the first differing token are within the
  dtype's tolerance (a near tie); where tokens agree, logprobs must agree within it too.
- ``serving``: a ``radixrt launch`` server with Triton attention under ``bench/serving.py``'s
  shared-prefix workload; its figures are reported, and it passes without errors and with
  prefix-cache hits.

Each step's time is bounded, and a step whose turn comes after ``--budget-s`` (default 360 s)
fails as not run. ``DIR/gpu_check.json`` (everything) and ``DIR/gpu_check.md`` (the table, also
printed; default DIR ``bench/results/gpu_check``) are rewritten after each step, so a run cut
short keeps what it did. Exit status: 0 when every step passed, 1 when one failed, 2 when the
requested device is absent (then nothing runs: never a silent CPU run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu_check"
STEPS = ("kernels", "quant", "greedy", "serving")
DEVICES = ("cuda", "cpu")
# Per dtype: the largest |logprob difference| accepted between the backends where their tokens
# agree, and the top-2 logprob gap under which a different greedy token counts as a near tie.
# float32 leaves only reduction-order noise; bfloat16 rounds every layer's activations.
TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 1e-1}
RESULT_MARK = "GPU_CHECK_RESULT "
TIMEOUT_S = {"kernels": 360, "quant": 180, "greedy": 300, "ready": 180, "serving": 240}
MAX_TOTAL_TOKENS = 16384  # KV slots of each engine and of the server: the workloads fit
SYSTEM = "You are a careful assistant. Answer the question about the standard library. "
QUESTIONS = (
    "What does zip return?",
    "Why use pathlib?",
    "What is a generator?",
    "How does functools.lru_cache decide what to evict?",
)
# --quick: one group of two questions, one at a time (so the second hits the first's prefix)
QUICK_WORKLOAD = ["--groups", "1", "--questions", "2", "--prefix-len", "16"]
QUICK_WORKLOAD += ["--question-len", "4", "--max-new-tokens", "2", "--max-concurrency", "1"]
# quant: (N, K) of SmolLM2-135M's linears (a type runs those whose K is whole blocks of it), rows
QUANT_SHAPES = [(3072, 576), (576, 1536), (49152, 576), (4096, 4096)]
QUANT_ROWS = (1, 512)


class DeviceMissing(RuntimeError):
    """The requested device is not there: the check refuses to run rather than run elsewhere."""


@dataclass
class StepResult:
    """One row of the report: ``summary`` is the table's figures, ``figures`` the JSON's."""

    name: str
    passed: bool
    seconds: float
    summary: str = ""
    figures: dict = field(default_factory=dict)
    error: str | None = None


# ---------------------------------------------------------------- device and environment


def require_device(device: str) -> dict:
    """What the check runs on; DeviceMissing when ``device`` is cuda and torch sees none."""
    import torch

    if device == "cpu":
        return {"name": f"cpu ({platform.processor() or platform.machine()}), Triton interpreter"}
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceMissing(
            f"--device cuda was requested, but torch {torch.__version__} ({build}) sees no CUDA "
            "device; nothing was run (pass --device cpu for the interpreter run)"
        )
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
    }


def environment() -> dict:
    """Versions and the commit, so a report says what it measured."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    env["torch_cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:  # a copy of the tree without git history has no commit to name
        git = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
        commit = subprocess.run(git, capture_output=True, text=True)
        env["commit"] = commit.stdout.strip() if commit.returncode == 0 else None
    except OSError:
        env["commit"] = None
    return env


def child_env(device: str) -> dict[str, str]:
    """A step's environment: this checkout first on the path, Triton compiled for real on cuda
    and interpreted on cpu, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["TRITON_INTERPRET"] = "1" if device == "cpu" else "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def tail(text: str, chars: int = 3000) -> str:
    return text[-chars:]


def time_left(args: argparse.Namespace) -> float:
    """Seconds left of ``--budget-s``."""
    return args.deadline - time.monotonic()


def timeout(args: argparse.Namespace, what: str) -> float:
    """``what``'s own limit, cut to the budget left (at least a second)."""
    return max(1.0, min(TIMEOUT_S[what], time_left(args)))


def run_command(cmd: list[str], device: str, limit_s: float) -> subprocess.CompletedProcess:
    """``cmd`` from the checkout's root with the device's environment, output captured; raises
    ``subprocess.TimeoutExpired`` after ``limit_s``."""
    return subprocess.run(
        cmd, cwd=ROOT, env=child_env(device), capture_output=True, text=True, timeout=limit_s
    )


# ---------------------------------------------------------------- step: kernels


def junit_counts(path: Path) -> dict:
    """Passed, failed (failures + errors) and skipped tests of a pytest ``--junitxml`` file,
    with the failed tests' names and the skip reasons."""
    failed, skipped, total = [], [], 0
    for case in ET.parse(path).getroot().iter("testcase"):
        total += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped.append(f"{name}: {skip.get('message', '')}")
    passed = total - len(failed) - len(skipped)
    return {"passed": passed, "failed": len(failed), "skipped": len(skipped)} | {
        "failed_tests": failed,
        "skip_reasons": skipped,
    }


def run_kernels(args: argparse.Namespace, tmp: Path, name: str) -> StepResult:
    """The Triton kernel tests on the device; passes when none failed and some ran."""
    t0, xml = time.perf_counter(), tmp / "kernels.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(args.kernel_tests), f"--junitxml={xml}"]
    try:
        proc = run_command(cmd, args.device, timeout(args, "kernels"))
    except subprocess.TimeoutExpired as e:
        return StepResult(name, False, time.perf_counter() - t0, error=f"timed out: {e}")
    seconds = time.perf_counter() - t0
    if not xml.exists():
        return StepResult(name, False, seconds, error=tail(proc.stdout + proc.stderr))
    counts = junit_counts(xml)
    ok = proc.returncode == 0 and counts["failed"] == 0 and counts["passed"] > 0
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    error = None if ok else tail(proc.stdout + proc.stderr)
    return StepResult(name, ok, seconds, summary, counts, error)


# ---------------------------------------------------------------- step: quant


def quant_case(qtype: str, n: int, k: int, rows: int, device: str) -> dict:
    """One type, shape and row count: bits against the reference, and (cuda) the times."""
    import torch

    from radixrt.quant import arithmetic
    from radixrt_kernels.triton.quant_matmul import quant_linear

    gen = torch.Generator().manual_seed(n * 31 + k + rows)
    blocks = k // arithmetic.BLOCK[qtype]
    raw = torch.randint(0, 256, (n, blocks, arithmetic.TYPE_SIZE[qtype]), generator=gen)
    raw = raw.to(torch.uint8)
    fields = {"Q6_K": [208], "Q4_0": [0], "Q5_0": [0], "Q8_0": [0]}.get(qtype, [0, 2])
    for at in fields:  # the fp16 fields (d; m or dmin): small, finite scales
        scale = (torch.rand(n, blocks, generator=gen) - 0.5) * 0.02
        raw[..., at : at + 2] = scale.half().view(torch.uint8).view(n, blocks, 2)
    raw = raw.view(n, -1)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want = arithmetic.linear(qtype, x, raw, n, k)
    xd, rd = x.to(device), raw.to(device)
    got = quant_linear(qtype, xd, rd, n, k)
    case = {"type": qtype, "n": n, "k": k, "rows": rows, "exact": torch.equal(got.cpu(), want)}
    if device == "cuda":
        from triton.testing import do_bench

        dense = torch.randn(n, k, device=device).bfloat16()
        ms = do_bench(lambda: quant_linear(qtype, xd, rd, n, k), warmup=5, rep=20)
        case["us"] = ms * 1e3
        case["dense_us"] = do_bench(lambda: xd @ dense.T, warmup=5, rep=20) * 1e3
        case["gb_s"] = raw.numel() / (ms * 1e-3) / 1e9
        case["tflop_s"] = 2 * rows * n * k / (ms * 1e-3) / 1e12
    return case


def quant_child(spec: dict) -> dict:
    """Every type's cases (the child's side of the quant step)."""
    from radixrt.quant import arithmetic

    if spec["device"] == "cpu":
        plan = [(t, 40, 512, r) for t in arithmetic.BLOCK for r in (1, 17)]
    else:
        plan = [
            (t, n, k, r)
            for t in arithmetic.BLOCK
            for n, k in QUANT_SHAPES
            if k % arithmetic.BLOCK[t] == 0
            for r in QUANT_ROWS
        ]
    return {"cases": [quant_case(t, n, k, r, spec["device"]) for t, n, k, r in plan]}


def quant_row(name: str, cases: list[dict], seconds: float) -> StepResult:
    """Passes when every case's bits equal the reference's; the summary gives each type's best
    M = 1 GB/s and M = 512 TFLOP/s (cuda)."""
    wrong = [f"{c['type']} {c['n']}x{c['k']} M={c['rows']}" for c in cases if not c["exact"]]
    summary = f"{len(cases) - len(wrong)} of {len(cases)} cases bit-exact"
    timed = [c for c in cases if "us" in c]
    for qtype in dict.fromkeys(c["type"] for c in timed):
        gb = max(c["gb_s"] for c in timed if c["type"] == qtype and c["rows"] == 1)
        tf = max(c["tflop_s"] for c in timed if c["type"] == qtype and c["rows"] > 1)
        summary += f"; {qtype} {gb:.0f} GB/s, {tf:.1f} TFLOP/s"
    error = ("not bit-exact: " + ", ".join(wrong)) if wrong else None
    return StepResult(name, not wrong and bool(cases), seconds, summary, {"cases": cases}, error)


def run_quant(args: argparse.Namespace, name: str) -> StepResult:
    """The quantized linears against their reference, in a child process."""
    t0 = time.perf_counter()
    ok, value = run_child(
        {"kind": "quant", "device": args.device}, args.device, timeout(args, "quant")
    )
    if not ok:
        return StepResult(name, False, time.perf_counter() - t0, error=value)
    return quant_row(name, value["cases"], time.perf_counter() - t0)


# ---------------------------------------------------------------- step: greedy


def prompts(quick: bool) -> list[str]:
    """Prompts sharing a prefix and, unless ``quick``, one long enough for several KV blocks
    and splits."""
    if quick:
        return [SYSTEM + q for q in QUESTIONS[:2]]
    index = " ".join(f"Item {i}: a line of the standard library's index." for i in range(60))
    return [SYSTEM + q for q in QUESTIONS] + [f"{SYSTEM}{index} Which item comes after item 41?"]


def resolve_model(name: str) -> str | None:
    """``tiny`` (the generated test model), ``smollm2`` (the default model: None) or a folder."""
    if name == "tiny":
        from radixrt.testing import tiny_model_path

        return tiny_model_path("llama")
    return None if name == "smollm2" else name


def generate_twice(spec: dict, backend: str, dtype: str) -> dict:
    """One engine's outputs for the prompts, sent twice (the second time over cached prefixes)."""
    from radixrt import Engine, SamplingParams

    sp = SamplingParams(
        max_new_tokens=spec["new_tokens"],
        temperature=0.0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    )
    engine = Engine(
        model=resolve_model(spec["model"]),
        dtype=dtype,
        device=spec["device"],
        attention_backend=backend,
        max_total_tokens=MAX_TOTAL_TOKENS,
        disable_deterministic_inference=True,  # the backends as they run by default on CUDA
    )
    with engine as eng:
        described = eng.runner.attn_backend.describe()
        passes = [
            [output_record(o) for o in eng.generate(prompts(spec["quick"]), sp)] for _ in range(2)
        ]
        eng.check_memory()
    return {"backend": described, "passes": passes}


def output_record(out) -> dict:
    gaps = [lps[0] - lps[1] if len(lps) > 1 else float("inf") for _, lps in out.top_logprobs]
    return {
        "ids": list(out.token_ids),
        "logprobs": list(out.logprobs),
        "top2_gap": gaps,
        "cached": out.cached_tokens,
    }


def greedy_child(spec: dict) -> dict:
    """Both backends' runs of one model and dtype (the child's side of the greedy step)."""
    return {b: generate_twice(spec, b, spec["dtype"]) for b in ("torch", "triton")}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare_runs(ref: dict, got: dict, tol: float) -> dict:
    """Figures of ``got`` (triton) against ``ref`` (torch), and whether they pass at ``tol``."""
    pairs = [(r, g) for rp, gp in zip(ref["passes"], got["passes"]) for r, g in zip(rp, gp)]
    differ = near_ties = 0
    max_diff = 0.0
    for r, g in pairs:
        d = first_difference(r["ids"], g["ids"])
        agree = len(r["ids"]) if d is None else d
        diffs = [abs(x - y) for x, y in zip(r["logprobs"][:agree], g["logprobs"][:agree])]
        max_diff = max(max_diff, *diffs) if diffs else max_diff
        if d is not None or len(r["ids"]) != len(g["ids"]):
            differ += 1
            near_ties += d is not None and r["top2_gap"][d] <= tol
    cached = [sum(x["cached"] for p in run["passes"] for x in p) for run in (ref, got)]
    passed = (
        differ == near_ties
        and max_diff <= tol
        and cached[0] == cached[1] > 0
        and got["backend"].startswith("triton")
    )
    return {
        "sequences": len(pairs),
        "differ": differ,
        "near_ties": near_ties,
        "max_abs_dlogprob": max_diff,
        "tolerance": tol,
        "cached_tokens": {"torch": cached[0], "triton": cached[1]},
        "backends": {"torch": ref["backend"], "triton": got["backend"]},
        "passed": passed,
    }


def greedy_row(name: str, runs: dict, dtype: str, seconds: float) -> StepResult:
    fig = compare_runs(runs["torch"], runs["triton"], TOLERANCE[dtype])
    summary = (
        f"{fig['differ']} of {fig['sequences']} sequences differ ({fig['near_ties']} at near "
        f"ties); max dlogprob {fig['max_abs_dlogprob']:.1e} (tol {fig['tolerance']:.0e}); "
        f"cached {fig['cached_tokens']['triton']} vs {fig['cached_tokens']['torch']}"
    )
    return StepResult(name, fig["passed"], seconds, summary, fig)


def run_greedy(args: argparse.Namespace, model: str, dtype: str, name: str) -> StepResult:
    """Triton against torch on ``model`` in ``dtype``, in a child process."""
    spec = {"model": model, "dtype": dtype, "device": args.device, "quick": args.quick}
    spec["new_tokens"] = 2 if args.quick else 32
    t0 = time.perf_counter()
    ok, value = run_child(spec, args.device, timeout(args, "greedy"))
    if not ok:
        return StepResult(name, False, time.perf_counter() - t0, error=value)
    return greedy_row(name, value, dtype, time.perf_counter() - t0)


def run_child(spec: dict, device: str, timeout: float) -> tuple[bool, object]:
    """Run ``spec`` in a child of this script → (True, its result) or (False, what went wrong)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        proc = run_command(cmd, device, timeout)
    except subprocess.TimeoutExpired as e:
        return False, f"timed out after {timeout:.0f} s\n{tail(str(e.stderr or ''))}"
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        return False, f"exit {proc.returncode}\n{tail(proc.stdout + proc.stderr)}"
    return True, json.loads(lines[-1][len(RESULT_MARK) :])


# ---------------------------------------------------------------- step: serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    """``radixrt launch`` with Triton attention, no HTTP front, its output in ``log``."""
    cmd = [sys.executable, "-m", "radixrt.cli", "launch", "--device", args.device]
    cmd += ["--attention-backend", "triton", "--port", str(port), "--http-port", "0"]
    cmd += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--dtype", args.serving_dtype]
    model = resolve_model(args.serving_model)
    cmd += ["--model", model] if model is not None else []
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(args.device), stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def wait_ready(server: subprocess.Popen, log: Path, limit_s: float) -> None:
    """Return once the server printed its ready line; RuntimeError if it exits or times out."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if any(line.startswith("radixrt ready") for line in log.read_text().splitlines()):
            return
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}):\n{tail(log.read_text())}")
        time.sleep(0.5)
    raise RuntimeError(f"no ready line in {limit_s:.0f} s:\n{tail(log.read_text())}")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (the launcher tears its children down), then SIGKILL to its process group."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(30)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait(10)


def run_benchmark(args: argparse.Namespace, port: int, out: Path) -> dict:
    """``bench/serving.py``'s shared-prefix workload against the server → its result dict."""
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "serving.py"),
        "--server",
        f"tcp://127.0.0.1:{port}",
    ]
    cmd += ["--workload", "shared-prefix", "--no-progress", "--out", str(out)]
    cmd += QUICK_WORKLOAD if args.quick else []
    proc = run_command(cmd, args.device, timeout(args, "serving"))
    if proc.returncode != 0:
        raise RuntimeError(f"bench/serving.py exited {proc.returncode}:\n{tail(proc.stderr)}")
    return json.loads(out.read_text())["result"]


def run_serving(args: argparse.Namespace, tmp: Path, name: str) -> StepResult:
    """A Triton server under the shared-prefix workload: passes with every request answered and
    prefix-cache hits."""
    t0 = time.perf_counter()
    port, log = free_port(), tmp / "server.log"
    server = start_server(args, port, log)
    try:
        wait_ready(server, log, timeout(args, "ready"))
        result = run_benchmark(args, port, Path(args.out) / "serving_shared_prefix.json")
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
        return StepResult(name, False, time.perf_counter() - t0, error=str(e))
    finally:
        stop_server(server)
    ok = result["requests"] > 0 and result["errors"] == 0 and result["hit_rate"] > 0
    summary = (
        f"{result['requests']} requests, {result['errors']} errors; "
        f"output {result['output_throughput']:.0f} tok/s, total {result['total_throughput']:.0f} "
        f"tok/s; TTFT p50 {result['ttft_p50_ms']:.1f} ms, p99 {result['ttft_p99_ms']:.1f} ms; "
        f"ITL p50 {result['itl_p50_ms']:.2f} ms; hit rate {result['hit_rate']:.2f}"
    )
    return StepResult(name, ok, time.perf_counter() - t0, summary, result)


# ---------------------------------------------------------------- report


def render_table(report: dict) -> str:
    """The report as Markdown: a headline, then one row per step."""
    env, device = report["environment"], report.get("device") or {}
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"# GPU check: {verdict} (--device {report['config']['device']})",
        "",
        f"device: {device.get('name', 'absent')}; torch {env.get('torch')} (CUDA "
        f"{env.get('torch_cuda')}), triton {env.get('triton')}, commit {env.get('commit')}",
    ]
    if report.get("error"):
        lines += ["", f"error: {report['error']}"]
    lines += ["", "| step | result | seconds | figures |", "| --- | --- | ---: | --- |"]
    for step in report["steps"]:
        first_error = (step["error"] or "").strip().splitlines()[:1]
        figures = (step["summary"] or " ".join(first_error)).replace("|", "/")
        result = "pass" if step["passed"] else "FAIL"
        lines.append(f"| {step['name']} | {result} | {step['seconds']:.1f} | {figures} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> str:
    """Write ``gpu_check.json`` and ``gpu_check.md`` into ``out``; return the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    table = render_table(report)
    (out / "gpu_check.md").write_text(table)
    return table


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=DEVICES, default="cuda")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON and the table")
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated, of " + str(STEPS))
    ap.add_argument("--models", default="tiny,smollm2", help="greedy: tiny, smollm2 or folders")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="greedy: " + str(TOLERANCE))
    ap.add_argument("--serving-model", default="smollm2", help="serving: tiny, smollm2, a folder")
    ap.add_argument("--serving-dtype", default="auto", help="serving: the server's --dtype")
    ap.add_argument("--quick", action="store_true", help="2 new tokens, a small workload")
    ap.add_argument("--kernel-tests", default=str(ROOT / "tests" / "kernels"))
    ap.add_argument(
        "--budget-s", type=float, default=360.0, help="steps not started by then fail as not run"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps, args.models, args.dtypes = (
        [x for x in s.split(",") if x] for s in (args.steps, args.models, args.dtypes)
    )
    for what, given, allowed in (("step", args.steps, STEPS), ("dtype", args.dtypes, TOLERANCE)):
        if unknown := [x for x in given if x not in allowed]:
            ap.error(f"unknown {what} {unknown[0]!r}: one of {', '.join(allowed)}")
    args.deadline = time.monotonic() + args.budget_s
    return args


def plan(args: argparse.Namespace, tmp: Path) -> list[tuple[str, Callable[[], StepResult]]]:
    """The report's rows in order: (name, how to make the row)."""
    rows: list[tuple[str, Callable[[], StepResult]]] = []
    for step in args.steps:
        if step == "kernels":
            rows.append(("kernels", partial(run_kernels, args, tmp, "kernels")))
        elif step == "quant":
            rows.append(("quant", partial(run_quant, args, "quant")))
        elif step == "greedy":
            for model, dtype in ((m, d) for m in args.models for d in args.dtypes):
                name = f"greedy {model} {dtype}"
                rows.append((name, partial(run_greedy, args, model, dtype, name)))
        else:
            name = f"serving shared-prefix {args.serving_model}"
            rows.append((name, partial(run_serving, args, tmp, name)))
    return rows


def run_steps(args: argparse.Namespace, report: dict) -> None:
    """Make each row in turn, rewriting the report after each (a run cut short keeps what it
    did); a row whose turn comes after the budget is spent fails as not run."""
    with tempfile.TemporaryDirectory(prefix="radixrt-gpu-check-") as tmp:
        for name, make in plan(args, Path(tmp)):
            if time_left(args) > 0:
                row = make()
            else:
                row = StepResult(
                    name, False, 0.0, error=f"not run: --budget-s {args.budget_s:.0f} spent"
                )
            print(f"gpu_check: {row.name}: {'pass' if row.passed else 'FAIL'}", flush=True)
            if row.error:
                print(f"gpu_check: {row.name}: {row.error}", file=sys.stderr, flush=True)
            report["steps"].append(asdict(row))
            report["passed"] = all(r["passed"] for r in report["steps"])
            write_report(Path(args.out), report)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        child = quant_child if spec.get("kind") == "quant" else greedy_child
        print(RESULT_MARK + json.dumps(child(spec)), flush=True)
        return 0
    config = {k: v for k, v in vars(args).items() if k not in ("child", "deadline")}
    report = {"config": config, "environment": environment(), "device": None, "steps": []}
    try:
        report["device"] = require_device(args.device)
    except DeviceMissing as e:
        report.update(passed=False, error=str(e))
        write_report(Path(args.out), report)
        print(f"gpu_check: FAILED: {e}", file=sys.stderr)
        return 2
    report["passed"] = False  # until a step has run
    run_steps(args, report)
    print(write_report(Path(args.out), report), end="")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
