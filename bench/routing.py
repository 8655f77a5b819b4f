"""Routing benchmark: one replica, ``--dp-size N`` under each ``--load-balance-method``, and N
single-replica servers behind SGLang's router (``sglang-router``, its ``cache_aware`` and
``round_robin`` policies), on the shared-prefix and multi-turn workloads of ``serving.py``.

For each configuration and workload: the fleet's hit rate (cached / prompt tokens, from the
responses), the prefill tokens the fleet computed (``prefill_tokens`` of every server's
``/get_server_info``, before and after), throughput and TTFT p50 / p99. Every request goes
over HTTP (/v1/chat/completions, streamed), so the same client reaches a radixrt front and
the router. Each configuration starts its own servers (the default model unless
``--model``), flushed before each workload. Prints a table and writes JSON (and a PNG with
matplotlib) under bench/results/.

    python bench/routing.py [--dp-size 2] [--groups 16] [--configs single,cache_aware,...]

On a machine with few cores the replicas share them, so throughput cannot grow with the
replica count here; the tokens computed and the hit rates are what routing decides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402  (the workloads, the HTTP client and the summary)

RESULTS = Path(__file__).parent / "results"
CONFIGS = (
    "single",
    "cache_aware",
    "round_robin",
    "shortest_queue",
    "router_cache_aware",
    "router_round_robin",
)
READY_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """A ``radixrt launch`` subprocess; ``http``: its base URL."""

    def __init__(self, args, *extra: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        cmd = [sys.executable, "-m", "radixrt.cli", "launch", "--port", str(self.port)]
        cmd += ["--http-port", str(self.http_port), "--dtype", args.dtype, *extra]
        if args.model:
            cmd += ["--model", args.model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("radixrt ready"):
            self.stop()
            raise RuntimeError(f"the server did not start: {line!r}")

    def stop(self) -> None:
        stop_process(self.proc)


def health_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET ``url``/health answers 200 now."""
    try:
        return httpx.get(url + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a radixrt server drains), SIGKILL if it is still there 30 s later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Router:
    """``python -m sglang_router.launch_router`` over worker URLs; ``http``: its base URL."""

    def __init__(self, workers: list[str], policy: str) -> None:
        port = free_port()
        self.http = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--policy", policy, "--worker-urls", *workers]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if health_ok(self.http):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("sglang-router did not become ready")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def start(args, config: str) -> tuple[str, list, list[str]]:
    """(the URL requests go to, the processes to stop, the radixrt servers' URLs)."""
    n, t = str(args.dp_size), str(args.threads_per_replica)
    if config == "single":
        srv = Launched(args, "--threads-per-replica", t)
        return srv.http, [srv], [srv.http]
    if not config.startswith("router_"):
        srv = Launched(args, "--dp-size", n, "--load-balance-method", config)
        return srv.http, [srv], [srv.http]
    workers = [Launched(args, "--threads-per-replica", t) for _ in range(args.dp_size)]
    urls = [w.http for w in workers]
    router = Router(urls, config.removeprefix("router_"))
    return router.http, [router, *workers], urls


def prefill_tokens(urls: list[str]) -> int:
    """Prompt tokens the servers computed so far (every replica of each)."""
    total = 0
    for url in urls:
        states = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"]
        total += sum(s.get("prefill_tokens", 0) for s in states)
    return total


async def run_workload(
    args, front: str, workload: str, vocab: int, model: str
) -> tuple[dict, list]:
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    a = argparse.Namespace(**{**vars(args), "backend": "openai-chat"})
    async with serving.OpenAIBackend(front, args.timeout, chat=True, model=model) as client:
        progress = serving.Progress(0, False)
        t0 = time.perf_counter()
        if workload == "multi-turn":
            recs = await serving.run_multi_turn(client, a, sp, progress)
        else:
            reqs = serving.shared_prefix(a, random.Random(args.seed), vocab)
            recs = await serving.run_requests(
                client, reqs, sp, float("inf"), args.max_concurrency, progress, args.seed
            )
        elapsed = time.perf_counter() - t0
    return serving.summarize(recs, elapsed), recs


def bench_config(args, config: str) -> dict:
    front, procs, urls = start(args, config)
    out = {}
    try:
        info = httpx.get(urls[0] + "/get_server_info").json()
        vocab, model = info["internal_states"][0]["vocab_size"], info["served_model_name"]
        for workload in args.workloads:
            for url in urls:
                httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
            before = prefill_tokens(urls)
            summary, _ = asyncio.run(run_workload(args, front, workload, vocab, model))
            summary["prefill_tokens_computed"] = prefill_tokens(urls) - before
            out[workload] = summary
            print(f"{config:20s} {workload:13s} {row(summary)}", flush=True)
    finally:
        for p in procs:
            p.stop()
    return out


def row(s: dict) -> str:
    return (
        f"hit {s['hit_rate']:.3f}  computed {s['prefill_tokens_computed']:7d}  "
        f"{s['request_throughput']:6.2f} req/s  TTFT p50 {s['ttft_p50_ms']:8.1f} ms  "
        f"p99 {s['ttft_p99_ms']:8.1f} ms  errors {s['errors']}"
    )


def table(results: dict) -> str:
    lines = [
        "| config | workload | hit rate | prefill tokens computed | × single | req/s "
        "| TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, per in results.items():
        for workload, s in per.items():
            base = results.get("single", {}).get(workload, {}).get("prefill_tokens_computed")
            ratio = f"{s['prefill_tokens_computed'] / base:.3f}" if base else "-"
            lines.append(
                f"| {config} | {workload} | {s['hit_rate']:.3f} | {s['prefill_tokens_computed']} "
                f"| {ratio} | {s['request_throughput']:.2f} | {s['ttft_p50_ms']:.1f} "
                f"| {s['ttft_p99_ms']:.1f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = sorted({w for per in results.values() for w in per})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        names = [c for c in results if workload in results[c]]
        ax.bar(names, [results[c][workload]["prefill_tokens_computed"] for c in names])
        ax.set_title(f"{workload}: prefill tokens computed")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--threads-per-replica", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "routing.json"))
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    results = {config: bench_config(args, config) for config in args.configs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()}
    out.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(table(results))


if __name__ == "__main__":
    main()
