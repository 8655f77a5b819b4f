"""What the launcher hands each child process: one frozen dataclass per role.

The launcher starts every child with the "spawn" method and one argument, an
instance of a class below; multiprocessing pickles it once, into the new
process. Nothing else crosses that way: on the sockets every message is a
``radixrt.protocol`` struct (msgpack, no pickle).

- ``Addresses``: the ipc endpoints of one server (every child gets all of them);
- ``ChildArgs``: what every child has: its parent's pid (to die with it), the
  addresses, and the validated ``ServerConfig``;
- ``SchedulerArgs``: a replica: its index, its ``EngineConfig`` (as an object:
  the scheduler builds ``Engine(config)``), its threads and CPUs;
- ``FrontArgs``: the TokenizerManager: the tokenizer's folder and the pids of
  the processes started before it;
- ``DetokenizerArgs``: the tokenizer's folder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixrt.config import EngineConfig, ServerConfig


@dataclass(frozen=True, slots=True)
class Addresses:
    """The ipc endpoints of one server: ``ready`` (children → launcher), ``detokenizer``
    (replicas and launcher → detokenizer), ``front`` (detokenizer → TokenizerManager),
    ``schedulers[i]`` (TokenizerManager → replica i) and ``kv_events[i]`` (replica i's KV
    events; empty when replicas publish none)."""

    ready: str
    detokenizer: str
    front: str
    schedulers: tuple[str, ...]
    kv_events: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.schedulers:
            raise ValueError("Addresses: at least one scheduler address is needed")
        if self.kv_events and len(self.kv_events) != len(self.schedulers):
            raise ValueError(
                f"Addresses: {len(self.kv_events)} KV event addresses for "
                f"{len(self.schedulers)} replicas"
            )

    @classmethod
    def in_folder(cls, folder: str, replicas: int, kv_events: bool) -> Addresses:
        """ipc sockets in ``folder``, one scheduler (and KV event) address per replica."""

        def each(name: str) -> tuple[str, ...]:
            return tuple(f"ipc://{folder}/{name}_{i}" for i in range(replicas))

        return cls(
            ready=f"ipc://{folder}/ready",
            detokenizer=f"ipc://{folder}/detokenizer",
            front=f"ipc://{folder}/front",
            schedulers=each("scheduler"),
            kv_events=each("kv_events") if kv_events else (),
        )


@dataclass(frozen=True, slots=True)
class ChildArgs:
    """What every child process gets."""

    parent_pid: int
    addrs: Addresses
    server: ServerConfig

    def __post_init__(self) -> None:
        if self.parent_pid <= 0:
            raise ValueError(f"parent_pid must be a pid, got {self.parent_pid}")


@dataclass(frozen=True, slots=True)
class SchedulerArgs(ChildArgs):
    """One data-parallel replica's scheduler process."""

    engine: EngineConfig
    replica: int = 0
    threads: int | None = None  # torch compute threads; None: torch's default
    cpus: tuple[int, ...] | None = None  # the CPUs it is pinned to; None: not pinned

    def __post_init__(self) -> None:
        ChildArgs.__post_init__(self)
        if not 0 <= self.replica < len(self.addrs.schedulers):
            raise ValueError(
                f"replica {self.replica} outside [0, {len(self.addrs.schedulers)}) replicas"
            )
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.cpus is not None and not self.cpus:
            raise ValueError("cpus must name at least one CPU (None: not pinned)")

    @property
    def scheduler_addr(self) -> str:
        """Where this replica receives requests."""
        return self.addrs.schedulers[self.replica]

    @property
    def kv_events_addr(self) -> str | None:
        """Where this replica publishes its KV events; None: it publishes none."""
        return self.addrs.kv_events[self.replica] if self.addrs.kv_events else None


@dataclass(frozen=True, slots=True)
class DetokenizerArgs(ChildArgs):
    """The detokenizer process."""

    model_path: str

    def __post_init__(self) -> None:
        ChildArgs.__post_init__(self)
        if not self.model_path:
            raise ValueError("model_path must name the tokenizer's folder")


@dataclass(frozen=True, slots=True)
class FrontArgs(ChildArgs):
    """The TokenizerManager process (the front)."""

    model_path: str
    # the pids of the children started before it, by process name (server_info reports them)
    pids: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        ChildArgs.__post_init__(self)
        if not self.model_path:
            raise ValueError("model_path must name the tokenizer's folder")
