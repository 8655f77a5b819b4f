"""Where model files live and how they are read: radixrt's cache directory, the tensors of a
folder's safetensors files, and a fingerprint of a model's files.

- ``cache_dir()``: ``$RADIXRT_CACHE_DIR`` or ``~/.cache/radixrt`` (converted models, the CPU
  kernels' builds, calibration, tiny test models); ``make_shareable`` gives a folder renamed
  into it the permissions the umask allows.
- ``iter_weights(folder)``: ``(name, tensor)`` for every tensor of the folder's shards.
- ``model_fingerprint(folder, *layout)``: 16 bytes naming a model's KV (its files and the KV
  layout), for anything stored across runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["cache_dir", "iter_weights", "make_shareable", "model_fingerprint"]


def cache_dir() -> str:
    """radixrt's cache directory: ``$RADIXRT_CACHE_DIR`` or ``~/.cache/radixrt``."""
    return str(Path(os.environ.get("RADIXRT_CACHE_DIR") or "~/.cache/radixrt").expanduser())


def iter_weights(
    path: str | os.PathLike[str], *, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the folder's safetensors files.

    If ``model.safetensors.index.json`` exists only the shards it lists are read
    (some repos also ship a duplicate ``consolidated.safetensors``); otherwise
    every ``*.safetensors`` file, in sorted order.  ``path`` may also be a single
    ``.safetensors`` file.  Tensors keep their stored dtype.
    """
    from safetensors import safe_open

    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    else:
        index = p / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            files = [p / name for name in sorted(set(weight_map.values()))]
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(p)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_FINGERPRINT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "radixrt-gguf.json",  # a GGUF model's folder: the file it names (path, size, time)
)


def model_fingerprint(path: str | os.PathLike[str], *layout: object) -> bytes:
    """16 bytes naming a model's KV: its config, weights and tokenizer files (their bytes)
    and ``layout`` (the KV's dtype and shape, as the caller lays it out). Two models, or one
    model laid out two ways, never share a fingerprint."""
    p = Path(path).expanduser()
    h = hashlib.blake2b(repr(layout).encode(), digest_size=16)
    names = [n for n in _FINGERPRINT_FILES if (p / n).is_file()]
    names += sorted(f.name for f in p.glob("*.safetensors"))
    for name in names:
        h.update(b"\0" + name.encode() + b"\0")
        with open(p / name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.digest()


def _current_umask() -> int:
    try:  # Linux: read it without changing it (os.umask is process-wide and racy)
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def make_shareable(folder: str | os.PathLike[str]) -> None:
    """Give ``folder`` and its files the permissions the umask allows.

    ``tempfile.mkdtemp`` (and some writers) create owner-only entries; a cache
    folder renamed into place from there should look like any other folder.
    """
    umask = _current_umask()
    root = Path(folder)
    os.chmod(root, 0o777 & ~umask)
    for entry in root.rglob("*"):
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~umask)


def weights_file_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes of a model folder's weight files: its safetensors shards, or the GGUF file a
    GGUF model's folder names."""
    p = Path(path).expanduser()
    marker = p / "radixrt-gguf.json"
    if marker.is_file():
        return Path(json.loads(marker.read_text(encoding="utf-8"))["source"]).stat().st_size
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))
