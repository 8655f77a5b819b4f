"""The CPU kernels' library: the C sources beside this module, built on first use.

One C file per concern, each with its wrapper module: ``attention.c`` (attention through slot
indices, ``attention``), ``elementwise.c`` (RMS norm, rotary embedding, SiLU-and-mul,
``elementwise``), ``sampling.c`` (argmax, the grammar bitmask, ``sampling_ops``),
``linear_amx.c`` and ``linear_vec.c`` (bf16 linear layers with AMX, or AVX512-BF16 and FMA,
``linear``), ``quant.c``, ``quant_x86.c`` and ``quant_amx.c`` (linear layers on
GGUF-quantized weights, ``quant``), ``linear_f32.c`` (float32 linear layers, ``linear``),
``chain.c`` (several steps in one call, ``chain``) and ``moe.c`` (a mixture-of-experts block's
routed experts in one call, ``experts``). They are compiled with the system C
compiler (``-O3 -march=native``, OpenMP) into one library in ``CACHE_DIR/kernels/`` and loaded
with ctypes. The library links against the OpenMP runtime PyTorch already loaded, so its loops
run on PyTorch's threads.

``RADIXRT_KERNEL_CFLAGS`` adds flags to the build (``-mno-amx-tile``: the
library as it is built for a CPU without AMX).

``load(cache_dir)`` returns the library, or None when it cannot be built (no
compiler, or PyTorch not on libgomp); ``why_unavailable()`` says why. Callers
then fall back to PyTorch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FOLDER = Path(__file__).parent
SOURCES = [
    FOLDER / n
    for n in (
        "attention.c",
        "chain.c",
        "elementwise.c",
        "linear_amx.c",
        "linear_f32.c",
        "linear_vec.c",
        "moe.c",
        "quant.c",
        "quant_amx.c",
        "quant_x86.c",
        "sampling.c",
    )
]
HEADERS = [FOLDER / n for n in ("common.h", "linear_out.h", "parts.h", "quant.h")]
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC"]

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # these return int: 0, or -1 on a size they do not take (_available: 1 or 0)
    "radixrt_attention": [
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _int,
        _int,
        _int,
        _i64,
        _i64,
        _i64,
        _i64,
        _f32,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _int,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _f32,
    ],
    "radixrt_rms_norm": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int, _int],
    "radixrt_rms_norm_heads": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _f32, _int, _int],
    "radixrt_rope": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int, _int],
    "radixrt_silu_mul": [_ptr, _ptr, _i64, _i64, _int, _int],
    "radixrt_argmax": [_ptr, _i64, _i64, _i64, _int, _ptr, _int],
    "radixrt_apply_token_bitmask": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _int],
    "radixrt_linear": [
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _int,
        _int,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _int,
    ],
    "radixrt_linear_pack": [_ptr, _i64, _i64, _ptr],
    "radixrt_linear_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "radixrt_linear_available": [],
    "radixrt_attention_dots_available": [],
    "radixrt_linear_vec_available": [_int],
    "radixrt_chain": [_ptr, _i64, _int],
    "radixrt_chain_fields": [],
    "radixrt_chain_attention_fields": [],
    "radixrt_quant_pack": [_int, _ptr, _i64, _i64, _i64, _ptr],
    "radixrt_quant_dequantize": [_int, _ptr, _i64, _i64, _ptr],
    "radixrt_quant_rows": [_int, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _int],
    "radixrt_quant_rows_packed": [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int],
    "radixrt_quant_linear": [
        _int,
        _ptr,
        _i64,
        _int,
        _ptr,
        _ptr,
        _int,
        _ptr,
        _i64,
        _int,
        _i64,
        _i64,
        _i64,
        _int,
        _int,
    ],
    "radixrt_quant_path": [_int, _i64],
    "radixrt_moe": [
        _ptr,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _int,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _ptr,
        _i64,
        _int,
    ],
    "radixrt_quant_path_available": [_int, _int],
}
# radixrt_linear_vec: a kernel number, then radixrt_linear's arguments
SIGNATURES["radixrt_linear_vec"] = [_int, *SIGNATURES["radixrt_linear"]]
RESTYPES = {
    "radixrt_quant_packed_bytes": (ctypes.c_int64, [_int, _i64, _i64]),
    "radixrt_decode_segments": (
        ctypes.c_int64,
        [
            _ptr,
            _i64,
            _ptr,
            _ptr,
            _i64,
            _i64,
            _i64,
            _i64,
            _int,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
        ],
    ),
}  # the others: int

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


def why_unavailable() -> str | None:
    return _why


def loaded() -> ctypes.CDLL | None:
    """The library if ``load`` built it in this process already (never builds)."""
    return _lib


def load(cache_dir: str) -> ctypes.CDLL | None:
    """The compiled library, or None. Built once per sources, flags, compiler and CPU (kept in
    ``cache_dir/kernels``), loaded once per process: later calls return the first answer."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        _lib = _build_and_load(Path(cache_dir) / "kernels")
    except Exception as e:  # no compiler, a failed build: PyTorch's ops do the work instead
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


def compiler() -> str | None:
    """The C compiler the library builds with: ``$CC``, else gcc or cc on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def compile_library(sources: list[Path], folder: Path, name: str) -> Path:
    """``sources`` compiled as this library is (its compiler, ``CFLAGS`` and
    ``RADIXRT_KERNEL_CFLAGS``, its headers on the include path, linked to PyTorch's libgomp) into
    ``folder/<name>-<key>.so``; returns that path. The key hashes the sources, the headers,
    flags, compiler, OpenMP runtime and CPU, so a change to any of them builds a new file.
    Raises RuntimeError naming the failed command."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    gomp = _torch_libgomp()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f.read_text() for f in sources + HEADERS]
    flags = [*CFLAGS, *os.environ.get("RADIXRT_KERNEL_CFLAGS", "").split()]
    key = hashlib.sha256(
        "\0".join([*texts, " ".join(flags), cc, version, gomp, _cpu_features()]).encode()
    ).hexdigest()[:16]
    target = folder / f"{name}-{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            objs = [str(Path(tmp) / f"{src.stem}.o") for src in sources]
            lib = Path(tmp) / "k.so"
            cmds = [
                [cc, *flags, f"-I{FOLDER}", "-c", str(src), "-o", obj]
                for src, obj in zip(sources, objs)
            ]
            for cmd in [*cmds, [cc, "-shared", *objs, gomp, "-lm", "-o", str(lib)]]:
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
            os.replace(lib, target)  # atomic: concurrent builders each publish a whole file
    return target


def _build_and_load(folder: Path) -> ctypes.CDLL:
    return load_file(compile_library(SOURCES, folder, "radixrt-cpu"))


def load_file(path: Path) -> ctypes.CDLL:
    """A built library at ``path``, its functions given this module's signatures."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    for name, (restype, argtypes) in RESTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
