"""Test helpers: tiny random-weight Hugging Face models that need no download.

:func:`make_tiny_model` writes a complete model folder (``config.json``,
``generation_config.json``, ``model.safetensors`` and tokenizer files) that
loads with ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` as well as
with radixrt's readers (:mod:`radixrt.model.hf_config`, :mod:`radixrt.model.weights`).
Everything is derived from the seed and from text that ships with the Python
standard library, so the result is identical from call to call and works
offline.  Its sizes, ``max_position_embeddings`` and ``rope_scaling`` are
:func:`tiny_config`'s arguments.

:func:`tiny_model_path` builds such a folder once into the radixrt cache
directory and reuses it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixrt.model.weights import cache_dir, make_shareable

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "ARCHS",
    "FAMILIES",
    "FAMILY_OPTIONS",
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_MODEL_VERSION",
    "make_tiny_model",
    "tiny_config",
    "tiny_model_path",
]

#: Bump when the output of :func:`make_tiny_model` changes, so that cached
#: folders built by an older version are not reused.
TINY_MODEL_VERSION = 2

ARCHS = ("llama", "qwen2", "qwen3")
#: Mixture-of-experts families: 8 experts of width intermediate_size // 4, top 2 (with the
#: routing weights renormalised, as qwen3_moe's models do; olmoe's are not; qwen2_moe with a
#: shared expert).
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
#: Every family :func:`make_tiny_model` builds: ``ARCHS`` and those whose tiny models slide a
#: window over some layers (:data:`FAMILY_OPTIONS`).
FAMILIES = (*ARCHS, "mistral", "phi3", "gemma2", "gemma3_text", *MOE_ARCHS)

#: The family-specific settings of the tiny models (each overridable by keyword): windows of
#: 12 positions, on every layer (mistral, phi3), alternate layers (gemma2) or two layers in
#: three (gemma3_text); Gemma's soft-caps small enough to matter at these weights' scale, and
#: an attention scale other than head_dim's; gemma3's global layers with RoPE base 1e6 (its
#: sliding layers: 1e4); phi3 rotating three quarters of each head.
FAMILY_OPTIONS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 12},
    "phi3": {"sliding_window": 12, "partial_rotary_factor": 0.75},
    "gemma2": {
        "sliding_window": 12,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
        "query_pre_attn_scalar": 24,
    },
    "gemma3_text": {
        "sliding_window": 12,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 24,
        "global_rope_theta": 1_000_000.0,
    },
}

#: Special tokens, in id order: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
#: ``<|im_end|>`` = 2 (the layout SmolLM2 uses).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_MARKER = ".radixrt-complete"

# Long-lived stdlib modules used as tokenizer training text, tried in this
# order; anything missing or not UTF-8 is skipped.
_PREFERRED_CORPUS = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "dataclasses.py",
    "difflib.py",
    "email/message.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)
_CORPUS_TARGET_BYTES = 600_000

# GPT-4 / Qwen2 style pre-tokenisation split.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _corpus_files() -> list[Path]:
    """A deterministic selection of UTF-8 stdlib source files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = [stdlib / name for name in _PREFERRED_CORPUS]
    candidates += sorted(stdlib.glob("*.py"))  # fallback if the list falls short
    chosen: list[Path] = []
    seen: set[Path] = set()
    total = 0
    for path in candidates:
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        chosen.append(path)
        total += len(data)
        if total >= _CORPUS_TARGET_BYTES:
            break
    if not chosen:
        raise RuntimeError(f"no UTF-8 .py files found under the Python stdlib at {stdlib}")
    return chosen


def _train_tokenizer(vocab_size: int, model_max_length: int):
    """Byte-level BPE trained on stdlib sources, wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_min = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_min:
        raise ValueError(
            f"vocab_size must be >= {n_min} (256 bytes + special tokens), got {vocab_size}"
        )

    # The same pipeline transformers' Qwen2Tokenizer rebuilds (AutoTokenizer
    # forces that class for model_type "qwen2"), so every loader agrees on ids.
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8") for p in _corpus_files()]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(
            f"tokenizer training produced {got} tokens instead of {vocab_size}; "
            "the stdlib text is too small for this vocab_size"
        )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def tiny_config(
    arch: str = "llama",
    *,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int | None = None,
    intermediate_size: int = 512,
    vocab_size: int = 2048,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.1,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    rms_norm_eps: float = 1e-6,
    **options: Any,
) -> PretrainedConfig:
    """The transformers config of a :func:`make_tiny_model` model (float32).

    ``arch`` is one of :data:`FAMILIES`: ``"llama"``, ``"qwen2"`` (q/k/v biases),
    ``"qwen3"`` (q/k RMSNorm, explicit ``head_dim``; when ``head_dim`` is None it
    defaults to ``2 * hidden_size // num_heads`` for qwen3 and ``hidden_size //
    num_heads`` otherwise), ``"mistral"``, ``"phi3"`` (fused qkv and gate/up
    weights), ``"gemma2"`` or ``"gemma3_text"`` (GeGLU, sandwich norms, scaled
    embeddings; a tied random model tends to repeat its last token).
    ``rope_scaling`` is a rope parameter dict without ``rope_theta`` (``rope_type`` or
    the legacy ``type`` names its type), e.g. ``{"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 16}``; for gemma3_text it applies to the global
    layers. ``options`` are further fields of the family's transformers config
    (``sliding_window``, ``layer_types``, ``use_sliding_window``, ...), over
    :data:`FAMILY_OPTIONS`; gemma3_text also takes ``global_rope_theta``.
    """
    return _arch_config(
        arch,
        head_dim,
        dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            hidden_act="silu",
            max_position_embeddings=max_position_embeddings,
            initializer_range=initializer_range,
            rms_norm_eps=rms_norm_eps,
            tie_word_embeddings=tie_word_embeddings,
            rope_parameters=_rope_parameters(rope_theta, rope_scaling),
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=0,
            dtype="float32",
        ),
        {**FAMILY_OPTIONS.get(arch, {}), **options},
    )


def _arch_config(arch: str, head_dim: int | None, common: dict, options: dict) -> PretrainedConfig:
    """``arch``'s transformers config class built from the shared settings ``common`` and the
    family's ``options``."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    derived = common["hidden_size"] // common["num_attention_heads"]
    if arch in ("mistral", "phi3", "gemma2", "gemma3_text"):
        return _family_config(arch, head_dim or derived, common, dict(options))
    if arch in MOE_ARCHS:
        return _moe_config(arch, head_dim or derived, common, dict(options))
    common = {**common, **options}
    if arch == "llama":
        return LlamaConfig(**common, head_dim=head_dim or derived, attention_bias=False)
    if arch == "qwen2":
        if head_dim is not None and head_dim != derived:
            raise ValueError(
                "qwen2 has no explicit head_dim; it is always hidden_size // num_heads"
            )
        return Qwen2Config(**{"use_sliding_window": False, **common})
    if arch == "qwen3":
        # Qwen3 stores head_dim explicitly and, in the real models, it differs
        # from hidden_size // num_heads; default to twice that so the tiny
        # model exercises the q/o projection shape mismatch too.
        return Qwen3Config(**common, head_dim=head_dim or 2 * derived, attention_bias=False)
    raise ValueError(f"arch must be one of {FAMILIES}, got {arch!r}")


def _moe_config(arch: str, head_dim: int, common: dict, options: dict) -> PretrainedConfig:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    width = common["intermediate_size"] // 4
    if arch == "mixtral":
        experts = {"num_local_experts": 8, "num_experts_per_tok": 2, **options}
        return MixtralConfig(**common, head_dim=head_dim, **experts)
    if arch == "olmoe":
        common = {**common, "intermediate_size": width}
        return OlmoeConfig(**common, **{"num_experts": 8, "num_experts_per_tok": 2, **options})
    qwen = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=width)
    qwen["norm_topk_prob"] = True
    if arch == "qwen2_moe":
        qwen.update(shared_expert_intermediate_size=width, use_sliding_window=False)
        return Qwen2MoeConfig(**common, **{**qwen, **options})
    return Qwen3MoeConfig(**common, head_dim=head_dim, **{**qwen, **options})


def _family_config(arch: str, head_dim: int, common: dict, options: dict) -> PretrainedConfig:
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config

    if arch == "mistral":
        return MistralConfig(**common, head_dim=head_dim, **options)
    if arch == "phi3":
        return Phi3Config(**{k: v for k, v in common.items() if k != "hidden_act"}, **options)
    common = {k: v for k, v in common.items() if k != "hidden_act"}
    common["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "gemma2":
        return Gemma2Config(**common, head_dim=head_dim, **options)
    full = dict(common.pop("rope_parameters"), rope_theta=options.pop("global_rope_theta"))
    local = {"rope_type": "default", "rope_theta": 10000.0}
    common["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return Gemma3TextConfig(**common, head_dim=head_dim, **options)


def _rope_parameters(rope_theta: float, rope_scaling: dict | None) -> dict:
    """transformers v5 ``rope_parameters``: ``rope_scaling`` (or plain RoPE) with the theta."""
    rope_parameters = {"rope_type": "default"}
    if rope_scaling:
        rope_parameters = dict(rope_scaling)
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
    rope_parameters["rope_theta"] = float(rope_theta)
    return rope_parameters


def make_tiny_model(
    path: str | os.PathLike[str], arch: str = "llama", seed: int = 0, **sizes: Any
) -> str:
    """Write a random-weight Hugging Face model folder to ``path`` and return it.

    ``arch`` and the keyword arguments ``sizes`` (``num_layers``,
    ``hidden_size``, ..., ``max_position_embeddings``, ``rope_scaling``) are
    those of :func:`tiny_config`.  Weights are float32 and depend only on the
    arguments: every parameter is drawn, in name order, from a generator of its
    own seeded with ``seed`` (not torch's global one, which other threads of the
    calling process may be drawing from): linear and embedding weights normal
    with std ``initializer_range`` (the embedding's padding row 0), the RMSNorm
    weights around 1 (Gemma's, which scale by 1 + w: around 0) and the qwen2 biases
    around 0, rather than exactly at their neutral values, so that a runtime that
    ignores them does not match transformers.

    The tokenizer is a byte-level BPE with ``vocab_size`` tokens trained on
    stdlib sources; ids 0, 1, 2 are ``<|endoftext|>`` (bos/pad),
    ``<|im_start|>`` and ``<|im_end|>`` (eos).  ``generation_config.json`` lists
    both ``<|im_end|>`` and ``<|endoftext|>`` as eos ids, config.json only
    ``<|im_end|>`` (as Qwen2.5-Instruct does).  The tokenizer carries a ChatML
    chat template.
    """
    config = tiny_config(arch, **sizes)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _random_model(config, seed).save_pretrained(out)
    _train_tokenizer(config.vocab_size, config.max_position_embeddings).save_pretrained(out)
    return str(out)


def _random_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A transformers model of ``config`` with seeded weights (see :func:`make_tiny_model`)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    norm_center = 0.0 if config.model_type.startswith("gemma") else 1.0  # Gemma's: 1 + w
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            drawn = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(norm_center + 0.1 * drawn)
            else:
                param.copy_(config.initializer_range * drawn)
        embed = model.get_input_embeddings()
        if embed.padding_idx is not None:
            embed.weight[embed.padding_idx] = 0.0
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[2, 0], pad_token_id=0)
    return model


def _cache_root() -> Path:
    return Path(cache_dir())


def _version_hash(arch: str, seed: int) -> str:
    import tokenizers
    import torch
    import transformers

    key = json.dumps(
        {
            "version": TINY_MODEL_VERSION,
            "arch": arch,
            "seed": seed,
            "python": list(sys.version_info[:2]),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def tiny_model_path(arch: str = "llama", seed: int = 0) -> str:
    """Path of a cached :func:`make_tiny_model` folder (default sizes), built once.

    Lives in ``$RADIXRT_CACHE_DIR`` (default ``~/.cache/radixrt``) under
    ``tiny/<arch>-<seed>-<hash>``; the hash covers the generator version and the
    torch/transformers/tokenizers/Python versions.  The folder is built in a
    temporary sibling and renamed into place, so concurrent callers never see
    a partial folder (the loser of a race discards its copy).
    """
    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {FAMILIES}, got {arch!r}")
    root = _cache_root() / "tiny"
    final = root / f"{arch}-{seed}-{_version_hash(arch, seed)}"
    if (final / _MARKER).is_file():
        return str(final)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{arch}-{seed}-", dir=root))
    try:
        make_tiny_model(tmp, arch=arch, seed=seed)
        (tmp / _MARKER).write_text(
            json.dumps({"arch": arch, "seed": seed, "version": TINY_MODEL_VERSION}) + "\n"
        )
        make_shareable(tmp)
        if final.exists() and not (final / _MARKER).is_file():
            # Not ours (no marker): move it out of the way.
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{arch}-{seed}-", dir=root))
            os.replace(final, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race; use its (complete) folder.
            if not (final / _MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def process_tree(pids: set[int]) -> set[int]:
    """``pids`` and all their descendants (Linux /proc; no psutil needed)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found = set(pids)
    while new := {p for p, pp in parent.items() if pp in found} - found:
        found |= new
    return found


def output_bits(out) -> tuple:
    """What exactness compares of a ``GenerateOutput``: its token ids, logprobs, top logprobs,
    prompt logprobs and prompt top logprobs, as plain values (floats compared with ``==``)."""

    def tops(entries):
        return None if entries is None else [(list(i), list(v)) for i, v in entries]

    return (
        list(out.token_ids),
        None if out.logprobs is None else list(out.logprobs),
        tops(out.top_logprobs),
        None if out.prompt_logprobs is None else list(out.prompt_logprobs),
        tops(out.prompt_top_logprobs),
    )
