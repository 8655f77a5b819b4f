"""Whether a request's outputs are exact: the same bits whatever the batch, the cache, the
chunking or the replica.

Outputs are exact when every reduction a token's row goes through is added in one order that
depends on nothing but the row: each linear weight shape runs one row-invariant kernel for
every row count (``kernel_set.choose_kernels(exact=True)``), attention reduces a query's keys
in fixed blocks from key 0 in order whether they were cached or just computed, in decode and
in extend (the CPU kernel's exact mode; the Triton kernels' deterministic mode on CUDA), and
the sampler draws a seeded request's numbers from its own generator.

``settle(config, device)`` decides what a model runner builds. Exactness is wanted on the CPU
unless ``disable_deterministic_inference``, elsewhere with ``enable_deterministic_inference``
(``EngineConfig.wants_exact``). Where it is wanted:
- an option the user chose that is not exact (``CONFLICTS``) is refused at start, naming it;
- a part that cannot be exact here (no C kernels' library, a head size the C attention kernel
  does not take) is refused with ``enable_deterministic_inference``; otherwise it is logged as
  a warning and reported (``Exactness.why_not``, in ``server_info`` as ``exact_outputs`` and
  ``exact_outputs_detail``); cuBLAS's linears on CUDA are always only reported.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from radixrt.config import EngineConfig

logger = logging.getLogger(__name__)

DISABLE = "--disable-deterministic-inference"


def conflicts(config: EngineConfig) -> list[str]:
    """The options of ``config`` that make outputs depend on the batch."""
    found = []
    if config.linear_kernel in ("onednn", "torch", "torch_fp32"):
        found.append(f"linear_kernel={config.linear_kernel!r} (its sums depend on the row count)")
    if config.attention_backend == "torch":
        found.append("attention_backend='torch' (PyTorch's attention reduces per batch shape)")
    if config.enable_torch_compile:
        found.append("enable_torch_compile (Inductor's kernels differ by batch shape)")
    return found


class Exactness(NamedTuple):
    """``wanted``: exactness was asked for (or is the default); ``why_not``: the parts that
    are not exact here (empty when exact, or when it was not wanted); ``exact``: both."""

    wanted: bool
    why_not: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return self.wanted and not self.why_not

    def describe(self) -> str:
        if not self.wanted:
            return f"off ({DISABLE} or a GPU without --enable-deterministic-inference)"
        if self.why_not:
            return "not exact: " + "; ".join(self.why_not)
        return "exact: the same bits whatever the batch, the cache, the chunking or the replica"

    def info(self) -> dict[str, object]:
        """The ``server_info`` fields."""
        return {"exact_outputs": self.exact, "exact_outputs_detail": self.describe()}


def refuse_conflicts(config: EngineConfig, device_type: str) -> bool:
    """Whether exactness is wanted; raises ValueError naming every option that conflicts with
    it."""
    wanted = config.wants_exact(device_type)
    found = conflicts(config) if wanted else []
    if found:
        raise ValueError(
            "outputs are exact by default, and these options are not: "
            + "; ".join(found)
            + f". Add {DISABLE} to run them"
        )
    return wanted


CUBLAS = "the linears run on cuBLAS, whose sums for a row depend on the rows beside it"


def settle(
    config: EngineConfig, wanted: bool, why_not: list[str], device_type: str = "cpu"
) -> Exactness:
    """The run's exactness, given the parts that turned out not exact here (``why_not``):
    refused with ``enable_deterministic_inference``, else logged. Off the CPU the linears are
    cuBLAS's, which radixrt has no row-invariant replacement for: reported, not refused, so
    that the flag still gives deterministic attention there."""
    if not wanted:
        return Exactness(False)
    if why_not and config.enable_deterministic_inference:
        raise RuntimeError(
            "enable_deterministic_inference: outputs cannot be exact here: " + "; ".join(why_not)
        )
    if device_type != "cpu":
        why_not = [CUBLAS, *why_not]
    result = Exactness(True, tuple(why_not))
    if why_not:
        logger.warning("outputs are not exact: %s", "; ".join(why_not))
    return result
