"""Which bf16 linear path is fastest on this CPU, per weight shape and batch size, measured once.

A bf16 linear's best path depends on the CPU: AMX tiles where it has them; elsewhere
AVX512-BF16 dot products, bf16 weights widened to float32 for FMA, oneDNN, or PyTorch's
float32 linear on a float32 copy of the weight, whichever this CPU runs fastest. Decode-sized
calls (up to ``THRESHOLD`` rows) are bound by streaming the weights from memory, prefill-sized
ones by arithmetic, so the two may pick different paths.

``Calibrator.choice(n, k)`` times every path available here on random [n, k] weights at
``SMALL_ROWS`` rows (cycling through up to ``COLD_BYTES`` of copies of the weight, so each
call reads weights its core's caches do not hold, as a decode step does; for a model whose
decode steps run as decode chains, ``chained``, the packed kernels a chain runs take the
copies as one chain, without the per-call costs a chain saves them) and at
``LARGE_ROWS`` rows (one copy: a prefill's weights stay in cache while its rows go by), the
paths taking turns, and returns the fastest of each (``Choice``). Results are kept in
``$RADIXRT_CACHE_DIR/calibration/``, one file per CPU model and flags, kernel library, PyTorch
version, thread count and oneDNN ISA limit (``ONEDNN_MAX_CPU_ISA``), so only the first start
on a machine measures; a shape is measured under an exclusive lock on the file
(``fcntl.flock``), after reading it again, so processes that start together measure it once
and take one result. A measurement taken while other work kept the CPU busy (other
processes, or a hypervisor's steal: ``Contention``) is taken again, up to ``ATTEMPTS`` times; if
the CPU never settles, the least disturbed one serves this start and is not kept, so a later
start measures again. A packed path within ``PACKED_MARGIN`` of the fastest is taken over it:
the packed kernels fuse the rotary embedding and SiLU-and-mul that the other paths run as ops
of their own, which a plain linear's timing does not see.

Exact mode (``Calibrator(..., exact=True)``): every call of a shape runs one row-invariant
path, so a row's bits do not depend on its batch: only the packed kernels are timed (on
weights padded to whole chunks where ``K`` is not, ``PadK``), and the one with the least sum
of slowdowns against each class's fastest serves both classes (``Choice(p, p)``). Every process
of one CPU model must take the same choices (data-parallel replicas start together; a later
engine must match a running server), so the file's name leaves out the thread count, chain
use, PyTorch version and oneDNN limit, and a choice is kept once measured, even on a busy CPU.
A cache the process cannot lock or write is refused there (``NotExact``) rather than measured
per process.

``Calibrator.quant_choice(qtype, n, k)`` times the quantized kernels' paths
(``radixrt_kernels.cpu.quant``: AVX2, AVX-512 VNNI, AMX-int8, those that run here; the portable
one where no other does) on random blocks of the type, at ``QUANT_ROWS`` rows as the decode-sized
timing above and at ``LARGE_ROWS`` as the prefill-sized one. AMX tiles cost most at one row and
least at many, so the choice is a path for the fewest rows, one for the most, and the row count
up to which the first is as fast (``QuantChoice``). Those paths give the same bits, so exact
mode takes the fastest as well.

``Calibrator.attention_dots(kv_heads, group, head_dim)`` settles the same question for the
CPU attention kernel's bf16 work that AMX does not take: AVX512-BF16 dot products, or the
values widened to float32 for FMA (vdpbf16ps has half FMA's throughput on some CPUs, twice
its flops on others). It times a decode batch and an extend of that attention shape both
ways; kept and shared as the linears' choices are (with ``exact``, as in exact mode).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from radixrt.model.linear_methods import (
    LinearMethod,
    OneDNNLinear,
    PackedF32Linear,
    PackedKernels,
    PackedLinear,
    PadK,
    TorchFP32Linear,
    onednn_works,
)
from radixrt.quant.formats import random_blocks
from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear
from radixrt_kernels.cpu import quant as cpu_quant

logger = logging.getLogger(__name__)

THRESHOLD = 64  # rows: up to here a call is decode-sized
SMALL_ROWS, LARGE_ROWS = 16, 512  # the row counts each class is timed at
COLD_BYTES = 64 << 20  # weight copies cycled through for the decode-sized timing ...
MAX_COPIES = 64  # ... at most this many
PACKED = frozenset(cpu_linear.KERNELS)
OTHERS = ("onednn", "torch_fp32", "torch")
PATHS = (*cpu_linear.KERNELS, *OTHERS)  # a bf16 weight's
F32 = "f32"  # a float32 weight's row-invariant path (``PackedF32Linear``)


class NotExact(ValueError):
    """Exact mode cannot run here (the message says why)."""


class Choice(NamedTuple):
    """The path for calls of up to THRESHOLD rows (``small``) and above (``large``)."""

    small: str
    large: str


def available_paths(lib, k: int) -> list[str]:
    """The paths that run here for weights of ``k`` input features."""
    paths = [p for p in cpu_linear.KERNELS if k % cpu_linear.K_MULTIPLE == 0]
    paths = [p for p in paths if cpu_linear.kernel_available(lib, p)]
    if onednn_works():
        paths.append("onednn")
    return [*paths, "torch_fp32", "torch"]


def row_invariant_paths(lib) -> list[str]:
    """The packed kernels that run here: the bf16 paths that give a row the same bits in any
    batch, for weights of any width (``PadK`` pads the ones the kernels do not take)."""
    return [p for p in cpu_linear.KERNELS if cpu_linear.kernel_available(lib, p)]


def make_method(name: str, lib, k: int = cpu_linear.K_MULTIPLE):
    """A plain linear method for ``name``, one of ``PATHS`` or ``F32``, on weights of ``k``
    input features (a packed kernel on a ``k`` it does not take: padded, ``PadK``)."""
    if name in PACKED:
        method = PackedLinear(lib, PackedKernels(name, name, THRESHOLD))
        return PadK(method, k) if k % cpu_linear.K_MULTIPLE else method
    if name == F32:
        return PackedF32Linear(lib)
    methods = {"onednn": OneDNNLinear, "torch_fp32": TorchFP32Linear, "torch": LinearMethod}
    if name not in methods:
        raise ValueError(f"unknown linear path {name!r} (one of {PATHS}, or {F32!r})")
    return methods[name]()


VERSION = "3"  # of the measurement: files of another version are measured again
BUSY_CORES = 0.25  # others' use of the CPU during a measurement beyond this many cores: unsettled
ATTEMPTS = 3  # measurements of one shape at most, while the CPU stays busy
PACKED_MARGIN = 1.05  # a packed path this close to the fastest is taken (see the module's text)


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) clock ticks since boot of the CPUs this process may run on, from
    /proc/stat's per-CPU lines (steal counts as busy); None where there is no /proc/stat."""
    try:
        mine = os.sched_getaffinity(0)
        busy = total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not (name.startswith("cpu") and name[3:].isdigit()) or int(name[3:]) not in mine:
                    continue
                fields = [int(v) for v in values[:8]]
                total += sum(fields)
                busy += sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    except (OSError, ValueError, AttributeError):
        return None
    return busy, total


class Contention:
    """``with Contention() as c:`` ... then ``c.cores``: the cores' worth of CPU time that work
    other than this process (other processes, a hypervisor's steal) took on the CPUs this
    process may run on while the block ran (0 where the OS does not say). Work pinned to other
    CPUs (another data-parallel replica) does not count."""

    def __enter__(self) -> Contention:
        self.cores = 0.0
        self._start = (_cpu_ticks(), time.process_time(), time.monotonic())
        return self

    def __exit__(self, *exc) -> None:
        ticks0, own0, t0 = self._start
        ticks1, own1, t1 = _cpu_ticks(), time.process_time(), time.monotonic()
        if ticks0 is None or ticks1 is None or t1 <= t0:
            return
        busy = (ticks1[0] - ticks0[0]) / os.sysconf("SC_CLK_TCK")
        self.cores = max(0.0, (busy - (own1 - own0)) / (t1 - t0))


def settled(measure, what: str, kept: bool = False):
    """``measure()``'s result and the contention it saw: measured again while others kept the
    CPU busy (at most ATTEMPTS times); the least disturbed attempt (``kept``: its caller keeps
    it even so)."""
    attempts = []
    for _ in range(ATTEMPTS):
        with Contention() as busy:
            result = measure()
        attempts.append((busy.cores, result))
        if busy.cores <= BUSY_CORES:
            break
        logger.info("other work used %.2f cores while %s was measured: again", busy.cores, what)
    cores, result = min(attempts, key=lambda a: a[0])
    if cores > BUSY_CORES:
        logger.warning(
            "the CPU stayed busy (%.2f cores of other work) while %s was measured: %s",
            cores,
            what,
            "kept all the same (exact mode: every process takes the first result)"
            if kept
            else "this start uses the result, a later one measures again",
        )
    return result, cores


ROUNDS = 3  # timing rounds, the paths taking turns within each (noise hits them alike)


def _chain_kernel(method: LinearMethod) -> str | None:
    """The kernel a decode chain would run this method's calls on (None: it runs alone)."""
    if isinstance(method, PackedLinear) and method.kernels.small in cpu_chain.KERNELS:
        return method.kernels.small
    return None


def time_paths(
    methods: dict[str, LinearMethod], n: int, k: int, rows: int, cold: bool, chained: bool = False
) -> dict:
    """Seconds per call of each method on [rows, k] · [n, k]ᵀ: the best of ROUNDS rounds, in
    each of which every method runs once over its weight copies. ``chained``: the packed
    kernels a decode chain runs (``radixrt_kernels.cpu.chain``) take the copies as one chain,
    as the model's decode steps will run them."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    copies = min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / (n * k * 2)))) if cold else 1
    best = dict.fromkeys(methods, float("inf"))
    with torch.inference_mode():
        for method in methods.values():  # warm-up (and a check that the path runs)
            method.apply(x, method.prepare(w.clone()), None, n)
        for _ in range(ROUNDS):
            for name, method in methods.items():
                weights = [method.prepare(w.clone()) for _ in range(copies)]
                run = functools.partial(_call_each, method, x, weights, n)
                kernel = _chain_kernel(method) if chained else None
                if kernel is not None:
                    chain = cpu_chain.Chain(method.lib)
                    out = torch.empty(rows, n, dtype=torch.bfloat16)
                    for wc in weights:
                        chain.linear(kernel, x, wc, n, out)
                    run = chain.run
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], (time.perf_counter() - t0) / copies)
                del weights, run
    return best


def _call_each(method: LinearMethod, x: torch.Tensor, weights: list, n: int) -> None:
    for wc in weights:
        method.apply(x, wc, None, n)


SECOND_LAYOUT_GAIN = 0.9  # a second copy of a weight must make its calls this much faster


def _layout(path: str) -> str:
    return "packed" if path in PACKED else path


def _fastest(seconds: dict[str, float]) -> str:
    """The fastest path, or a packed one within PACKED_MARGIN of it."""
    best = min(seconds, key=seconds.get)
    packed = [p for p in seconds if p in PACKED]
    if packed:
        fastest_packed = min(packed, key=seconds.get)
        if seconds[fastest_packed] <= PACKED_MARGIN * seconds[best]:
            return fastest_packed
    return best


def _best_large(seconds: dict[str, float], small: str) -> str:
    """The fastest prefill-sized path (``_fastest``), unless it needs a second layout of the
    weight and is not SECOND_LAYOUT_GAIN faster than the best path on the decode-sized path's
    layout."""
    best = _fastest(seconds)
    same = [p for p in seconds if _layout(p) == _layout(small)]
    alt = min(same, key=seconds.get)
    if _layout(best) != _layout(small) and seconds[best] > SECOND_LAYOUT_GAIN * seconds[alt]:
        return alt
    return best


def _one_path(small: dict[str, float], large: dict[str, float]) -> str:
    """The path for every call of a shape (exact mode): the least sum of its slowdowns against
    each class's fastest (decode-sized alone where there is no prefill-sized timing)."""

    def cost(path: str) -> float:
        slow = small[path] / min(small.values())
        return slow + (large[path] / min(large.values()) if large else 0.0)

    return min(small, key=cost)


def time_quant_paths(
    lib, qtype: str, n: int, k: int, paths: list[str], rows: int, cold: bool, chained: bool
) -> dict[str, float]:
    """Seconds per call of each quantized kernel path on [rows, k] · [n, k]ᵀ for random
    ``qtype`` blocks, as ``time_paths`` times the bf16 ones (``cold``: cycling through weight
    copies; ``chained``: the copies as one decode chain)."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    packed = cpu_quant.pack(lib, qtype, random_blocks(qtype, n, k, gen), k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    copies = min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / packed.numel()))) if cold else 1
    weights = [packed] + [packed.clone() for _ in range(copies - 1)]
    best = dict.fromkeys(paths, float("inf"))

    def each(path: str) -> None:
        for w in weights:
            cpu_quant.linear(lib, qtype, x, w, n, k, force_path=path)

    runs = {p: functools.partial(each, p) for p in paths}
    if chained:
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        for p in paths:
            chain = cpu_chain.Chain(lib)
            for w in weights:
                chain.quant_linear(qtype, x, w, n, k, out, path=p)
            runs[p] = chain.run
    for run in runs.values():  # warm-up
        run()
    for _ in range(ROUNDS):
        for p, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[p] = min(best[p], (time.perf_counter() - t0) / copies)
    return best


QUANT_ROWS = (1, 4, 16, THRESHOLD)  # the decode-sized row counts quantized paths are timed at


class QuantChoice(NamedTuple):
    """A quantized weight's paths: ``small`` for calls of up to ``rows`` rows, ``large`` above."""

    small: str
    large: str
    rows: int


def _quant_paths(seconds: dict[int, dict[str, float]]) -> QuantChoice:
    """From each path's seconds per call at each timed row count: the fastest at the fewest
    rows, the fastest at the most, and the most rows at which the first is as fast."""
    fewest, most = min(seconds), max(seconds)
    small = min(seconds[fewest], key=seconds[fewest].get)
    large = min(seconds[most], key=seconds[most].get)
    rows = max(r for r, t in seconds.items() if t[small] <= t[large])
    return QuantChoice(small, large, rows)


ATTN_REQUESTS, ATTN_KEYS, ATTN_NEW = 16, 512, 128  # the attention timing's batch


def _attention_calls(kv_heads: int, group: int, head_dim: int) -> list[tuple]:
    """(q, k_buf, v_buf, segments) of a decode batch (ATTN_REQUESTS requests of ATTN_KEYS
    keys each, in scattered slots) and an extend (ATTN_NEW new tokens after ATTN_KEYS cached
    ones), bf16 with random values."""
    gen = torch.Generator().manual_seed(kv_heads * 131 + group * 17 + head_dim)
    n, h = ATTN_REQUESTS * ATTN_KEYS, kv_heads * group
    k_buf, v_buf = (torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    slots = torch.randperm(n, generator=gen)
    ones, zeros = (f(ATTN_REQUESTS, dtype=torch.int64) for f in (torch.ones, torch.zeros))
    decode = cpu_attention.Segments(
        slots,
        torch.arange(ATTN_REQUESTS + 1) * ATTN_KEYS,
        torch.arange(ATTN_REQUESTS),
        torch.arange(ATTN_REQUESTS + 1),
        zeros,
        ones,
    )
    keys = ATTN_KEYS + ATTN_NEW
    extend = cpu_attention.Segments(
        slots[:keys],
        torch.tensor([0, keys]),
        torch.arange(ATTN_NEW),
        torch.tensor([0, ATTN_NEW]),
        torch.zeros(1, dtype=torch.int64),
        torch.ones(ATTN_NEW, dtype=torch.int64),
        torch.ones(1, dtype=torch.int64),
    )
    return [
        (torch.randn(rows, h, head_dim, generator=gen).bfloat16(), k_buf, v_buf, seg)
        for rows, seg in ((ATTN_REQUESTS, decode), (ATTN_NEW, extend))
    ]


def time_attention(lib, kv_heads: int, group: int, head_dim: int) -> dict[str, float]:
    """Seconds per decode-and-extend pair of attention calls, with dot products ("dots") and
    widened to float32 ("fma"): the best of ROUNDS rounds, the two taking turns."""
    calls = _attention_calls(kv_heads, group, head_dim)
    best = {"dots": float("inf"), "fma": float("inf")}
    for _ in range(ROUNDS + 1):  # the first round warms up
        for name in best:
            t0 = time.perf_counter()
            for q, k_buf, v_buf, seg in calls:
                cpu_attention.attention(
                    lib, q, k_buf, v_buf, seg, head_dim**-0.5, bf16_dots=name == "dots"
                )
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


class Calibrator:
    """The per-shape choices for the CPU it runs on, measured on first use and cached on disk."""

    def __init__(
        self,
        lib,
        cache_dir: str,
        threads: int | None = None,
        chained: bool = False,
        exact: bool = False,
    ) -> None:
        """``chained``: the model's small decode batches run as decode chains, so the packed
        kernels' decode-sized calls are timed as a chain runs them. ``exact``: each shape runs
        one packed kernel for every row count (``Choice(p, p)``), and every process on this
        machine takes the same choices (see the module's text)."""
        self.lib, self.cache_dir, self.chained, self.exact = lib, cache_dir, chained, exact
        self.threads = threads or torch.get_num_threads()
        name = f"linear-exact-{self._key()}" if exact else f"linear-{self._key()}"
        self.path = Path(cache_dir) / "calibration" / f"{name}.json"
        self.table: dict[str, dict] = self._read()

    def _key(self) -> str:
        """What the choices depend on; in exact mode only what every process of this CPU model
        shares (not its thread count, chains or oneDNN limit: the packed kernels' results do
        not depend on them)."""
        parts = [VERSION, cpu_library._cpu_features(), getattr(self.lib, "_name", "")]
        if not self.exact:
            parts += [torch.__version__, str(self.threads), "chained" if self.chained else ""]
            parts += [os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def _read(self) -> dict[str, dict]:
        """The kept entries (outside exact mode, what was measured on a busy CPU served only its
        own start and is left out)."""
        try:
            kept = json.loads(self.path.read_text())
        except (OSError, ValueError):
            kept = {}
        return {
            key: entry
            for key, entry in (kept.items() if isinstance(kept, dict) else ())
            if isinstance(entry, dict)
            and (self.exact or entry.get("busy_cores", 0.0) <= BUSY_CORES)
        }

    def choice(self, n: int, k: int, large: bool = True) -> Choice:
        """The fastest path for weights [n, k] per class of calls (``large`` False: only
        decode-sized calls happen, as for an LM head; both classes get that path). In exact
        mode one packed kernel for both."""
        key = f"{n}x{k}" + ("" if large else ":small")
        entry = self._entry(key, self._valid_choice, lambda: self._measure(n, k, large))
        return Choice(entry["small"], entry["large"])

    def _valid_choice(self, entry: dict) -> bool:
        small, large = entry.get("small"), entry.get("large")
        if self.exact:
            return small == large and small in row_invariant_paths(self.lib)
        return small in PATHS and large in PATHS

    def quant_choice(self, qtype: str, n: int, k: int, large: bool = True) -> QuantChoice:
        """The quantized kernel paths for ``qtype`` weights [n, k] (``large`` False: only
        decode-sized calls happen, as for an LM head). Every path gives the same bits, so exact
        mode takes the fastest as well."""
        paths = [p for p in cpu_quant.PATHS if cpu_quant.path_available(self.lib, qtype, p)]
        if len(paths) > 1:
            paths.remove("portable")  # the scalar reference build, never the fastest
        key = f"{qtype}:{n}x{k}" + ("" if large else ":small")

        def valid(entry: dict) -> bool:
            return (
                entry.get("small") in paths
                and entry.get("large") in paths
                and isinstance(entry.get("rows"), int)
            )

        measure = functools.partial(self._measure_quant, qtype, n, k, paths, large)
        entry = self._entry(key, valid, measure)
        return QuantChoice(entry["small"], entry["large"], entry["rows"])

    def _measure_quant(self, qtype: str, n: int, k: int, paths: list[str], large: bool) -> dict:
        t0 = time.perf_counter()
        steps = [*QUANT_ROWS, LARGE_ROWS] if large else list(QUANT_ROWS)

        def measure() -> dict[int, dict[str, float]]:
            return {
                rows: time_quant_paths(
                    self.lib, qtype, n, k, paths, rows, rows <= THRESHOLD, self.chained
                )
                for rows in steps
            }

        seconds, busy = settled(measure, f"the {qtype} {n}x{k} linear", self.exact)
        choice = _quant_paths(seconds)
        logger.info(
            "calibrated the %s %dx%d linear in %.1f s: %s up to %d rows, %s above",
            qtype,
            n,
            k,
            time.perf_counter() - t0,
            choice.small,
            choice.rows,
            choice.large,
        )
        return {**choice._asdict(), "seconds": seconds, "busy_cores": busy}

    def attention_dots(self, kv_heads: int, group: int, head_dim: int) -> bool:
        """Whether the CPU attention kernel runs this shape's bf16 work faster on dot products
        (False where this build has none). An exact Calibrator's: the choice every process
        sharing its file takes."""
        if not cpu_attention.dots_available(self.lib):
            return False
        key = f"attention:{kv_heads}x{group}x{head_dim}"
        valid = lambda entry: isinstance(entry.get("dots"), bool)  # noqa: E731
        measure = functools.partial(self._measure_attention, kv_heads, group, head_dim)
        return self._entry(key, valid, measure)["dots"]

    def _measure_attention(self, kv_heads: int, group: int, head_dim: int) -> dict:
        seconds, busy = settled(
            lambda: time_attention(self.lib, kv_heads, group, head_dim), "attention", self.exact
        )
        entry = {"dots": seconds["dots"] < seconds["fma"], "seconds": seconds, "busy_cores": busy}
        logger.info(
            "calibrated attention (%d KV heads x %d, head_dim %d): %s",
            kv_heads,
            group,
            head_dim,
            "dot products" if entry["dots"] else "float32 FMA",
        )
        return entry

    def _entry(self, key: str, valid: Callable[[dict], bool], measure: Callable[[], dict]) -> dict:
        """The kept entry for ``key`` (where ``valid``), else ``measure()``'s, kept. The file is
        read again and written under an exclusive lock, and measured only if still without the
        entry: processes that start together measure once and all take that result."""
        entry = self.table.get(key)
        if entry is not None and valid(entry):
            return entry
        with self._locked():
            self.table.update(self._read())  # what another process kept meanwhile comes first
            entry = self.table.get(key)
            if entry is None or not valid(entry):
                entry = self.table[key] = measure()
                self._save()
        return entry

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on the calibration file (fcntl.flock on a file beside it) while
        the block runs; other processes wait for it."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            f = open(lock, "a")
        except OSError as e:
            self._unshared(f"could not lock the linear calibration {lock}: {e}")
            f = None
        if f is None:
            yield
            return
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
            yield

    def _unshared(self, why: str) -> None:
        """A choice this process cannot share: refused in exact mode, else only noted."""
        if self.exact:
            raise NotExact(f"{why} (exact mode: every process must take the same choices)")
        logger.warning("%s", why)

    def _measure(self, n: int, k: int, large: bool) -> dict:
        t0 = time.perf_counter()
        paths = row_invariant_paths(self.lib) if self.exact else available_paths(self.lib, k)
        methods = {p: make_method(p, self.lib, k) for p in paths}

        def measure() -> tuple[dict, dict]:
            small = time_paths(methods, n, k, SMALL_ROWS, True, self.chained and large)
            return small, time_paths(methods, n, k, LARGE_ROWS, False) if large else {}

        (small, big), busy = settled(measure, f"the {n}x{k} linear", self.exact)
        if self.exact:
            best_small = best_large = _one_path(small, big)
        else:
            best_small = _fastest(small)
            best_large = _best_large(big, best_small) if big else best_small
        logger.info(
            "calibrated the %dx%d linear in %.1f s: %s up to %d rows, %s above",
            n,
            k,
            time.perf_counter() - t0,
            best_small,
            THRESHOLD,
            best_large,
        )
        return {
            "small": best_small,
            "large": best_large,
            "seconds": {"small": small, "large": big},
            "busy_cores": busy,
        }

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.table, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache
            self._unshared(f"could not keep the linear calibration in {self.path}: {e}")
