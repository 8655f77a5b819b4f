"""Shared fixtures, and the test tiers: every test under tests/e2e is marked ``e2e``
(subprocess servers, the default model, long runs), so ``pytest -m "not e2e"`` is the fast
tier (unit and kernel tests) and plain ``pytest`` runs both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

E2E_DIR = Path(__file__).parent / "e2e"


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
