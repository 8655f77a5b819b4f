"""The storage tier: KV blocks as files in a directory, kept across restarts.

Layout: ``DIR/<model fingerprint, hex>/<block key, hex>.kv``, one file per block. A file is a
header (``_HEADER``: magic, format version, the model fingerprint, the block's key, the
payload's length and a CRC-32 of header and payload) and the block's KV bytes.
A reader checks every field: a file of another model, another key, the wrong length, a
torn or truncated write or flipped bytes is a miss, deleted and logged once.

- ``prefetch`` reads (and checks) blocks on a reader thread of the tier's own, ahead of the
  lookup that will want them (a request waiting for admission), into a bounded set of read
  blocks that ``read`` takes first: file I/O and checking overlap the forward passes.
- Writes run on one thread of the tier's own, from a bounded queue (a block waiting there is
  readable already); each file is written under a temporary name and renamed into place, so
  a process killed mid-write leaves only a temporary file, removed at the next start.
- ``limit_bytes``: the directory's budget; the least recently used files (by last read or
  write; at start, by modification time) are deleted to make room.
- A failed write (full disk, read-only or removed directory) drops that block and is logged
  once per kind; a removed directory is made again on the next write. Reads that fail are
  misses. Nothing here ever raises into the scheduler.
- Several processes may share a directory (data-parallel replicas): each keeps its own index
  of what it has seen, and a file another one deleted reads as a miss.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import zlib
from collections import Counter, OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger("radixrt.hicache")

_MAGIC = b"RRKV"
_VERSION = 2
# magic, version, fingerprint, key, payload length, checksum
_HEADER = struct.Struct("<4sH16s16sQI")
_CHECKED = _HEADER.size - 4  # the header's bytes before its checksum
MAX_PENDING_BYTES = 256 << 20  # blocks queued for writing; past this, new ones are dropped
MAX_FETCHED_BYTES = 256 << 20  # blocks read ahead and not yet taken; past this, the oldest go
_SUFFIX = ".kv"


class StorageTier:
    """KV blocks of ``block_bytes`` each under ``directory`` (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        limit_bytes: int,
        fingerprint: bytes,
        block_bytes: int,
        dtype: torch.dtype,
    ) -> None:
        if len(fingerprint) != 16:
            raise ValueError("the model fingerprint must be 16 bytes")
        self.root = Path(directory)
        self.dir = self.root / fingerprint.hex()
        self.limit_bytes = limit_bytes
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.file_bytes = _HEADER.size + block_bytes
        self.dtype = dtype
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards index, used, pending, fetched
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self.used = 0
        self.pending: dict[bytes, bytes] = {}  # queued for writing, readable meanwhile
        self._pending_bytes = 0
        self.fetched: OrderedDict[bytes, bytearray] = OrderedDict()  # read ahead, oldest first
        self._logged: set[str] = set()
        self._scan()
        self._queue, self._writer = _start_worker("hicache-writer", self._write_queued)
        self._reads, self._reader = _start_worker("hicache-reader", self._read_ahead)

    # ------------------------------------------------------------ API

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self.index or key in self.pending

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block's KV as a flat tensor of ``dtype``; None (and the file gone) if it fails a
        check or cannot be read."""
        with self._lock:
            payload = self.pending.get(key)
            raw = self.fetched.pop(key, None)
            if key in self.index:
                self.index.move_to_end(key)
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=self.dtype)
        else:
            raw = raw if raw is not None else self._read_file(key)
            if raw is None:
                return None
            data = torch.frombuffer(raw, dtype=self.dtype, offset=_HEADER.size)
        self.stats["read_blocks"] += 1
        return data

    def write(self, key: bytes, data: torch.Tensor) -> None:
        """Queue the block ``data`` (``block_bytes`` of KV; copied now) for writing."""
        if self.file_bytes > self.limit_bytes:
            return
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        if len(payload) != self.block_bytes:
            raise ValueError(f"a storage block is {self.block_bytes} bytes, got {len(payload)}")
        with self._lock:
            if key in self.pending or key in self.index:
                return
            if self._pending_bytes + len(payload) > MAX_PENDING_BYTES:
                self.stats["dropped_blocks"] += 1
                return
            self.pending[key] = payload
            self._pending_bytes += len(payload)
        self._queue.put(key)

    def prefetch(self, keys: list[bytes]) -> None:
        """Read these blocks (those on disk, not read ahead already) on the reader thread."""
        with self._lock:
            keys = [k for k in keys if k in self.index and k not in self.fetched]
        for key in keys:
            self._reads.put(key)

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped) and every prefetch is read."""
        self._queue.join()
        self._reads.join()

    def close(self) -> None:
        self.flush()
        for q, thread in ((self._queue, self._writer), (self._reads, self._reader)):
            q.put(None)
            thread.join()

    def check(self) -> None:
        with self._lock:
            assert self.used == sum(self.index.values()), "storage bytes miscounted"
            assert self.used <= self.limit_bytes, (
                f"storage holds {self.used} bytes, over its limit {self.limit_bytes}"
            )

    def get_stats(self) -> dict[str, float]:
        counters = ("written_blocks", "read_blocks", "corrupt_blocks", "write_errors")
        with self._lock:
            return {
                **{k: self.stats[k] for k in counters},
                **self.stats,
                "blocks": len(self.index),
                "bytes": self.used,
            }

    # ------------------------------------------------------------ files

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous run left (oldest first); remove dead writers' temporary
        files; trim to the limit."""
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return  # made at the first write
        files = []
        for e in entries:
            if e.name.endswith(".tmp"):
                self._remove_stale_temp(e)
            elif e.name.endswith(_SUFFIX) and len(e.name) == 2 * 16 + len(_SUFFIX):
                try:
                    st = e.stat()
                    files.append((st.st_mtime_ns, bytes.fromhex(e.name[: -len(_SUFFIX)]), st))
                except (OSError, ValueError):
                    continue
        for _, key, st in sorted(files):
            self.index[key] = st.st_size
            self.used += st.st_size
        with self._lock:
            self._make_room(0)

    @staticmethod
    def _remove_stale_temp(entry: os.DirEntry) -> None:
        """Remove ``<key>.kv.<pid>.tmp`` unless process pid is another one still running (it
        may be writing it)."""
        try:
            pid = int(entry.name.split(".")[-2])
        except (ValueError, IndexError):
            pid = None
        if pid is not None and pid != os.getpid():
            try:
                os.kill(pid, 0)
                return
            except ProcessLookupError:
                pass
            except PermissionError:
                return
        try:
            os.unlink(entry.path)
        except OSError:
            pass

    def _read_file(self, key: bytes) -> bytearray | None:
        """The whole file of ``key`` (header and payload), checked; None if it fails."""
        path = self._path(key)
        raw = bytearray(self.file_bytes + 1)  # one byte more: a longer file is wrong too
        try:
            n = 0
            with open(path, "rb", buffering=0) as f, memoryview(raw) as view:
                while n < len(raw) and (got := f.readinto(view[n:])):
                    n += got
            del raw[n:]
        except OSError as e:
            self._forget(key)
            if not isinstance(e, FileNotFoundError):
                self._log_once("read", f"cannot read {path} ({e}); recomputing")
            return None
        why = self._invalid(raw, key)
        if why is not None:
            self.stats["corrupt_blocks"] += 1
            self._log_once("corrupt", f"{path} is {why}; recomputing it")
            self._forget(key)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return raw

    def _invalid(self, raw: bytearray, key: bytes) -> str | None:
        """Why ``raw`` is not this block's file, or None."""
        if len(raw) < _HEADER.size:
            return f"truncated ({len(raw)} bytes)"
        magic, version, fingerprint, stored_key, length, checksum = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            return "not a radixrt KV block of this version"
        if fingerprint != self.fingerprint:
            return "another model's block"
        if stored_key != key:
            return "another block's file"
        if length != self.block_bytes or len(raw) != _HEADER.size + length:
            return f"of the wrong length ({len(raw)} bytes)"
        if _checksum(raw[:_CHECKED], memoryview(raw)[_HEADER.size :]) != checksum:
            return "corrupt (checksum mismatch)"
        return None

    def _read_ahead(self, key: bytes) -> None:
        with self._lock:
            wanted = key in self.index and key not in self.fetched
        raw = self._read_file(key) if wanted else None
        if raw is not None:
            with self._lock:
                self.fetched[key] = raw
                while len(self.fetched) * self.file_bytes > MAX_FETCHED_BYTES:
                    self.fetched.popitem(last=False)
            self.stats["prefetched_blocks"] += 1

    def _write_queued(self, key: bytes) -> None:
        with self._lock:
            payload = self.pending[key]
        self._write_file(key, payload)
        with self._lock:
            del self.pending[key]
            self._pending_bytes -= len(payload)

    def _write_file(self, key: bytes, payload: bytes) -> None:
        with self._lock:
            self._make_room(self.file_bytes)
        head = _HEADER.pack(_MAGIC, _VERSION, self.fingerprint, key, len(payload), 0)
        header = head[:_CHECKED] + struct.pack("<I", _checksum(head[:_CHECKED], payload))
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self.stats["write_errors"] += 1
            self._log_once(f"write:{e.errno}", f"cannot write {path} ({e}); not stored")
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        with self._lock:
            self.index[key] = self.file_bytes
            self.used += self.file_bytes
        self.stats["written_blocks"] += 1

    def _make_room(self, size: int) -> None:
        """Delete least recently used files until ``size`` more bytes fit (lock held)."""
        while self.index and self.used + size > self.limit_bytes:
            key, n = self.index.popitem(last=False)
            self.used -= n
            self.stats["deleted_blocks"] += 1
            try:
                self._path(key).unlink()
            except OSError:
                pass

    def _forget(self, key: bytes) -> None:
        with self._lock:
            n = self.index.pop(key, None)
            if n is not None:
                self.used -= n

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("hicache storage: %s", message)


def _checksum(header: bytes | memoryview, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(header))


def _start_worker(name: str, handle) -> tuple[queue.Queue, threading.Thread]:
    """A queue and a started daemon thread that calls ``handle(key)`` for each key put on it,
    until None."""
    jobs: queue.Queue[bytes | None] = queue.Queue()

    def serve() -> None:
        while True:
            key = jobs.get()
            try:
                if key is None:
                    return
                handle(key)
            finally:
                jobs.task_done()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    return jobs, thread
