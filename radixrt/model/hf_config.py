"""A model folder's ``config.json`` (and ``generation_config.json``) as a ``ModelConfig``.

``ModelConfig.from_pretrained(folder)`` reads the files, ``ModelConfig.from_dict`` the parsed
dict (transformers v4 or v5 layout), every field as transformers' classes for the architecture
read it (their defaults included). Architectures: ``ARCHITECTURES``. A setting that would make
transformers compute something radixrt's model does not (an unsupported rope type, a bias on
llama's attention, another activation, bidirectional attention, a vision tower, ...) is refused
with a ValueError naming the field.

What differs between the families is data here, read once: which layers slide and over how
many keys (``layer_types``, ``sliding_window``), the MLP's activation, Gemma's soft-caps,
attention scale and per-kind RoPE bases, phi3's partial rotation, and the context radixrt
serves exactly (``max_context``: a ``longrope`` model's original context).
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

__all__ = ["ACTIVATIONS", "ARCHITECTURES", "GEMMA", "LAYER_TYPES", "ModelConfig"]

MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")  # a mixture-of-experts MLP (moe.py)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", *MOE)
GEMMA = ("gemma2", "gemma3_text")  # sandwich norms, Gemma's RMSNorm, scaled embeddings
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SiLU-gated and GeGLU (tanh-approximated) MLPs

_ARCH_BY_MODEL_TYPE = {a: a for a in ARCHITECTURES}
_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
_REFUSED_MODEL_TYPES = {
    "gemma3": "gemma3's vision-language model (text_config + vision_config) is not supported: "
    "radixrt serves the text-only gemma3_text",
}
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
# transformers' config classes' defaults for what config.json may leave out
_DEFAULT_KV_HEADS = {
    "qwen2": 32,
    "qwen3": 32,
    "mistral": 8,
    "gemma2": 4,
    "gemma3_text": 4,
    "qwen3_moe": 4,
    "qwen2_moe": 16,
    "mixtral": 8,
}
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "qwen3_moe": 128}
_DEFAULT_EPS = {"phi3": 1e-5, "mixtral": 1e-5, "olmoe": 1e-5}
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0, "mixtral": 1_000_000.0}
_DEFAULT_WINDOW = dict.fromkeys(
    ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "qwen2_moe"), 4096
)
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # use_sliding_window, max_window_layers
_GEMMA_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}  # (attention, final)
_PHI3_ORIGINAL_CONTEXT = 4096  # Phi3Config's original_max_position_embeddings
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
    generation_config.json's, config first.

    Attention spans: ``layer_types`` names each layer's kind (``LAYER_TYPES``; None on
    construction: every layer sliding if ``sliding_window`` is set, else full), and a sliding
    layer's query at position p attends keys p - sliding_window + 1 .. p. ``sliding_window``
    is None exactly when no layer slides. ``local_rope_theta`` is the RoPE base of the
    sliding layers where it differs (gemma3; they rotate by plain RoPE), None: every layer
    rotates by ``rope_theta`` / ``rope_scaling``.
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
    qk_norm_whole: bool = False  # olmoe: q and k normed over the whole projection, not per head
    moe: Any = dataclasses.field(default=None, hash=False)  # a moe.MoeSpec, or None (dense)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0

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
        self._check_attention_spans()
        self._check_family_fields()
        if self.rope_scaling is not None:
            object.__setattr__(
                self, "rope_scaling", _checked_rope_scaling(self.rope_scaling, self.rotary_dim)
            )

    def _check_attention_spans(self) -> None:
        window = self.sliding_window
        if window is not None and (not _is_int(window) or window <= 0):
            raise _invalid(f"sliding_window must be None or a positive int, got {window!r}")
        types = self.layer_types
        if types is None:
            types = (SLIDING if window is not None else FULL,) * self.num_layers
        types = tuple(types)
        if len(types) != self.num_layers or not set(types) <= set(LAYER_TYPES):
            raise _invalid(
                f"layer_types must name each of the {self.num_layers} layers one of "
                f"{LAYER_TYPES}, got {types!r}"
            )
        if (SLIDING in types) != (window is not None):
            raise _invalid(
                f"sliding_window ({window!r}) must be set exactly when a layer is "
                f"{SLIDING!r} (layer_types {types!r})"
            )
        object.__setattr__(self, "layer_types", types)

    def _check_family_fields(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise _invalid(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for name in (
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "query_pre_attn_scalar",
            "local_rope_theta",
        ):
            value = getattr(self, name)
            if value is not None and not _is_positive_number(value):
                raise _invalid(f"{name} must be None or a positive number, got {value!r}")
        prf = self.partial_rotary_factor
        if not _is_positive_number(prf) or prf > 1:
            raise _invalid(f"partial_rotary_factor must be in (0, 1], got {prf!r}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise _invalid(
                f"partial_rotary_factor {prf!r} of head_dim {self.head_dim} rotates "
                f"{self.rotary_dim} dimensions; RoPE needs a positive even number"
            )

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

    @property
    def family(self) -> str:
        """ "gemma" (sandwich norms, Gemma's RMSNorm, scaled embeddings) or "llama"."""
        return "gemma" if self.architecture in GEMMA else "llama"

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: every key up to the query)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @property
    def attn_scaling(self) -> float:
        """The scores' scale: ``query_pre_attn_scalar ** -0.5`` (Gemma), else head_dim's."""
        scalar = self.query_pre_attn_scalar
        return (scalar if scalar is not None else self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        """The longest sequence radixrt serves exactly (see :attr:`context_bound`)."""
        if self.context_bound is None:
            return self.max_position_embeddings
        return min(
            self.max_position_embeddings, self.rope_scaling["original_max_position_embeddings"]
        )

    @property
    def context_bound(self) -> str | None:
        """Why :attr:`max_context` is below max_position_embeddings (None: it is not)."""
        rs = self.rope_scaling
        if rs is None or rs["rope_type"] != "longrope":
            return None
        return (
            f"longrope: transformers rotates by short_factor up to "
            f"original_max_position_embeddings ({rs['original_max_position_embeddings']} "
            "tokens) and by long_factor beyond, a switch keys already in the KV cache cannot "
            "follow, so the context ends there"
        )

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
        field where transformers would compute something radixrt's model does
        not (see :func:`_refuse_unsupported`).
        """
        arch = _architecture(config)
        _refuse_unsupported(config, arch)
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads", _DEFAULT_KV_HEADS.get(arch))
        rope_theta, rope_scaling = _rope(config, arch)
        window, layer_types = _attention_spans(config, arch)
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads or num_heads,
            head_dim=_head_dim(config, arch),
            rms_norm_eps=config.get("rms_norm_eps", _DEFAULT_EPS.get(arch, 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=config["max_position_embeddings"],
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", arch in GEMMA)),
            # qwen2 always biases q/k/v; the others never do (a bias where transformers
            # would add one is refused)
            attention_bias=arch in ("qwen2", "qwen2_moe"),
            qk_norm=arch in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe"),
            qk_norm_whole=arch == "olmoe",
            moe=_moe(config, arch),
            eos_token_ids=_merged_eos_ids(config, generation_config),
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=_dtype_name(config),
            sliding_window=window,
            layer_types=layer_types,
            **_family_fields(config, arch),
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


def _checked_rope_scaling(rope_scaling: Mapping[str, Any], rotary_dim: int) -> dict[str, Any]:
    """A copy of ``rope_scaling`` once its type and that type's parameters check out."""
    rs = dict(rope_scaling)
    rope_type = rs.get("rope_type")
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
    elif rope_type == "longrope":
        _check_longrope(rs, rotary_dim)
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


def _check_longrope(rs: Mapping[str, Any], rotary_dim: int) -> None:
    _check_original_context(rs)
    for key in ("short_factor", "long_factor"):
        value = rs.get(key)
        if not (
            isinstance(value, (list, tuple))
            and len(value) == rotary_dim // 2
            and all(_is_positive_number(f) for f in value)
        ):
            raise _invalid(
                f"longrope rope_scaling[{key!r}] must be {rotary_dim // 2} positive numbers (one "
                f"per rotated pair of dimensions), got {value!r}"
            )
    value = rs.get("attention_factor")
    if value is not None and not _is_positive_number(value):
        raise _invalid(
            f"longrope rope_scaling['attention_factor'] must be None or a positive number, "
            f"got {value!r}"
        )


def _check_full_rotation(field: str, value: Any) -> None:
    if value is not None and value != 1:
        raise ValueError(
            f"{field} = {value!r} is not supported: radixrt rotates the whole head (transformers' "
            "Llama-family models ignore it for plain RoPE and cannot apply it with rope scaling)"
        )


def _refuse_unsupported(config: Mapping[str, Any], arch: str) -> None:
    """Raise ValueError naming the first config.json field with which transformers' model for
    ``arch`` computes something radixrt's does not."""
    if arch in GEMMA:
        _refuse_gemma(config, arch)
    else:
        _refuse_llama_family(config, arch)


def _moe(config: Mapping[str, Any], arch: str):
    """The mixture-of-experts block's settings (``moe.MoeSpec``), or None for a dense model."""
    if arch not in MOE:
        return None
    from radixrt.model.moe import MoeSpec  # the block's module: layers, kernels

    return MoeSpec.from_hf(arch, config)


def _refuse_llama_family(config: Mapping[str, Any], arch: str) -> None:
    """SiLU-gated MLP without biases, RMSNorm, neox RoPE over the whole head (phi3: over its
    partial_rotary_factor), no o_proj bias."""
    act = config.get("hidden_act", "silu")
    if act not in _SILU_ACTS:
        raise ValueError(
            f"hidden_act {act!r} is not supported for {arch}: radixrt's MLP is SiLU-gated ('silu')"
        )
    if arch == "llama" and config.get("mlp_bias"):
        raise ValueError("mlp_bias = true is not supported: radixrt's MLP projections have no bias")
    if config.get("clip_qkv") is not None:
        raise ValueError(
            f"clip_qkv = {config['clip_qkv']!r} is not supported for {arch}: radixrt does not "
            "clamp q, k and v"
        )
    if arch in ("llama", "qwen3", "qwen3_moe", "olmoe") and config.get("attention_bias"):
        raise ValueError(
            f"attention_bias = true is not supported for {arch}: transformers then gives o_proj a "
            "bias too, which radixrt's attention does not have"
        )
    if arch == "phi3":
        return  # phi3 applies partial_rotary_factor (read by _partial_rotary_factor)
    _check_full_rotation("partial_rotary_factor", config.get("partial_rotary_factor"))
    _check_full_rotation(
        "rope_parameters['partial_rotary_factor']",
        _rope_params(config).get("partial_rotary_factor"),
    )


def _refuse_gemma(config: Mapping[str, Any], arch: str) -> None:
    """GeGLU (tanh-approximated gelu) MLP, no biases, causal attention, whole-head RoPE."""
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation {act!r} is not supported for {arch}: radixrt's Gemma MLP is "
            "GeGLU with PyTorch's tanh-approximated gelu ('gelu_pytorch_tanh')"
        )
    if config.get("attention_bias"):
        raise ValueError(
            f"attention_bias = true is not supported for {arch}: radixrt's Gemma attention has "
            "no q/k/v/o biases"
        )
    if config.get("use_bidirectional_attention"):
        raise ValueError(
            f"use_bidirectional_attention = true is not supported for {arch}: radixrt's "
            "attention is causal"
        )
    _check_full_rotation("partial_rotary_factor", config.get("partial_rotary_factor"))
    _check_full_rotation(
        "rope_parameters['partial_rotary_factor']",
        _rope_params(config).get("partial_rotary_factor"),
    )


def _architecture(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type in _REFUSED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: {_REFUSED_MODEL_TYPES[model_type]}")
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
    """config.json's head_dim, else the config class's default, else hidden_size / heads."""
    head_dim = config.get("head_dim", _DEFAULT_HEAD_DIM.get(arch))
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


def _family_fields(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The fields only some families set: Gemma's activation, soft-caps, attention scale and
    local RoPE base; phi3's partial rotation."""
    if arch == "phi3":
        return {"partial_rotary_factor": _partial_rotary_factor(config)}
    if arch not in GEMMA:
        return {}
    attn_cap, final_cap = _GEMMA_SOFTCAPS[arch]
    return {
        "hidden_act": config.get("hidden_activation", "gelu_pytorch_tanh"),
        "attn_logit_softcapping": config.get("attn_logit_softcapping", attn_cap),
        "final_logit_softcapping": config.get("final_logit_softcapping", final_cap),
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256),
        "local_rope_theta": _gemma3_local_theta(config) if arch == "gemma3_text" else None,
    }


def _partial_rotary_factor(config: Mapping[str, Any]) -> float:
    """Phi3Config's: the rope dict's ``partial_rotary_factor``, else the top-level one, else 1."""
    value = _rope_params(config).get("partial_rotary_factor")
    if value is None:
        value = config.get("partial_rotary_factor", 1.0)
    return value


def _attention_spans(config: Mapping[str, Any], arch: str) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding window, each layer's kind) as transformers' attention for ``arch`` applies
    them.

    Llama has no window. Mistral and phi3 apply ``sliding_window`` (MistralConfig's default
    4096; Phi3Config's None) on every layer. Qwen2/3 only with ``use_sliding_window``, on the
    layers ``layer_types`` (by default those from ``max_window_layers`` on) marks sliding.
    gemma2 alternates sliding and full layers, gemma3_text has a full layer every
    ``sliding_window_pattern`` (6), unless ``layer_types`` says otherwise.
    """
    n = config["num_hidden_layers"]
    window = config.get("sliding_window", _DEFAULT_WINDOW.get(arch))
    if arch in ("llama", "olmoe") or (arch in ("mistral", "phi3", "mixtral") and window is None):
        return None, (FULL,) * n
    if arch in ("mistral", "phi3", "mixtral"):
        return window, (SLIDING,) * n
    if arch in _QWEN and not config.get("use_sliding_window", False):
        window = None
    layer_types = tuple(config.get("layer_types") or _default_layer_types(config, arch, window))
    if SLIDING in layer_types and window is None:
        raise ValueError(
            f"layer_types marks sliding layers but there is no sliding_window (for {arch}: "
            "sliding_window is null, or use_sliding_window is false); transformers refuses "
            "such a config too"
        )
    return (window if SLIDING in layer_types else None), layer_types


def _default_layer_types(config: Mapping[str, Any], arch: str, window: int | None) -> list[str]:
    n = config["num_hidden_layers"]
    if arch == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if arch == "gemma3_text":
        pattern = config.get("sliding_window_pattern", 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    first_sliding = config.get("max_window_layers", 28)
    return [SLIDING if window is not None and i >= first_sliding else FULL for i in range(n)]


def _rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope dict transformers reads: v4 ``rope_scaling`` first, else v5 ``rope_parameters``
    (its ``full_attention`` entry where it is given per layer type)."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if params and all(isinstance(v, Mapping) for v in params.values()):  # per layer type
        if FULL not in params:
            raise ValueError(
                f"per-layer-type rope_parameters without 'full_attention': {sorted(params)}"
            )
        params = params[FULL]
    return dict(params)


def _gemma3_local_theta(config: Mapping[str, Any]) -> float:
    """The RoPE base of gemma3's sliding layers: v5 ``rope_parameters['sliding_attention']``'s
    ``rope_theta``, else v4 ``rope_local_base_freq``, else Gemma3TextConfig's 10000."""
    params = config.get("rope_parameters") or {}
    local = params.get(SLIDING) if isinstance(params, Mapping) else None
    if isinstance(local, Mapping):
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"rope_parameters['sliding_attention'] of type {kind!r} is not supported: "
                "radixrt rotates gemma3's sliding layers by plain RoPE"
            )
        if local.get("rope_theta") is not None:
            return local["rope_theta"]
    return config.get("rope_local_base_freq", 10000.0)


def _rope(config: Mapping[str, Any], arch: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) with the defaults transformers fills in.

    ``original_max_position_embeddings`` (llama3, yarn, longrope) is config.json's top-level
    field where there is one (transformers gives it priority; Phi3Config always has one), else
    the rope dict's, else ``max_position_embeddings``. phi3 reads types "su" and "yarn" as
    "longrope", whose ``factor`` defaults to max_position_embeddings over the original context.
    """
    rest = _rope_params(config)
    rest.pop("partial_rotary_factor", None)  # ModelConfig.partial_rotary_factor
    theta = rest.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta")
    if theta is None:
        theta = _DEFAULT_THETA.get(arch, 10000.0)
    rope_type = rest.pop("rope_type", None)
    legacy_type = rest.pop("type", None)
    rope_type = rope_type or legacy_type or "default"
    if arch == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if arch == "phi3" and rope_type not in ("default", "longrope"):
        raise ValueError(
            f"rope type {rope_type!r} is not supported for phi3: Phi3Config takes 'default' or "
            "'longrope' ('su' and 'yarn' read as 'longrope')"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("llama3", "yarn", "longrope"):
        top_level = config.get(
            "original_max_position_embeddings",
            _PHI3_ORIGINAL_CONTEXT if arch == "phi3" else None,
        )
        if top_level is not None:
            rest["original_max_position_embeddings"] = top_level
        rest.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if rope_type == "longrope" and rest.get("factor") is None:
        rest["factor"] = (
            config["max_position_embeddings"] / rest["original_max_position_embeddings"]
        )
    return float(theta), {"rope_type": rope_type, **rest}
