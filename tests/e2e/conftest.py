from __future__ import annotations

import pytest


@pytest.fixture
def engine_factory():
    """Build Engines; after the test, every one of them must pass check_memory() at idle."""
    from radixrt import Engine
    engines = []

    def make(model: str, **kwargs) -> Engine:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_total_tokens", 8192)
        eng = Engine(model=model, **kwargs)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.check_memory()
        eng.shutdown()
