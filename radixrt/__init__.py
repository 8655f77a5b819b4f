"""radixrt: a prefix-caching LLM serving runtime built around a radix tree.

Public names are imported lazily, so ``import radixrt.cache`` stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "radixrt.engine",
    "EngineConfig": "radixrt.config",
    "GenerateOutput": "radixrt.protocol",
    "SamplingParams": "radixrt.sampling",
    "Client": "radixrt.client",
    "AsyncClient": "radixrt.client",
    "ServerError": "radixrt.client",
    "PROTOCOL_VERSION": "radixrt.protocol",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
