from __future__ import annotations

import pytest


@pytest.fixture
def client(server):
    """A Client of the module's ``server`` fixture (a ``server_harness.Server``); after the test,
    the idle KV invariant through ``server_info`` (unless the test stopped the server)."""
    from server_harness import assert_idle_kv

    from radixrt.client import Client

    with Client(server.address, timeout=60) as c:
        yield c
        if server.proc.poll() is None:
            assert_idle_kv(c)


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
