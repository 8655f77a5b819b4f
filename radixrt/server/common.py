"""What every server child process shares: start-up, orphan checks, sockets.

Child entry points take one frozen dataclass of ``radixrt.server.spawn_args``
(the spawn start method pickles it once, at start); everything on the sockets
is ``radixrt.protocol`` msgpack.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import traceback
from collections.abc import Callable

import zmq

from radixrt.protocol import ProcessFailed, ProcessReady, encode
from radixrt.server.spawn_args import ChildArgs

PR_SET_PDEATHSIG = 1
# How often an idle loop wakes to check that its parent lives. Rare on purpose:
# on a small machine every wakeup of a server process preempts one of the
# scheduler's compute threads in the middle of a forward.
POLL_MS = 1000
PENDING_LIMIT = 1024  # messages handled from one socket before the next gets its turn


def setup_child(args: ChildArgs) -> None:
    """Ignore SIGINT (the launcher owns shutdown), exit 0 at once on SIGTERM (the scheduler's
    loop stops cleanly instead, once it runs) and die with the launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    exit_if_orphaned(args.parent_pid)


def exit_if_orphaned(parent_pid: int) -> None:
    """Exit at once if the launcher (``parent_pid``) is gone."""
    if os.getppid() != parent_pid:
        os._exit(1)


def push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: the three processes form a cycle
    sock.connect(addr)
    return sock


def pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(addr)
    return sock


def handle_pending(sock: zmq.Socket, handle: Callable[[list[bytes]], object]) -> int:
    """Handle the messages waiting on ``sock`` (``handle(frames)``), at most ``PENDING_LIMIT``
    (bounded, so that no socket starves the others); how many."""
    for n in range(PENDING_LIMIT):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return n
        handle(frames)
    return PENDING_LIMIT


def run_child(role: str, args: ChildArgs, main: Callable[[zmq.Context, zmq.Socket], None]) -> None:
    """Run ``main(ctx, ready_socket)``; report a start-up failure to the launcher."""
    setup_child(args)
    ctx = zmq.Context()
    ready = push(ctx, args.addrs.ready)
    try:
        main(ctx, ready)
    except Exception:
        ready.send(encode(ProcessFailed(role=role, pid=os.getpid(), error=traceback.format_exc())))
        import time

        time.sleep(0.5)  # let the report leave before the process exits
        os._exit(1)


def report_ready(ready: zmq.Socket, role: str, info: dict | None = None) -> None:
    """Tell the launcher this process is set up. Everything it built so far (modules, model,
    tokenizer: hundreds of thousands of objects in the Scheduler) lives as long as the process,
    so it is moved out of the garbage collector's sight first: a full collection would otherwise
    scan it all in the middle of serving."""
    gc.collect()
    gc.freeze()
    ready.send(encode(ProcessReady(role=role, pid=os.getpid(), info=info or {})))


def replica_name(replica: int) -> str:
    """The process name of a replica's scheduler: "scheduler" for the first, as with one."""
    return "scheduler" if replica == 0 else f"scheduler_{replica}"


def replica_index(name: str) -> int | None:
    """The replica a process name belongs to; None for the other processes."""
    if name == "scheduler":
        return 0
    head, _, tail = name.partition("_")
    return int(tail) if head == "scheduler" and tail.isdigit() else None
