"""Capture and replay (``radixrt_kernels.cpu.capture``, ``cpu.chain.replay``): code calling the CPU
kernels' wrappers is recorded as chain steps and replayed bit for bit; anything a chain cannot
replay is refused by name."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import capture as cpu_capture
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import elementwise as cpu_ops
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear

HIDDEN, INTER = 96, 128
ROWS = torch.tensor([0, 2])


@pytest.fixture(scope="module")
def lib():
    lib = cpu_library.load(cache_dir())
    if lib is None:
        pytest.skip(f"no CPU kernels' library: {cpu_library.why_unavailable()}")
    return lib


def chain_kernel(lib) -> str:
    for kernel in cpu_chain.KERNELS:
        if cpu_linear.kernel_available(lib, kernel):
            return kernel
    pytest.skip("no linear kernel a chain runs works here")


def mlp_block(lib, kernel, p, h, residual):
    """A pre-norm MLP block on the wrappers: (its output, the residual after it)."""
    x = cpu_ops.rms_norm(lib, h, p["norm"], 1e-6, residual)
    act = cpu_linear.linear(lib, x, p["gate_up"], 2 * INTER, gated=True, kernel=kernel)
    return cpu_linear.linear(lib, act, p["down"], HIDDEN, kernel=kernel), residual


def weights(lib, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.1).bfloat16()

    return {
        "norm": 1 + w(HIDDEN),
        "gate_up": cpu_linear.pack(lib, w(2 * INTER, HIDDEN), gated=True),
        "down": cpu_linear.pack(lib, w(HIDDEN, INTER)),
    }


def test_a_replay_gives_the_calls_results_and_reuses_memory(lib) -> None:
    kernel, layers = chain_kernel(lib), [weights(lib, seed) for seed in range(3)]
    rows = 5
    h_in, res_in = torch.zeros(rows, HIDDEN).bfloat16(), torch.zeros(rows, HIDDEN).bfloat16()

    def body(h, residual):
        for p in layers:
            h, residual = mlp_block(lib, kernel, p, h, residual)
        return h, residual

    with cpu_capture.capture() as recorder:
        outputs = body(h_in, res_in)
    assert [s.kind for s in recorder.steps] == ["norm", "linear", "linear"] * 3
    replay = cpu_chain.replay(lib, recorder, outputs, rows)
    assert replay.serves == (1, rows)  # no choice by row count: any row count up to its own
    # nine intermediate tensors, at most two alive at once: they share memory
    allocated = sum(t.untyped_storage().nbytes() for t in recorder.allocated.values())
    assert len(recorder.allocated) == 9
    assert replay.arena.buffer.numel() < allocated / 2
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # new inputs in the same buffers, the same replay
        h = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        res = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        want_h, want_res = body(h, res.clone())
        h_in.copy_(h)
        res_in.copy_(res)
        replay.run(None, None, rows)
        got_h, got_res = replay.outputs
        assert got_res.data_ptr() == res_in.data_ptr()  # an input buffer, as captured
        assert torch.equal(got_h, want_h) and torch.equal(got_res, want_res)
    # fewer rows: every step on the first rows of its buffers
    h, res = torch.randn(2, rows, HIDDEN, generator=gen).bfloat16()
    want_h, want_res = body(h[:3], res[:3].clone())
    h_in.copy_(h), res_in.copy_(res)
    replay.run(None, None, 3)
    got_h, got_res = replay.outputs
    assert torch.equal(got_h[:3], want_h) and torch.equal(got_res[:3], want_res)
    assert torch.equal(got_res[3:], res[3:])  # rows past the run's are not touched
    with pytest.raises(ValueError, match="cannot run 6"):
        replay.run(None, None, rows + 1)


def test_a_capture_notes_the_row_counts_that_choose_as_it_did(lib) -> None:
    """A choice by row count (``small_side``) narrows the rows a capture serves: at most the
    threshold on the small side, more than it on the other."""
    with cpu_capture.capture() as recorder:
        assert cpu_capture.small_side(5, 16)
        assert not cpu_capture.small_side(5, 2)
        assert cpu_capture.small_side(5, 8)
    assert recorder.rows == (3, 8)
    assert cpu_capture.small_side(100, 16) is False  # outside a capture: only the answer


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda x: x * 0.5, "mul"),
        (lambda x: x.add_(1), "add_"),
        (lambda x: x[ROWS], "getitem"),  # a gather
        (lambda x: torch.tensor([0, 2]), "tensor"),  # a new tensor from values
        (lambda x: x.sum().item(), "sum"),
        (lambda x: x.contiguous() if x.is_contiguous() else x + 0, None),
        (lambda x: x.t().contiguous(), "contiguous"),  # a copy
        (lambda x: x.view(2, -1)[:, 3:].split(4, dim=1), None),
    ],
)
def test_a_capture_passes_views_and_refuses_computing_ops_by_name(op, name) -> None:
    x = torch.zeros(4, 8)
    if name is None:
        with cpu_capture.capture() as recorder:
            op(x)
        assert recorder.steps == []
        return
    with pytest.raises(cpu_capture.ChainRefused, match=rf"^{name} at test_cpu_capture\.py"):
        with cpu_capture.capture():
            op(x)
    assert cpu_capture.capturing() is None


def test_kernel_calls_without_a_chain_step_are_refused(lib) -> None:
    x = torch.zeros(3, 2 * INTER).bfloat16()
    with cpu_capture.capture() as recorder:  # SiLU-and-mul on its own is a step now
        cpu_ops.silu_mul(lib, x)
    assert [s.kind for s in recorder.steps] == ["silu_mul"]
    packed = cpu_linear.pack(lib, torch.zeros(HIDDEN, HIDDEN).bfloat16())
    with pytest.raises(cpu_capture.ChainRefused, match="the amx linear kernel"):
        with cpu_capture.capture():
            cpu_linear.linear(lib, x[:, :HIDDEN], packed, HIDDEN, kernel="amx")
    with pytest.raises(cpu_capture.ChainRefused, match="float32 output"):
        with cpu_capture.capture():
            cpu_linear.linear(lib, x[:, :HIDDEN], packed, HIDDEN, float_out=True, kernel="fma")


def test_captures_do_not_nest_and_a_replay_waits_for_the_end(lib) -> None:
    with cpu_capture.capture() as recorder:
        with pytest.raises(RuntimeError, match="already active"):
            with cpu_capture.capture():
                pass
        assert cpu_capture.capturing() is recorder
        with pytest.raises(RuntimeError, match="has not ended"):
            cpu_chain.replay(lib, recorder, (), 1)
    assert cpu_capture.capturing() is None
