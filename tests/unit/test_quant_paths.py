"""Which quantized kernel path each call runs: the calibration's choice per weight shape (the
fastest at the fewest rows, the fastest at the most, the crossover between them), kept on disk;
``QuantLinear`` running each segment's path by the rows of the call; the decode chain running
the path its step names."""

from __future__ import annotations

import json

import pytest
import torch

from radixrt.model import calibrate
from radixrt.model.calibrate import Calibrator, QuantChoice
from radixrt.model.kernel_set import Kernels
from radixrt.model.weights import cache_dir
from radixrt.quant import rtn
from radixrt.quant.formats import random_blocks
from radixrt.quant.quant_linear import QuantLinear
from radixrt_kernels.cpu import capture as cpu_capture
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import quant as cpu_quant


@pytest.fixture(scope="module")
def lib():
    lib = cpu_library.load(cache_dir())
    if lib is None:
        pytest.skip(f"no kernels' library: {cpu_library.why_unavailable()}")
    return lib


def test_the_choice_is_the_fastest_at_each_end_and_their_crossover() -> None:
    seconds = {
        1: {"avx2": 2.0, "vnni": 1.0, "amx": 3.0},
        4: {"avx2": 4.0, "vnni": 2.0, "amx": 2.5},
        16: {"avx2": 9.0, "vnni": 5.0, "amx": 5.0},  # a tie goes to the fewest rows' path
        64: {"avx2": 30.0, "vnni": 20.0, "amx": 8.0},
        512: {"avx2": 200.0, "vnni": 150.0, "amx": 40.0},
    }
    assert calibrate._quant_paths(seconds) == QuantChoice("vnni", "amx", 16)
    one = {r: {"avx2": 2.0 * r, "vnni": 1.0 * r} for r in (1, 4, 16, 64)}
    assert calibrate._quant_paths(one) == QuantChoice("vnni", "vnni", 64)


def test_the_calibration_times_each_row_count_and_keeps_the_choice(
    lib, monkeypatch, tmp_path
) -> None:
    paths = [p for p in cpu_quant.PATHS if cpu_quant.path_available(lib, "Q4_0", p)]
    if len(paths) < 2:
        pytest.skip("one quantized path in this build")
    paths.remove("portable")
    first, last = paths[0], paths[-1]
    calls = []

    def fake(lib_, qtype, n, k, timed, rows, cold, chained):
        calls.append((qtype, n, k, tuple(timed), rows, cold))
        fast = first if rows <= 4 else last
        return {p: 1.0 if p == fast else 2.0 for p in timed}

    monkeypatch.setattr(calibrate, "time_quant_paths", fake)
    cal = Calibrator(lib, str(tmp_path))
    want = QuantChoice(first, last, 4) if first != last else QuantChoice(first, first, 512)
    assert cal.quant_choice("Q4_0", 96, 64) == want
    assert [(rows, cold) for *_, rows, cold in calls] == [
        (1, True),
        (4, True),
        (16, True),
        (64, True),
        (calibrate.LARGE_ROWS, False),
    ]
    assert all(c[3] == tuple(paths) for c in calls)  # the portable build is not timed
    head = cal.quant_choice("Q4_0", 96, 64, large=False)  # an LM head: decode-sized calls
    assert [rows for *_, rows, _ in calls[5:]] == [1, 4, 16, 64]
    assert head.small == first
    saved = json.loads(cal.path.read_text())
    assert saved["Q4_0:96x64"]["rows"] == want.rows and "Q4_0:96x64:small" in saved
    monkeypatch.setattr(calibrate, "time_quant_paths", lambda *a: pytest.fail("measured again"))
    assert Calibrator(lib, str(tmp_path)).quant_choice("Q4_0", 96, 64) == want


def test_a_real_quantized_calibration_picks_paths_that_run(lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(calibrate, "COLD_BYTES", 1 << 18)
    monkeypatch.setattr(calibrate, "LARGE_ROWS", 96)
    for chained in (False, True):
        choice = Calibrator(lib, str(tmp_path / str(chained)), chained=chained).quant_choice(
            "Q4_1", 64, 64
        )
        for p in (choice.small, choice.large):
            assert cpu_quant.path_available(lib, "Q4_1", p)
        assert choice.rows in calibrate.QUANT_ROWS or choice.rows == 96


def _quant_linear(lib, choice: QuantChoice | None):
    q = rtn.quantize(torch.randn(48, 64) * 0.05, "Q8_0")
    method = QuantLinear(lib, [q], None if choice is None else [choice])
    return method, method.prepare([q])


def test_each_call_runs_its_rows_class_path(lib, monkeypatch) -> None:
    if not cpu_quant.path_available(lib, "Q8_0", "avx2"):
        pytest.skip("no AVX2 path in this build")
    method, w = _quant_linear(lib, QuantChoice("avx2", "portable", 4))
    assert method.name == "Q8_0: avx2 up to 4 rows, portable above"
    seen = []
    real = cpu_quant.linear_stacked

    def spy(lib_, x, segments, *args):
        seen.append((x.shape[0], [s.path for s in segments]))
        return real(lib_, x, segments, *args)

    monkeypatch.setattr(cpu_quant, "linear_stacked", spy)
    for rows in (1, 4, 5, 70):
        x = torch.randn(rows, 64).bfloat16()
        got = method.apply(x, w, None, 48)
        monkeypatch.setattr(cpu_quant, "linear_stacked", real)
        assert torch.equal(got, method.apply(x, w, None, 48))  # every path: the same bits
        monkeypatch.setattr(cpu_quant, "linear_stacked", spy)
    assert seen == [(1, ["avx2"]), (4, ["avx2"]), (5, ["portable"]), (70, ["portable"])]


def test_a_path_the_build_does_not_run_is_refused(lib) -> None:
    with pytest.raises(ValueError, match="the sse9 path"):
        _quant_linear(lib, QuantChoice("sse9", "portable", 4))


def test_kernels_ask_their_chooser_for_each_segment(lib) -> None:
    asked = []

    def choose(qtype, n, k, large):
        asked.append((qtype, n, k, large))
        return QuantChoice("portable", "portable", 1)

    kernels = Kernels("fma", lib, quant=choose)
    q8 = rtn.quantize(torch.randn(32, 64) * 0.05, "Q8_0")
    q4 = rtn.quantize(torch.randn(16, 64) * 0.05, "Q4_0")
    method = kernels.quantized_for([q8, q4])
    head = kernels.quantized_for([q8], large=False)
    assert asked == [("Q8_0", 32, 64, True), ("Q4_0", 16, 64, True), ("Q8_0", 32, 64, False)]
    assert method.paths == [QuantChoice("portable", "portable", 1)] * 2 and head.paths
    rule = Kernels("fma", lib).quantized_for([q8])  # no chooser: the library's rule by rows
    assert rule.paths[0].small == cpu_quant.path(lib, "Q8_0", 1)
    assert rule.paths[0].large == cpu_quant.path(lib, "Q8_0", 512)
    assert cpu_quant.path(lib, "Q8_0", rule.paths[0].rows) == rule.paths[0].small


def test_a_chain_step_runs_the_path_it_names(lib) -> None:
    n, k, rows = 32, 64, 3
    raw = random_blocks("Q4_1", n, k, torch.Generator().manual_seed(0))
    packed = cpu_quant.pack(lib, "Q4_1", raw, k)
    x = torch.randn(rows, k).bfloat16()
    want = cpu_quant.linear(lib, "Q4_1", x, packed, n, k, force_path="portable")
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    chain = cpu_chain.Chain(lib)
    chain.quant_linear("Q4_1", x, packed, n, k, out, path="portable")
    chain.run()
    assert torch.equal(out, want)
    chain.steps[0][-1] = len(cpu_quant.PATHS)  # a path number the library has not
    chain._table = None
    with pytest.raises(ValueError, match="step 0 does not fit"):
        chain.run()
    with pytest.raises(ValueError, match="the sse9 path does not run Q4_1"):
        chain.quant_linear("Q4_1", x, packed, n, k, out, path="sse9")


def test_a_captured_quantized_linear_keeps_its_segments_path(lib) -> None:
    method, w = _quant_linear(lib, QuantChoice("portable", "avx2", 2))
    x = torch.randn(2, 64).bfloat16()
    with cpu_capture.capture() as recorder:
        method.apply(x, w, None, 48)
    (step,) = [s for s in recorder.steps if s.kind == "quant_linear"]
    assert step.args[-1] == "portable"
