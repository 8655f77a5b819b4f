"""A real `radixrt launch` subprocess for end-to-end tests, and the checks every server test
shares."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from radixrt.client import Client
from radixrt.testing import process_tree, tiny_model_path

READY_TIMEOUT_S = 120
ROUTER_READY_TIMEOUT_S = 60


def proc_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (Linux /proc; no psutil needed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    return process_tree({pid}) - {pid}


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """The pids still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := {p for p in pids if proc_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m radixrt.cli launch` subprocess (tiny llama, fp32) and its ready line; HTTP on
    a free port (``http``: its base URL)."""

    def __init__(self, *extra: str, env: dict | None = None) -> None:
        self.port, self.http_port = free_port(), free_port()
        while self.http_port == self.port:
            self.http_port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        cmd = [
            sys.executable,
            "-m",
            "radixrt.cli",
            "launch",
            "--model",
            tiny_model_path("llama"),
            "--dtype",
            "float32",
            "--max-total-tokens",
            "8192",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready_line = self._wait_ready()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_ready(self) -> str:
        try:
            line = self.lines.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            self.stop()
            pytest.fail("no ready line from the server")
        if not line.startswith("radixrt ready"):
            self.stop()
            pytest.fail(f"unexpected first line {line!r}: {self.proc.stderr.read()}")
        return line

    def children(self) -> set[int]:
        return descendants(self.proc.pid)

    def stop(self) -> None:
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in wait_gone(kids, 0):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_idle(client: Client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info()
        if (
            info["running"] == 0 and info["waiting"] == 0 and info["protected_tokens"] == 0
        ) or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def assert_idle_kv(client: Client, timeout: float = 30.0) -> dict:
    """The idle KV invariant through ``server_info``: once idle, nothing is protected and
    every slot is free or held by an evictable cached prefix."""
    info = wait_idle(client, timeout)
    assert info["running"] == 0 and info["waiting"] == 0, info
    assert info["protected_tokens"] == 0, info
    assert info["free_slots"] + info["evictable_tokens"] == info["kv_slots"], info
    return info


def start_sglang_router(
    worker_urls: list[str], policy: str, port: int, *extra: str
) -> subprocess.Popen:
    """A `python -m sglang_router.launch_router` subprocess on 127.0.0.1:``port`` in front of
    ``worker_urls``, returned once its ``/workers`` lists every one of them as healthy. Its
    Prometheus exporter gets a free loopback port (its default, 29000 on every interface, would
    collide between routers); its log goes to ``proc.log`` (a temporary file), quoted in the
    failure if it never gets ready. Stop it with ``stop_process``."""
    log = tempfile.TemporaryFile("w+")
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    if not _router_ready(proc, f"http://127.0.0.1:{port}", set(worker_urls)):
        stop_process(proc)
        log.seek(0)
        pytest.fail(f"sglang-router did not get ready: {log.read()[-3000:]}")
    return proc


def _router_ready(proc: subprocess.Popen, url: str, workers: set[str]) -> bool:
    """Poll the router's ``/workers`` until every worker is registered and healthy; False if
    the router exits or ``ROUTER_READY_TIMEOUT_S`` passes first."""
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            listed = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
            if {w["url"] for w in listed if w["is_healthy"]} >= workers:
                return True
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.2)
    return False


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; waits for the exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
