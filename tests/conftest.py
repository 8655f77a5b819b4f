"""Shared fixtures, and the test tiers: every test under tests/e2e is marked ``e2e``
(subprocess servers, the default model, long runs), so ``pytest -m "not e2e"`` is the fast
tier (unit and kernel tests) and plain ``pytest`` runs both."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

E2E_DIR = Path(__file__).parent / "e2e"
BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    from radixrt.testing import tiny_model_path

    return tiny_model_path("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> str:
    from radixrt.testing import tiny_model_path

    return tiny_model_path("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3() -> str:
    from radixrt.testing import tiny_model_path

    return tiny_model_path("qwen3")


@pytest.fixture(scope="session")
def bench_module():
    """A loader of ``bench/<name>.py`` as the module ``name``: registered in sys.modules (where
    dataclasses resolve annotations), bench/ on sys.path for the modules it imports."""

    def load(name: str):
        if str(BENCH_DIR) not in sys.path:
            sys.path.insert(0, str(BENCH_DIR))
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    return load
