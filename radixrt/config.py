"""Engine configuration: one frozen dataclass, validated on construction.

It can be built from keyword arguments, from a TOML file in ``configs/``
(``EngineConfig.from_toml``), or both (keywords override the file).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    max_total_tokens: int | None = None       # KV slots; None: sized from memory
    page_size: int = 1
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None    # tokens per prefill batch; None: no chunking
    max_running_requests: int | None = None    # None: 256
    attention_backend: str = "auto"
    max_prefill_tokens: int = 16384            # token budget of one prefill batch
    new_token_ratio: float = 0.5               # share of max_new_tokens reserved per running request
    eviction_policy: str = "lru"
    device: str = "auto"
    seed: int = 0
    enable_torch_compile: bool = False         # compile the model's forward (slow start, faster steps)

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("eviction_policy", self.eviction_policy, ("lru", "lfu"))
        _check_positive("page_size", self.page_size)
        for name in ("disable_radix_cache", "enable_torch_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_positive("max_prefill_tokens", self.max_prefill_tokens)
        for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.max_total_tokens is not None and self.max_total_tokens < 4 * self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must be at least 4 pages")
        if not 0.0 <= self.new_token_ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio}")

    @property
    def prefill_budget(self) -> int:
        """Tokens one prefill batch may compute (a chunk size bounds it too)."""
        return min(self.max_prefill_tokens, self.chunked_prefill_size or self.max_prefill_tokens)

    @property
    def running_limit(self) -> int:
        return self.max_running_requests or 256

    @classmethod
    def from_toml(cls, path: str, **overrides) -> EngineConfig:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        data = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
