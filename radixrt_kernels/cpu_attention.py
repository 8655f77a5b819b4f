"""Attention on the CPU, decode and extend: a C kernel (``cpu/attention.c``), cascade-aware.

The Triton kernels need a GPU; on the CPU this C kernel reads K/V straight
from the KV buffers through slot indices (no gathered copy), reads a prefix
shared by several requests once for all of them, and merges each query
token's parts by their log-sum-exps in the same call. It is compiled on first use with
the system C compiler (``-O3 -march=native``, OpenMP) into
``CACHE_DIR/kernels/`` and loaded with ctypes; it links against the OpenMP
runtime PyTorch already loaded, so it runs on PyTorch's threads.

``load(cache_dir)`` returns the library, or None when it cannot be built
(no compiler, or PyTorch not on libgomp); ``why_unavailable()`` says why.
Callers then fall back to PyTorch's kernels.

Segments: a query token's keys are one or two segments; a segment is a list
of slots plus the query tokens (members) that attend to it. In decode a shared
prefix is one segment for the requests of its group (part 0), a private tail
one for its request (part 1, or part 0 when the request has no shared prefix).
In extend a request's whole sequence is one causal segment for its new tokens:
they are its last keys, and each sees the keys up to itself.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu") / "attention.c"
HEADER = SOURCE.with_name("common.h")  # included by the source
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC"]
DIM_MULTIPLE = 32  # head_dim must be a multiple of this (the kernel's P·V chunk) ...
MAX_DIM = 256      # ... and at most this
DTYPES = (torch.float32, torch.bfloat16)

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


@dataclass
class Segments:
    """A forward's key segments, as the kernel takes them (all int64, on the CPU)."""
    slots: torch.Tensor         # every segment's slots, one after another
    slot_start: torch.Tensor    # [S + 1] offsets into slots
    members: torch.Tensor       # every segment's query tokens (rows of q), one after another
    member_start: torch.Tensor  # [S + 1] offsets into members
    part: torch.Tensor          # [S] 0 or 1: where a member's result for this segment goes
    num_parts: torch.Tensor     # [T] 1 or 2 per query token
    causal: torch.Tensor | None = None  # [S] 1: the members are the segment's last keys, in order,
    # and each sees the keys up to itself (None: no causal segment)


def why_unavailable() -> str | None:
    return _why


def supports(k_buf: torch.Tensor) -> bool:
    """True if the kernel takes this KV buffer [N, KH, D] (CPU, float32 or bfloat16, a head_dim
    it handles); queries are cast to its dtype."""
    d = k_buf.shape[-1]
    return k_buf.device.type == "cpu" and k_buf.dtype in DTYPES and d % DIM_MULTIPLE == 0 and d <= MAX_DIM


def load(cache_dir: str) -> ctypes.CDLL | None:
    """The compiled kernel, or None. Built once per source, flags, compiler and CPU (kept in
    ``cache_dir/kernels``), loaded once per process: later calls return the first answer."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        _lib = _build_and_load(Path(cache_dir) / "kernels")
    except Exception as e:  # no compiler, a failed build: PyTorch's kernels do the work instead
        _why = f"{type(e).__name__}: {e}"
    return _lib


def _torch_libgomp() -> str:
    """Path of the libgomp PyTorch loaded (linking to it shares its thread pool)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libgomp" in os.path.basename(path) and path.startswith("/"):
                return path
    raise RuntimeError("PyTorch's OpenMP runtime is not libgomp")


def _cpu_features() -> str:
    """The CPU's model and feature flags: what -march=native compiles for (a library built on
    another CPU could hold instructions this one lacks)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(dict.fromkeys(lines))  # first core's lines, once each
    except OSError:
        return platform.processor()


def _build_and_load(folder: Path) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    gomp = _torch_libgomp()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), HEADER.read_text(), " ".join(CFLAGS), cc, version, gomp,
                                    _cpu_features()]).encode()).hexdigest()[:16]
    target = folder / f"attention-{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
            for cmd in ([cc, *CFLAGS, "-c", str(SOURCE), "-o", str(obj)],
                        [cc, "-shared", str(obj), gomp, "-lm", "-o", str(lib)]):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
            os.replace(lib, target)  # atomic: concurrent builders each publish a whole file
    lib = ctypes.CDLL(str(target))
    fn = lib.radixrt_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, i64, ctypes.c_float,
                   i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64]
    fn.restype = ctypes.c_int
    return lib


def attention(lib: ctypes.CDLL, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
              seg: Segments, scaling: float, new_kv: tuple[torch.Tensor, torch.Tensor,
                                                    torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D] (the query tokens), k_buf/v_buf [N, KH, D] (contiguous, same dtype) → o [T, H, D].

    ``new_kv``: (k, v [n, KH, D], slots int64 [n]): the forward's new K/V, written into the
    buffers at those slots first (one call instead of a store and an attention)."""
    t, h, d = q.shape
    kh = k_buf.shape[1]
    if not (q.is_contiguous() and k_buf.is_contiguous() and v_buf.is_contiguous()):
        raise ValueError("attention: q, k_buf and v_buf must be contiguous")
    out = torch.empty_like(q)
    acc = torch.empty(t, 2, h, d, dtype=torch.float32)  # touched only for tokens with two parts
    ml = torch.empty(2, t, 2, h, dtype=torch.float32)
    new_k = new_v = new_slots = None
    if new_kv is not None:
        new_k, new_v, new_slots = new_kv
        if not (new_k.dtype == new_v.dtype == k_buf.dtype and new_k.is_contiguous() and new_v.is_contiguous()
                and new_k.shape == new_v.shape == (new_slots.numel(), kh, d)
                and new_slots.dtype == torch.int64 and new_slots.is_contiguous()):
            raise ValueError("attention: new k/v must be contiguous [n, KH, D] in the buffers' dtype, "
                             "their slots contiguous int64 [n]")
    rc = lib.radixrt_attention(
        q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), out.data_ptr(), int(q.dtype == torch.bfloat16),
        t, h, kh, d, scaling, seg.part.numel(), seg.slots.data_ptr(), seg.slot_start.data_ptr(),
        seg.members.data_ptr(), seg.member_start.data_ptr(), seg.part.data_ptr(),
        None if seg.causal is None else seg.causal.data_ptr(), seg.num_parts.data_ptr(),
        acc.data_ptr(), ml[0].data_ptr(), ml[1].data_ptr(), torch.get_num_threads(),
        None if new_k is None else new_k.data_ptr(), None if new_v is None else new_v.data_ptr(),
        None if new_slots is None else new_slots.data_ptr(), 0 if new_slots is None else new_slots.numel())
    if rc != 0:
        raise ValueError(f"attention: unsupported shape (H {h}, KH {kh}, D {d})")
    return out
