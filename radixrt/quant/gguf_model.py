"""A GGUF file as a model: its config and tokenizer from the file's metadata, its tensors kept
in their blocks.

``gguf_model_folder(file)`` gives the folder the rest of radixrt loads a model from (the
tokenizer processes, ``ModelConfig``, the KV fingerprint): ``config.json``,
``generation_config.json`` and the tokenizer files, written once from the file's metadata
with transformers' GGUF readers into ``<cache_dir>/gguf/<name>-<key>`` (key: the file's path,
size and modification time), and ``radixrt-gguf.json``, which names the file. No weight is
written there: ``iter_gguf_weights(folder)`` reads them from the file, a ``QuantTensor`` per
quantized tensor (raw blocks, rows in the checkpoint's order) and a dense tensor for F32, F16
and BF16 ones, under the Hugging Face checkpoint's names.

``GGUFFile(path)`` checks the whole file before anything is loaded: a readable GGUF, an
architecture radixrt serves (``ARCHITECTURES``), every tensor's type served
(``formats.BLOCK_TYPES`` or dense) and every tensor name known; each failure is a
``ValueError`` naming the file and the tensor, type or architecture.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixrt.model.weights import cache_dir, make_shareable
from radixrt.quant.formats import BLOCK_TYPES, DENSE_TYPES, QuantTensor

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # Mistral's files say "llama"
PERMUTED_QK = ("llama",)  # llama.cpp's converter permuted q/k rows for its rotary layout
MARKER = "radixrt-gguf.json"
FOLDER_VERSION = 2

# GGUF tensor name (layer index as N) -> Hugging Face checkpoint name
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str) -> str | None:
    """The Hugging Face checkpoint name of GGUF tensor ``name`` (None: not a tensor we know)."""
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    return None


class GGUFFile:
    """A GGUF file, checked whole (the module's text); ``tensors()`` reads its weights."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from gguf import GGUFReader

        self.path = Path(path).expanduser().resolve()
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader's own errors: bad magic, truncated, bad version
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: GGUF architecture {self.arch!r} is not served "
                f"(served: {', '.join(ARCHITECTURES)})"
            )
        self.heads = int(self.field(f"{self.arch}.attention.head_count"))
        self.kv_heads = int(self.field(f"{self.arch}.attention.head_count_kv", self.heads))
        self._check_tensors()

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is None:
                raise ValueError(f"{self.path.name}: GGUF metadata lacks {key!r}")
            return default
        return f.contents()

    def _check_tensors(self) -> None:
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in BLOCK_TYPES and kind not in DENSE_TYPES:
                raise ValueError(
                    f"{self.path.name}: tensor {t.name!r} has type {kind}, which radixrt does not "
                    f"serve (served: {', '.join([*BLOCK_TYPES, *DENSE_TYPES])})"
                )
            if hf_name(t.name) is None:
                raise ValueError(
                    f"{self.path.name}: tensor {t.name!r} ({kind}) is not part of a "
                    f"{self.arch} model radixrt serves"
                )

    @property
    def types(self) -> dict[str, int]:
        """Tensor type -> how many tensors have it."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """(Hugging Face name, tensor) for every tensor, q and k rows in the checkpoint's order."""
        for t in self.reader.tensors:
            name = hf_name(t.name)
            kind = t.tensor_type.name
            shape = [int(x) for x in reversed(t.shape)]  # GGUF lists the fastest dimension first
            data = np.array(t.data)  # a copy: nothing keeps the file's memory map alive
            if kind in DENSE_TYPES:
                dense = torch.from_numpy(data.reshape(-1)).view(DENSE_TYPES[kind])
                yield name, dense.reshape(shape)
                continue
            q = QuantTensor(kind, torch.from_numpy(data.reshape(shape[0], -1)), shape[-1])
            yield name, self._unpermute(t.name, q)

    def _unpermute(self, name: str, q: QuantTensor) -> QuantTensor:
        """Undo the converter's row permutation of q and k (``PERMUTED_QK`` architectures)."""
        if self.arch not in PERMUTED_QK or not name.endswith(("attn_q.weight", "attn_k.weight")):
            return q
        heads = self.heads if name.endswith("attn_q.weight") else self.kv_heads
        return q.rows(unpermute_rows(q.shape[0], heads))


def unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation of ``n`` rows in ``heads`` heads
    (each head's rows went from [half pairs] to interleaved pairs)."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def is_gguf_folder(folder: str | os.PathLike[str]) -> bool:
    return (Path(folder) / MARKER).is_file()


def gguf_source(folder: str | os.PathLike[str]) -> Path:
    """The GGUF file a ``gguf_model_folder`` folder names."""
    return Path(json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))["source"])


def iter_gguf_weights(folder: str | os.PathLike[str]):
    """The weights of the GGUF file a ``gguf_model_folder`` folder names (``GGUFFile.tensors``)."""
    return GGUFFile(gguf_source(folder)).tensors()


def gguf_model_folder(
    path: str | os.PathLike[str], chat_template: str | None = None, name: str | None = None
) -> str:
    """The model folder for GGUF file ``path`` (the module's text), written on first use under a
    lock. ``chat_template``: the template to use where the file carries none; ``name``: the
    model's name (``model_name``; default the file's name without ``.gguf``)."""
    src = Path(path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    st = src.stat()
    key = f"{src}\0{st.st_size}\0{st.st_mtime_ns}\0{FOLDER_VERSION}\0{name}"
    target = (
        Path(cache_dir()) / "gguf" / f"{src.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    )
    if is_gguf_folder(target):
        return str(target)
    gguf = GGUFFile(src)  # the whole file checked before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if not is_gguf_folder(target):
            _write_folder(gguf, target, key, chat_template, name or src.stem)
    return str(target)


def _write_folder(
    gguf: GGUFFile, target: Path, key: str, chat_template: str | None, name: str
) -> None:
    t0 = time.perf_counter()
    with building_folder(target) as tmp:
        write_metadata(gguf, tmp, chat_template)
        marker = {"source": str(gguf.path), "name": name, "key": key, "architecture": gguf.arch}
        marker.update(gguf.types)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    logger.info(
        "read %s's config and tokenizer in %.1f s", gguf.path.name, time.perf_counter() - t0
    )


def write_metadata(gguf: GGUFFile, folder: Path, chat_template: str | None = None) -> int | None:
    """config.json, generation_config.json and the tokenizer of ``gguf`` into ``folder``
    (transformers' GGUF readers; the head size from the file's key length, which they do not
    read for every architecture); returns the tokenizer's eos id."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = gguf.path
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    config = cleaned_config(
        AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), eos_id
    )
    key_length = gguf.field(f"{gguf.arch}.attention.key_length", 0)
    if key_length:
        config.head_dim = int(key_length)
    config.save_pretrained(str(folder))
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    ).save_pretrained(str(folder))
    if not tokenizer.chat_template and chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("is_local", "local_files_only", "gguf_file"):  # loader kwargs, not settings
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(str(folder))
    return eos_id


def f32_roundtrip_clean(x: float) -> float:
    """1e-5 stored as float32 in GGUF reads back as 9.999999747378752e-06; undo that."""
    short = float(f"{x:.7g}")
    as_f32 = torch.tensor(short, dtype=torch.float32).item()
    return short if as_f32 == torch.tensor(x, dtype=torch.float32).item() else x


def cleaned_config(src_config: Any, eos_id: int | None, dtype: torch.dtype | None = None) -> Any:
    """A GGUF model's transformers config without the GGUF loader's entries, with
    rms_norm_eps as written before float32 storage, ``dtype`` where given, and ``eos_id``
    where the config names no eos token."""
    cfg = src_config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
    ):
        cfg.pop(key, None)
    if isinstance(cfg.get("rms_norm_eps"), float):
        cfg["rms_norm_eps"] = f32_roundtrip_clean(cfg["rms_norm_eps"])
    if dtype is not None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    if eos_id is not None and cfg.get("eos_token_id") is None:
        cfg["eos_token_id"] = eos_id
    return type(src_config).from_dict(cfg)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX); a no-op where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def building_folder(target: Path) -> Iterator[Path]:
    """A temporary sibling of ``target`` to write a folder into; renamed into place (with the
    permissions the umask allows) when the block ends without an error, deleted either way."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        make_shareable(tmp)
        replace_folder(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; a stale ``target`` is moved out of the way and deleted."""
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
        os.replace(target, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(new, target)


def model_name(folder: str | os.PathLike[str]) -> str:
    """A model's name: a GGUF model's file name without ``.gguf``, else its folder's name."""
    if is_gguf_folder(folder):
        return json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))["name"]
    return os.path.basename(os.path.normpath(folder))


def exact_in(weights, dtype: torch.dtype):
    """``weights`` ((name, tensor) pairs), refusing a dense linear weight that ``dtype`` would
    round (an F16 or F32 matrix in a bf16 model): ValueError naming it and the way out. An
    embedding's rows become activations of ``dtype`` anyway, so they pass."""
    for name, t in weights:
        if (
            isinstance(t, torch.Tensor)
            and t.dim() == 2
            and name != "model.embed_tokens.weight"
            and t.dtype != dtype
            and dtype != torch.float32  # F16, BF16 and F32 widen to float32 exactly
        ):
            kind = {torch.float16: "F16", torch.float32: "F32"}.get(t.dtype, str(t.dtype))
            raise ValueError(
                f"tensor {name!r} is {kind}; a {str(dtype).removeprefix('torch.')} model would "
                "round it: serve this file with --dtype float32"
            )
        yield name, t
