from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


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
