"""Which runs are exact, and what is refused (no model)."""

from __future__ import annotations

import pytest

from radixrt.config import EngineConfig
from radixrt.model import exactness


def test_exact_by_default_on_the_cpu_only_when_asked_elsewhere():
    assert EngineConfig().wants_exact("cpu") and not EngineConfig().wants_exact("cuda")
    assert EngineConfig(enable_deterministic_inference=True).wants_exact("cuda")
    assert not EngineConfig(disable_deterministic_inference=True).wants_exact("cpu")
    with pytest.raises(ValueError, match="are both set"):
        EngineConfig(enable_deterministic_inference=True, disable_deterministic_inference=True)


@pytest.mark.parametrize(
    "option, name",
    [
        ({"linear_kernel": "onednn"}, "linear_kernel='onednn'"),
        ({"linear_kernel": "torch_fp32"}, "linear_kernel='torch_fp32'"),
        ({"attention_backend": "torch"}, "attention_backend='torch'"),
        ({"enable_torch_compile": True}, "enable_torch_compile"),
    ],
)
def test_options_that_are_not_exact_are_refused_by_name(option, name):
    with pytest.raises(ValueError, match=f"{name}.*--disable-deterministic-inference"):
        exactness.refuse_conflicts(EngineConfig(**option), "cpu")
    config = EngineConfig(disable_deterministic_inference=True, **option)
    assert exactness.refuse_conflicts(config, "cpu") is False
    assert exactness.refuse_conflicts(EngineConfig(**option), "cuda") is False


def test_a_part_that_cannot_be_exact_is_reported_or_refused():
    got = exactness.settle(EngineConfig(), True, ["no library"])
    assert not got.exact and got.info() == {
        "exact_outputs": False,
        "exact_outputs_detail": "not exact: no library",
    }
    with pytest.raises(RuntimeError, match="cannot be exact here: no library"):
        exactness.settle(EngineConfig(enable_deterministic_inference=True), True, ["no library"])
    assert exactness.settle(EngineConfig(), True, []).exact
    off = exactness.settle(EngineConfig(disable_deterministic_inference=True), False, [])
    assert not off.exact and off.describe().startswith("off")


def test_cuda_with_the_flag_is_reported_not_refused():
    config = EngineConfig(enable_deterministic_inference=True)
    got = exactness.settle(config, True, [], "cuda")
    assert not got.exact and "cuBLAS" in got.describe()
