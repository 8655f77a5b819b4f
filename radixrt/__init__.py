"""radixrt: a prefix-caching LLM serving runtime built around a radix tree."""

from __future__ import annotations

__version__ = "0.1.0"
