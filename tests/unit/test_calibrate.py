"""The linear calibration: the fastest path per weight shape and class of calls, measured once
per machine and kept on disk; ByRows, which runs one path up to a row count and another above;
the attention kernel's bf16 path, measured and kept the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from radixrt.attention.cpu_backend import CpuAttentionBackend
from radixrt.cache.kv_pool import KVPool
from radixrt.model import calibrate
from radixrt.model.calibrate import PATHS, Calibrator, Choice
from radixrt.model.linear_methods import (
    ByRows,
    LinearMethod,
    PackedKernels,
    PackedLinear,
    TorchFP32Linear,
)
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import attention as cpu_attention
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear


@pytest.fixture
def lib():
    lib = cpu_library.load(cache_dir())
    if lib is None:
        pytest.skip(f"no CPU kernels' library: {cpu_library.why_unavailable()}")
    return lib


def fake_times(monkeypatch, seconds: dict) -> list:
    """time_paths answers from ``seconds`` {(path, rows): s}; returns the calls made."""
    calls = []

    def time_paths(methods, n, k, rows, cold, chained=False):
        calls.append((tuple(methods), n, k, rows, cold))
        return {name: seconds.get((name, rows), 1.0) for name in methods}

    monkeypatch.setattr(calibrate, "time_paths", time_paths)
    return calls


def test_the_fastest_path_per_class_is_chosen_and_kept(lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(
        calibrate, "available_paths", lambda lib, k: ["fma", "onednn", "torch_fp32"]
    )
    small, large = calibrate.SMALL_ROWS, calibrate.LARGE_ROWS
    calls = fake_times(
        monkeypatch,
        {
            ("fma", small): 0.1,
            ("onednn", small): 0.2,
            ("torch_fp32", large): 0.3,
            ("fma", large): 0.5,
        },
    )
    cal = Calibrator(lib, str(tmp_path))
    assert cal.choice(96, 64) == Choice("fma", "torch_fp32")
    assert {(rows, cold) for *_, rows, cold in calls} == {(small, True), (large, False)}
    assert cal.choice(96, 64, large=False) == Choice("fma", "fma")  # an LM head: decode only
    measured = len(calls)
    assert cal.choice(96, 64) == Choice("fma", "torch_fp32") and len(calls) == measured
    saved = json.loads(cal.path.read_text())
    assert saved["96x64"]["small"] == "fma" and saved["96x64"]["seconds"]["large"]["fma"] == 0.5
    monkeypatch.setattr(calibrate, "time_paths", lambda *a: pytest.fail("measured again"))
    again = Calibrator(lib, str(tmp_path))  # a later start on this machine reads the file
    assert again.choice(96, 64) == Choice("fma", "torch_fp32")
    assert Calibrator(lib, str(tmp_path), threads=7).path != cal.path  # another thread count


def test_a_damaged_or_stale_file_is_measured_again(lib, monkeypatch, tmp_path) -> None:
    cal = Calibrator(lib, str(tmp_path))
    cal.path.parent.mkdir(parents=True)
    cal.path.write_text("{not json")
    monkeypatch.setattr(calibrate, "available_paths", lambda lib, k: ["torch"])
    calls = fake_times(monkeypatch, {})
    assert Calibrator(lib, str(tmp_path)).choice(32, 32) == Choice("torch", "torch") and calls
    cal.path.write_text(json.dumps({"32x32": {"small": "gone", "large": "torch"}}))
    assert Calibrator(lib, str(tmp_path)).choice(32, 32) == Choice("torch", "torch")


def test_packed_paths_need_whole_chunks(lib) -> None:
    assert not set(cpu_linear.KERNELS) & set(calibrate.available_paths(lib, 40))
    assert "fma" in calibrate.available_paths(lib, 64)
    assert set(calibrate.available_paths(lib, 64)) <= set(PATHS)


def test_a_real_calibration_picks_a_path_that_runs(lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(calibrate, "COLD_BYTES", 1 << 20)
    monkeypatch.setattr(calibrate, "LARGE_ROWS", 96)
    choice = Calibrator(lib, str(tmp_path)).choice(64, 64)
    assert choice.small in calibrate.available_paths(lib, 64)
    assert choice.large in calibrate.available_paths(lib, 64)


def test_by_rows_runs_each_path_on_its_own_layout(lib) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    fma = PackedLinear(lib, PackedKernels("fma", "fma"))
    method = ByRows(fma, TorchFP32Linear(), threshold=8)
    weight = method.prepare(w)
    assert weight.dtype == torch.float32 and method.small_w is not None  # two layouts held
    for rows, want_method, want_w in ((8, fma, fma.prepare(w)), (9, TorchFP32Linear(), w.float())):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(
            method.apply(x, weight, None, 96), want_method.apply(x, want_w, None, 96)
        )
    same = ByRows(PackedLinear(lib, PackedKernels("fma", "fma")), fma)
    same.prepare(w)
    assert same.small_w is None  # one layout: one copy


@pytest.mark.parametrize(
    "small,large", [("torch", "torch_fp32"), ("onednn", "torch"), ("fma", "onednn")]
)
def test_by_rows_keeps_both_layouts_where_they_differ(lib, small: str, large: str) -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 64).bfloat16()
    if "onednn" in (small, large) and not calibrate.onednn_works():
        pytest.skip("no oneDNN linear ops")
    method = ByRows(calibrate.make_method(small, lib), calibrate.make_method(large, lib), 4)
    weight = method.prepare(w)
    for rows in (4, 5):  # each side on its own layout, equal to PyTorch's within bf16 rounding
        x = torch.randn(rows, 64).bfloat16()
        got = method.apply(x, weight, None, 64)
        torch.testing.assert_close(
            got.float(), torch.nn.functional.linear(x, w).float(), rtol=2**-6, atol=0.1
        )


def test_a_second_layout_must_pay_for_itself() -> None:
    seconds = {"fma": 1.0, "amx": 0.95, "torch_fp32": 0.92, "onednn": 2.0}
    assert calibrate._best_large(seconds, "fma") == "amx"  # fp32 copy not 10 % faster: packed
    seconds["torch_fp32"] = 0.5
    assert calibrate._best_large(seconds, "fma") == "torch_fp32"
    assert calibrate._best_large(seconds, "onednn") == "torch_fp32"
    assert calibrate._best_large({"onednn": 1.0, "torch": 0.95}, "onednn") == "onednn"


@pytest.mark.parametrize("dots_faster", [True, False])
def test_attention_takes_the_faster_bf16_path_and_keeps_it(
    lib, monkeypatch, tmp_path, dots_faster: bool
) -> None:
    if not cpu_attention.dots_available(lib):
        pytest.skip("this build has no AVX512-BF16 dot products")
    calls = []

    def time_attention(lib, kv_heads, group, head_dim):
        calls.append((kv_heads, group, head_dim))
        return {"dots": 1.0 if dots_faster else 2.0, "fma": 1.5}

    monkeypatch.setattr(calibrate, "time_attention", time_attention)
    assert Calibrator(lib, str(tmp_path)).attention_dots(3, 3, 64) is dots_faster
    assert calls == [(3, 3, 64)]
    again = Calibrator(lib, str(tmp_path))  # read back from the file
    assert again.attention_dots(3, 3, 64) is dots_faster and len(calls) == 1
    again.attention_dots(2, 4, 64)  # another shape is measured on its own
    assert calls[-1] == (2, 4, 64)


def test_a_real_attention_calibration_times_both_paths(lib) -> None:
    seconds = calibrate.time_attention(lib, 2, 3, 64)
    assert set(seconds) == {"dots", "fma"} and all(0 < s < 10 for s in seconds.values())


def test_the_backend_runs_the_measured_attention_path(lib, monkeypatch) -> None:
    monkeypatch.setattr(
        Calibrator, "attention_dots", lambda self, kh, g, d, exact=False: (kh, g, d) == (2, 3, 64)
    )
    pool = KVPool(64, 1, 2, 64, torch.bfloat16, 2, 32)
    backend = CpuAttentionBackend(pool, num_heads=6)
    assert backend.bf16_dots is cpu_attention.dots_available(lib)
    assert backend.describe() == ("cpu (bf16: dot products)" if backend.bf16_dots else "cpu")
    assert CpuAttentionBackend(pool, num_heads=6, bf16_dots=False).bf16_dots is False
    fp32 = KVPool(64, 1, 2, 64, torch.float32, 2, 32)
    assert CpuAttentionBackend(fp32, num_heads=6, bf16_dots=True).bf16_dots is False


def fake_contention(monkeypatch, cores: list[float]) -> None:
    """Contention reports ``cores`` in turn (the last one from then on)."""
    seen = iter(cores)

    class Fake:
        def __enter__(self):
            self.cores = next(seen, cores[-1])
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(calibrate, "Contention", Fake)


def test_a_measurement_on_a_busy_cpu_is_taken_again(lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(calibrate, "available_paths", lambda lib, k: ["fma", "onednn"])
    small = calibrate.SMALL_ROWS
    answers = iter([{"fma": 2.0, "onednn": 1.0}, {"fma": 1.0, "onednn": 2.0}])
    calls = []

    def time_paths(methods, n, k, rows, cold, chained=False):
        calls.append(rows)
        return next(answers) if rows == small else dict.fromkeys(methods, 1.0)

    monkeypatch.setattr(calibrate, "time_paths", time_paths)
    fake_contention(monkeypatch, [1.5, 0.0])  # busy, then quiet: the quiet attempt counts
    assert Calibrator(lib, str(tmp_path)).choice(64, 64).small == "fma"
    assert calls.count(small) == 2
    entry = json.loads(Calibrator(lib, str(tmp_path)).path.read_text())["64x64"]
    assert entry["busy_cores"] == 0.0 and entry["small"] == "fma"


def test_a_cpu_that_never_settles_is_measured_again_at_the_next_start(
    lib, monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(calibrate, "available_paths", lambda lib, k: ["fma", "onednn"])
    calls = fake_times(monkeypatch, {("onednn", calibrate.SMALL_ROWS): 0.5})
    fake_contention(monkeypatch, [1.2, 0.9, 1.0])
    cal = Calibrator(lib, str(tmp_path))
    assert cal.choice(64, 64).small == "onednn"  # the least disturbed attempt serves this start
    assert len(calls) == 2 * calibrate.ATTEMPTS
    assert cal.choice(64, 64).small == "onednn" and len(calls) == 2 * calibrate.ATTEMPTS
    assert json.loads(cal.path.read_text())["64x64"]["busy_cores"] == 0.9
    fake_contention(monkeypatch, [0.0])
    assert Calibrator(lib, str(tmp_path)).choice(64, 64).small == "onednn"
    assert len(calls) == 2 * calibrate.ATTEMPTS + 2  # measured again, on a quiet CPU now
    monkeypatch.setattr(calibrate, "time_paths", lambda *a: pytest.fail("measured again"))
    assert Calibrator(lib, str(tmp_path)).choice(64, 64).small == "onednn"


def test_the_attention_measurement_waits_for_a_quiet_cpu_too(lib, monkeypatch, tmp_path) -> None:
    if not cpu_attention.dots_available(lib):
        pytest.skip("this build has no AVX512-BF16 dot products")
    answers = iter([{"dots": 2.0, "fma": 1.0}, {"dots": 1.0, "fma": 2.0}])
    monkeypatch.setattr(calibrate, "time_attention", lambda *a: next(answers))
    fake_contention(monkeypatch, [2.0, 0.1])
    assert Calibrator(lib, str(tmp_path)).attention_dots(3, 3, 64) is True


def _contention_with_a_busy_process(cpu: int | None) -> float:
    """Contention.cores over a second of this process sleeping while another spins (on
    ``cpu`` when given)."""
    pin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\n" if cpu is not None else ""
    busy = pin + "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    other = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.3)
        with calibrate.Contention() as c:
            time.sleep(1.0)  # this process uses nothing; the other one a whole core
    finally:
        other.kill()
        other.wait()
    return c.cores


def test_contention_sees_another_process_keep_a_core_busy() -> None:
    if calibrate._cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    assert _contention_with_a_busy_process(None) > calibrate.BUSY_CORES


def test_contention_counts_only_the_cpus_this_process_may_run_on() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if calibrate._cpu_ticks() is None or len(cpus) < 2:
        pytest.skip("needs /proc/stat and two CPUs")
    os.sched_setaffinity(0, {cpus[0]})
    try:  # a replica pinned to its own CPU does not count another's work
        with calibrate.Contention() as quiet:
            time.sleep(1.0)
        if quiet.cores > calibrate.BUSY_CORES:  # other processes already keep this CPU busy
            pytest.skip(f"CPU {cpus[0]} is busy with other work ({quiet.cores:.2f} cores)")
        away = _contention_with_a_busy_process(cpus[1])
        here = _contention_with_a_busy_process(cpus[0])
    finally:
        os.sched_setaffinity(0, cpus)
    assert away < 0.5 < here


def test_a_packed_path_close_to_the_fastest_is_taken() -> None:
    assert calibrate._fastest({"onednn": 1.0, "avx512_bf16": 1.04, "torch": 1.5}) == "avx512_bf16"
    assert calibrate._fastest({"onednn": 1.0, "avx512_bf16": 1.2, "torch": 1.5}) == "onednn"
    assert calibrate._fastest({"onednn": 1.0, "torch": 0.99}) == "torch"


def test_decode_sized_packed_calls_are_timed_as_a_chain_runs_them(lib, monkeypatch) -> None:
    """With ``chained`` the packed kernels a decode chain takes run their copies as one chain
    (each round), the other paths call by call; without it every path calls."""
    from radixrt_kernels.cpu import chain as cpu_chain

    kernels = [k for k in cpu_chain.KERNELS if cpu_linear.kernel_available(lib, k)]
    if not kernels:
        pytest.skip("no kernel a chain runs")
    runs = []
    run = cpu_chain.Chain.run
    monkeypatch.setattr(cpu_chain.Chain, "run", lambda self, *a: runs.append(self) or run(self))
    methods = {kernels[0]: calibrate.make_method(kernels[0], lib), "torch": LinearMethod()}
    seconds = calibrate.time_paths(methods, 64, 64, 4, True, chained=True)
    assert len(runs) == calibrate.ROUNDS and len(runs[0].steps) > 1
    assert all(0 < s < 1 for s in seconds.values())
    runs.clear()
    calibrate.time_paths(methods, 64, 64, 4, True)
    assert not runs
    assert Calibrator(lib, "/nowhere", chained=True).path != Calibrator(lib, "/nowhere").path


# ---- exact mode: one packed kernel per shape, the same in every process -----------------------


def test_exact_calibration_times_the_packed_kernels_only_and_picks_one(
    lib, monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(calibrate, "row_invariant_paths", lambda lib: ["amx", "fma"])
    small, large = calibrate.SMALL_ROWS, calibrate.LARGE_ROWS
    calls = fake_times(
        monkeypatch,
        {("fma", small): 0.1, ("amx", small): 0.2, ("fma", large): 1.0, ("amx", large): 0.3},
    )
    cal = Calibrator(lib, str(tmp_path), exact=True)
    assert cal.choice(96, 64) == Choice("amx", "amx")  # 2x slower decode-sized, 3.3x prefill
    assert {methods for methods, *_ in calls} == {("amx", "fma")}  # no oneDNN, no PyTorch
    assert cal.choice(96, 64, large=False) == Choice("fma", "fma")  # an LM head: decode only
    assert cal.choice(96, 40) == Choice("amx", "amx")  # K padded for the packed kernels
    assert calls[-1][2] == 40


def test_one_path_for_both_classes_is_the_least_total_slowdown() -> None:
    small = {"amx": 1.5, "fma": 1.0, "avx512_bf16": 1.1}
    assert calibrate._one_path(small, {}) == "fma"
    assert calibrate._one_path(small, {"amx": 1.0, "fma": 3.0, "avx512_bf16": 1.2}) == "avx512_bf16"
    assert calibrate._one_path(small, {"amx": 1.0, "fma": 3.0, "avx512_bf16": 1.6}) == "amx"


def test_an_exact_calibration_is_kept_even_from_a_busy_cpu(lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(calibrate, "row_invariant_paths", lambda lib: ["fma", "avx512_bf16"])
    calls = fake_times(monkeypatch, {("avx512_bf16", calibrate.SMALL_ROWS): 0.5})
    fake_contention(monkeypatch, [1.2, 0.9, 1.0])
    assert Calibrator(lib, str(tmp_path), exact=True).choice(64, 64).small == "avx512_bf16"
    assert len(calls) == 2 * calibrate.ATTEMPTS  # tried for a quiet CPU all the same
    fake_contention(monkeypatch, [0.0])
    monkeypatch.setattr(calibrate, "time_paths", lambda *a: pytest.fail("measured again"))
    assert Calibrator(lib, str(tmp_path), exact=True).choice(64, 64).small == "avx512_bf16"


def test_an_exact_calibration_is_one_file_for_every_process_here(lib, tmp_path) -> None:
    exact = Calibrator(lib, str(tmp_path), exact=True).path
    assert Calibrator(lib, str(tmp_path), threads=7, chained=True, exact=True).path == exact
    assert exact != Calibrator(lib, str(tmp_path)).path  # the fastest-per-class choices


def test_an_exact_calibration_it_cannot_share_is_refused(lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(calibrate, "row_invariant_paths", lambda lib: ["fma"])
    monkeypatch.setattr(calibrate, "available_paths", lambda lib, k: ["fma"])
    fake_times(monkeypatch, {})
    (tmp_path / "file").write_text("")  # a cache "directory" that is a file: nothing is kept
    with pytest.raises(calibrate.NotExact, match="exact mode: every process must take the same"):
        Calibrator(lib, str(tmp_path / "file"), exact=True).choice(64, 64)
    # elsewhere this start runs on what it measured
    assert Calibrator(lib, str(tmp_path / "file")).choice(64, 64) == Choice("fma", "fma")


def test_the_attention_choice_in_exact_mode_is_the_shared_one(lib, monkeypatch, tmp_path) -> None:
    if not cpu_attention.dots_available(lib):
        pytest.skip("this build has no AVX512-BF16 dot products")
    calls = []

    def time_attention(*args):  # dots faster in the first measurement's attempts only
        calls.append(args)
        return {"dots": 1.0, "fma": 2.0 if len(calls) <= calibrate.ATTEMPTS else 0.5}

    monkeypatch.setattr(calibrate, "time_attention", time_attention)
    fake_contention(monkeypatch, [2.0])  # busy throughout: kept all the same
    assert Calibrator(lib, str(tmp_path), exact=True).attention_dots(3, 3, 64) is True
    assert Calibrator(lib, str(tmp_path), threads=5, exact=True).attention_dots(3, 3, 64) is True
    assert Calibrator(lib, str(tmp_path)).attention_dots(3, 3, 64) is False  # its own file


CONCURRENT = """
import json, os, random, sys, time
from radixrt.model import calibrate
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library

def time_paths(methods, n, k, rows, cold, chained=False):
    with open(sys.argv[2], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(0.5)  # the other process starts meanwhile
    return {name: random.random() for name in methods}

calibrate.time_paths = time_paths
lib = library.load(cache_dir())
sys.stdout.write(json.dumps(calibrate.Calibrator(lib, sys.argv[1], exact=True).choice(96, 64)))
"""


def test_processes_calibrating_at_once_measure_once_and_take_one_result(lib, tmp_path) -> None:
    log = tmp_path / "measured"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT, str(tmp_path), str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1] and json.loads(outputs[0])[0] in cpu_linear.KERNELS
    assert len(set(log.read_text().split())) == 1  # one process measured, the other waited
