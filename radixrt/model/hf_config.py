"""A model folder's ``config.json`` (and ``generation_config.json``) as a ``ModelConfig``.

``ModelConfig.from_pretrained(folder)`` reads the files, ``ModelConfig.from_dict`` the parsed
dict (transformers v4 or v5 layout), every field as transformers' classes for the architecture
read it. Architectures: ``ARCHITECTURES``. A setting that would make transformers compute
something radixrt's model does not (an unsupported rope type, a bias on llama's attention, a
partial rotation, ...) is refused with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from radixrt.model import rope

__all__ = ["ARCHITECTURES", "ModelConfig"]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

_ARCH_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
# rope types whose transformers tables depend on the length of the sequence in each forward
_LENGTH_DEPENDENT_ROPE = {
    "longrope": "transformers rotates by short_factor or long_factor depending on the length of "
    "the sequence in each forward, which keys already in the KV cache cannot follow",
}
# num_key_value_heads where config.json has none (transformers' config classes; else num_heads)
_DEFAULT_KV_HEADS = {"qwen2": 32, "qwen3": 32, "mistral": 8}
_SILU_ACTS = ("silu", "swish")  # the names transformers' ACT2FN maps to SiLU
_POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_positive_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _invalid(msg: str) -> ValueError:
    return ValueError(f"invalid ModelConfig: {msg}")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of a Hugging Face ``config.json`` the runtime needs.

    ``rope_scaling`` is None for plain RoPE, else a dict with a ``rope_type``
    key (one of ``radixrt.model.rope.ROPE_TYPES``) and every parameter that
    type reads, without ``rope_theta`` (that is :attr:`rope_theta`).
    ``eos_token_ids`` merges config.json's ``eos_token_id`` with
    generation_config.json's, config first.  ``sliding_window`` is None unless
    the model really uses one, on every layer.
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
        if self.architecture not in ARCHITECTURES:
            raise _invalid(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise _invalid(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise _invalid(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_positive_number(value):
                raise _invalid(f"{name} must be a positive finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "eos_token_ids", _checked_eos_ids(self.eos_token_ids))
        bos = self.bos_token_id
        if bos is not None and (not _is_int(bos) or bos < 0):
            raise _invalid(f"bos_token_id must be None or a non-negative int, got {bos!r}")
        object.__setattr__(self, "torch_dtype", _checked_dtype(self.torch_dtype))
        window = self.sliding_window
        if window is not None and (not _is_int(window) or window <= 0):
            raise _invalid(f"sliding_window must be None or a positive int, got {window!r}")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _checked_rope_scaling(self.rope_scaling))

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
    def from_dict(
        cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the parsed config.json dict (transformers v4 or v5 layout).

        Every field is read as transformers' config and model classes for the
        architecture read it (defaults included).  Raises ValueError naming the
        field where transformers would compute something radixrt's Llama model
        does not (see :func:`_refuse_unsupported`).
        """
        arch = _architecture(config)
        _refuse_unsupported(config, arch)
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads", _DEFAULT_KV_HEADS.get(arch))
        rope_theta, rope_scaling = _rope(config)
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads or num_heads,
            head_dim=_head_dim(config, arch),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=config["max_position_embeddings"],
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # qwen2 always biases q/k/v; mistral never does; llama and qwen3 with a bias are refused
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            eos_token_ids=_merged_eos_ids(config, generation_config),
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=_dtype_name(config),
            sliding_window=_sliding_window(config, arch),
        )


def _checked_eos_ids(eos: Any) -> tuple[int, ...]:
    ids = (eos,) if _is_int(eos) else tuple(eos)
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise _invalid(f"eos_token_ids must be non-negative ints, got {eos!r}")
    return ids


def _checked_dtype(dtype: Any) -> torch.dtype:
    resolved = _DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise _invalid(f"torch_dtype must be a floating torch.dtype, got {dtype!r}")
    return resolved


def _checked_rope_scaling(rope_scaling: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``rope_scaling`` once its type and that type's parameters check out."""
    rs = dict(rope_scaling)
    rope_type = rs.get("rope_type")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        why = _LENGTH_DEPENDENT_ROPE[rope_type]
        raise _invalid(f"rope_scaling type {rope_type!r} is not supported: {why}")
    if rope_type not in rope.ROPE_TYPES:
        raise _invalid(
            f"rope_scaling['rope_type'] must be one of {rope.ROPE_TYPES}, got {rope_type!r}"
        )
    _check_full_rotation("rope_scaling['partial_rotary_factor']", rs.get("partial_rotary_factor"))
    if not _is_positive_number(rs.get("factor")):
        raise _invalid(
            f"rope_scaling['factor'] must be a positive number for {rope_type}, "
            f"got {rs.get('factor')!r}"
        )
    if rope_type == "llama3":
        _check_llama3_rope(rs)
    elif rope_type == "yarn":
        _check_yarn_rope(rs)
    return rs


def _check_original_context(rs: Mapping[str, Any]) -> None:
    n = rs.get("original_max_position_embeddings")
    if not _is_int(n) or n <= 0:
        raise _invalid(
            f"{rs['rope_type']} rope_scaling['original_max_position_embeddings'] must be a "
            f"positive int, got {n!r}"
        )


def _check_llama3_rope(rs: Mapping[str, Any]) -> None:
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rs]
    if missing:
        raise _invalid(f"llama3 rope_scaling lacks {missing}")
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    if not (_is_positive_number(low) and _is_positive_number(high) and low < high):
        raise _invalid(
            "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, "
            f"got {low!r}, {high!r}"
        )
    _check_original_context(rs)


def _check_yarn_rope(rs: Mapping[str, Any]) -> None:
    _check_original_context(rs)
    for key in ("attention_factor", "beta_fast", "beta_slow"):
        if rs.get(key) is not None and not _is_positive_number(rs[key]):
            raise _invalid(
                f"yarn rope_scaling[{key!r}] must be None or a positive number, got {rs[key]!r}"
            )
    for key in ("mscale", "mscale_all_dim"):
        value = rs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _invalid(f"yarn rope_scaling[{key!r}] must be None or a number, got {value!r}")
    if rs.get("truncate") is not None and not isinstance(rs["truncate"], bool):
        raise _invalid(
            f"yarn rope_scaling['truncate'] must be None or a bool, got {rs['truncate']!r}"
        )


def _check_full_rotation(field: str, value: Any) -> None:
    if value is not None and value != 1:
        raise ValueError(
            f"{field} = {value!r} is not supported: radixrt rotates the whole head (transformers' "
            "Llama-family models ignore it for plain RoPE and cannot apply it with rope scaling)"
        )


def _refuse_unsupported(config: Mapping[str, Any], arch: str) -> None:
    """Raise ValueError naming the first config.json field with which transformers' model for
    ``arch`` computes something radixrt's (SiLU-gated MLP without biases, RMSNorm, neox RoPE
    over the whole head, no o_proj bias, one attention span for every layer) does not."""
    act = config.get("hidden_act", "silu")
    if act not in _SILU_ACTS:
        raise ValueError(
            f"hidden_act {act!r} is not supported: radixrt's MLP is SiLU-gated ('silu')"
        )
    if arch == "llama" and config.get("mlp_bias"):
        raise ValueError("mlp_bias = true is not supported: radixrt's MLP projections have no bias")
    if arch in ("llama", "qwen3") and config.get("attention_bias"):
        raise ValueError(
            f"attention_bias = true is not supported for {arch}: transformers then gives o_proj a "
            "bias too, which radixrt's attention does not have"
        )
    _check_full_rotation("partial_rotary_factor", config.get("partial_rotary_factor"))
    _check_full_rotation(
        "rope_parameters['partial_rotary_factor']",
        _rope_params(config).get("partial_rotary_factor"),
    )


def _architecture(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
    for cls_name in config.get("architectures") or []:
        if cls_name in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[cls_name]
    raise ValueError(
        f"unsupported model (model_type={model_type!r}, "
        f"architectures={config.get('architectures')!r}); "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def _head_dim(config: Mapping[str, Any], arch: str) -> int:
    """config.json's head_dim, else Qwen3Config's default 128, else hidden_size / heads."""
    head_dim = config.get("head_dim", 128 if arch == "qwen3" else None)
    if head_dim is not None:
        return head_dim
    hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
    if hidden % num_heads:
        raise ValueError(
            f"hidden_size {hidden} is not divisible by num_attention_heads {num_heads}"
        )
    return hidden // num_heads


def _merged_eos_ids(
    config: Mapping[str, Any], generation_config: Mapping[str, Any] | None
) -> tuple[int, ...]:
    eos: list[int] = []
    for src in (config, generation_config or {}):
        ids = src.get("eos_token_id")
        for i in [ids] if _is_int(ids) else (ids or []):
            if i not in eos:
                eos.append(i)
    return tuple(eos)


def _dtype_name(config: Mapping[str, Any]) -> Any:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if isinstance(name, str) and name.removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return name


def _sliding_window(config: Mapping[str, Any], arch: str) -> int | None:
    """The window transformers' attention for ``arch`` applies (None: full attention).

    Llama has none; Mistral applies ``sliding_window`` (MistralConfig's default: 4096) on
    every layer; Qwen2/3 only with ``use_sliding_window``, on the layers ``layer_types`` (by
    default those from ``max_window_layers`` on) mark sliding.  A window on some layers only
    is refused.
    """
    if arch == "mistral":
        return config.get("sliding_window", 4096)
    window = config.get("sliding_window")
    if arch == "llama" or window is None:
        return None
    if not config.get("use_sliding_window", False):
        return None
    first_sliding = config.get("max_window_layers", 28)
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]
    if set(layer_types) == {"full_attention"}:
        return None
    if set(layer_types) == {"sliding_attention"}:
        return window
    raise ValueError(
        f"use_sliding_window with a window on some layers only (layer_types {layer_types}) is not "
        "supported: radixrt attends over one span on every layer"
    )


def _rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope dict transformers reads: v4 ``rope_scaling`` first, else v5 ``rope_parameters``
    (its ``full_attention`` entry where it is given per layer type)."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if params and all(isinstance(v, Mapping) for v in params.values()):  # per layer type
        if "full_attention" not in params:
            raise ValueError(
                f"per-layer-type rope_parameters without 'full_attention': {sorted(params)}"
            )
        params = params["full_attention"]
    return dict(params)


def _rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) with the defaults transformers fills in.

    ``original_max_position_embeddings`` (llama3, yarn) is config.json's top-level
    field where there is one (transformers gives it priority), else the rope dict's, else
    ``max_position_embeddings``.
    """
    rest = _rope_params(config)
    theta = rest.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta")
    if theta is None:
        theta = 10000.0
    rope_type = rest.pop("rope_type", None)
    legacy_type = rest.pop("type", None)
    rope_type = rope_type or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("llama3", "yarn"):
        top_level = config.get("original_max_position_embeddings")
        if top_level is not None:
            rest["original_max_position_embeddings"] = top_level
        rest.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return float(theta), {"rope_type": rope_type, **rest}
