"""The quantized linear kernels (radixrt_kernels/cpu/quant.*) against radixrt.quant.arithmetic
and gguf: unpacking equals gguf's dequantization bit for bit, every path equals the reference
bit for bit at any row count (and a row alone equals it in a batch), the results are within
the activation quantization's bound of a float64 product, the AVX2-only and portable builds
give the native build's bits, and what is not taken is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixrt.model.weights import cache_dir
from radixrt.quant import arithmetic as reference
from radixrt.quant import formats
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import quant

TYPES = list(reference.BLOCK)
K_TYPES = [t for t in TYPES if reference.BLOCK[t] == 256]
SPECIAL_F16 = [0.0, -0.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, 1.0]
AVX2_FLAGS = (
    "-mno-avx512f -mno-amx-tile -mno-amx-bf16 -mno-amx-int8 -mno-avx512bf16 -mno-avx512vnni"
    " -mno-avxvnni"
)
PORTABLE_FLAGS = f"{AVX2_FLAGS} -mno-avx -mno-avx2 -mno-fma -mno-f16c"


@pytest.fixture(scope="module")
def lib():
    lib = cpu_library.load(cache_dir())
    if lib is None:
        pytest.skip(f"no kernels' library: {cpu_library.why_unavailable()}")
    return lib


def f16_fields(qtype: str) -> list[int]:
    """Byte offsets of a block's fp16 fields (d, and m or dmin)."""
    if qtype == "Q6_K":
        return [208]
    return [0, 2] if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0]


def make_raw(qtype: str, n: int, k: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """Random GGUF blocks [n, row_bytes]: random values, fp16 scales of about 1e-2 (``extreme``:
    a quarter of them from SPECIAL_F16, and a tenth of the blocks all zeros)."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // reference.BLOCK[qtype]
    raw = torch.randint(
        0, 256, (n, blocks, reference.TYPE_SIZE[qtype]), generator=g, dtype=torch.uint8
    )
    for at in f16_fields(qtype):
        scale = (torch.rand(n, blocks, generator=g) * 0.02 + 1e-3) * (
            torch.rand(n, blocks, generator=g) - 0.3
        ).sign()
        if extreme:
            pick = torch.randint(0, len(SPECIAL_F16), (n, blocks), generator=g)
            special = torch.tensor(SPECIAL_F16)[pick]
            scale = torch.where(torch.rand(n, blocks, generator=g) < 0.25, special, scale)
        raw[..., at : at + 2] = scale.half().view(torch.uint8).view(n, blocks, 2)
    if extreme:
        raw[torch.rand(n, blocks, generator=g) < 0.1] = 0
    return raw.view(n, -1)


def make_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat_interleave(
        32, 1
    ).view(m, k)
    x[:, 32:64] = 0  # an all-zero activation block
    return x.to(dtype)


@pytest.mark.parametrize("qtype", TYPES)
def test_unpacking_equals_gguf_dequantize(lib, qtype: str) -> None:
    n, k = 37, 512
    raw = make_raw(qtype, n, k, seed=1, extreme=True)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype]))
    packed = quant.pack(lib, qtype, raw, k)
    assert torch.equal(quant.dequantize(lib, qtype, packed, n, k), want)
    assert torch.equal(reference.dequantize(qtype, raw, k), want)
    assert torch.equal(quant.dequantize(None, qtype, quant.pack(None, qtype, raw, k), n, k), want)


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_size_is_near_the_raw_size(lib, qtype: str) -> None:
    raw = make_raw(qtype, 64, 512, seed=2)
    packed = quant.pack(lib, qtype, raw, 512)
    assert packed.numel() <= 1.03 * raw.numel()


def shapes(qtype: str) -> list[tuple[int, int, int]]:
    """(M, N, K) per row count: N's not multiples of 16 among them, K = 576 for the 32 types."""
    ks = [256, 512, 1536] if qtype in K_TYPES else [256, 512, 576, 1536]
    ns = [16, 37, 100, 3]
    return [
        (m, ns[i % len(ns)], ks[i % len(ks)]) for i, m in enumerate([1, 2, 7, 64, 65, 300, 700])
    ]


@pytest.mark.parametrize("qtype", TYPES)
def test_every_path_equals_the_reference_bit_for_bit(lib, qtype: str) -> None:
    paths = [p for p in quant.PATHS if quant.path_available(lib, qtype, p)]
    for i, (m, n, k) in enumerate(shapes(qtype)):
        raw = make_raw(qtype, n, k, seed=10 + i, extreme=i % 2 == 1)
        dtype = (torch.bfloat16, torch.float32)[i % 2]
        x = make_x(m, k, dtype, seed=i)
        bias = torch.randn(n) if i % 3 == 0 else None
        out_dtype = torch.float32 if i == 2 else None
        want = reference.linear(qtype, x, raw, n, k, bias, out_dtype)
        packed = quant.pack(lib, qtype, raw, k)
        for path in paths:
            got = quant.linear(lib, qtype, x, packed, n, k, bias, out_dtype, force_path=path)
            assert got.dtype == (out_dtype or dtype)
            assert torch.equal(got, want), (path, m, n, k)
        assert torch.equal(quant.linear(None, qtype, x, raw, n, k, bias, out_dtype), want)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_row_alone_equals_it_in_a_batch(lib, qtype: str) -> None:
    n, k, m = 100, 512, 70
    raw = make_raw(qtype, n, k, seed=3)
    packed = quant.pack(lib, qtype, raw, k)
    wide = make_x(m, 2 * k, torch.bfloat16, seed=4)
    x = wide[:, k:]  # rows strided
    threads = torch.get_num_threads()
    for path in [p for p in quant.PATHS if quant.path_available(lib, qtype, p)]:
        batch = quant.linear(lib, qtype, x, packed, n, k, force_path=path)
        for r in (0, 9, 63, 64, 69):
            assert torch.equal(
                quant.linear(lib, qtype, x[r : r + 1], packed, n, k, force_path=path),
                batch[r : r + 1],
            )
        assert torch.equal(
            quant.linear(lib, qtype, x[5:22], packed, n, k, force_path=path), batch[5:22]
        )
        torch.set_num_threads(1)
        try:
            assert torch.equal(quant.linear(lib, qtype, x, packed, n, k, force_path=path), batch)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_has_the_same_bits_either_side_of_the_amx_threshold(lib, qtype: str) -> None:
    """Calls of many rows run on AMX tiles, calls of a few on vectors: a row's outputs (bf16,
    with a bias; a NaN row's bits too) are the same at M = 1 and M = 700, whatever the tile,
    work item or segment of K it falls in (K = 1536: two segments of 32-blocks; 700 rows: a
    last tile of 12)."""
    if not quant.path_available(lib, qtype, "amx_int8"):
        pytest.skip("the library has no amx_int8 path here (no AMX-int8, or not granted)")
    n, k, m = 40, 1536, 700
    raw = make_raw(qtype, n, k, seed=30, extreme=True)
    packed = quant.pack(lib, qtype, raw, k)
    x = make_x(m, k, torch.bfloat16, seed=31)
    x[5, 100] = float("nan")
    bias = torch.randn(n)
    assert quant.path(lib, qtype, m) == "amx_int8" and quant.path(lib, qtype, 1) != "amx_int8"
    batch = quant.linear(lib, qtype, x, packed, n, k, bias)
    want = reference.linear(qtype, x, raw, n, k, bias)
    assert batch[5].isnan().all() and want[5].isnan().all()
    keep = torch.arange(m) != 5
    assert torch.equal(batch[keep], want[keep])
    bits = batch.view(torch.int16)
    for r in (0, 5, 15, 16, 255, 256, 699):
        assert torch.equal(
            quant.linear(lib, qtype, x[r : r + 1], packed, n, k, bias).view(torch.int16),
            bits[r : r + 1],
        )
    for rows in (16, 31, 32, 33, 257):
        assert torch.equal(
            quant.linear(lib, qtype, x[:rows], packed, n, k, bias).view(torch.int16), bits[:rows]
        )


@pytest.mark.parametrize("qtype", TYPES)
def test_within_the_activation_quantizations_bound(lib, qtype: str) -> None:
    """|y - x·Wᵀ| (W dequantized, float64) <= Σ_b dx_b / 2 · Σ_{i in b} |W_i| (each x_i is
    dx_b · xq_i within half a step: |x_i · id - xq_i| <= 1/2, and dx_b · id = 1 within a few
    ulps) plus the float32 chain's roundings: at most (steps + 2) · 2^-24 relative to the
    chain's terms, whose sum is at most Σ_b dx_b · 127 · Σ_{i in b} |W_i| · (1 + 2^-20)."""
    n, k, m = 48, 1536, 5
    raw = make_raw(qtype, n, k, seed=6)
    x = make_x(m, k, torch.float32, seed=7)
    w = reference.dequantize(qtype, raw, k).double()
    got = quant.linear(lib, qtype, x, quant.pack(lib, qtype, raw, k), n, k).double()
    exact = x.double() @ w.T
    dx = reference.quantize_activations(x).dx.double()  # [m, k / 32]
    w_abs = w.abs().view(n, k // 32, 32).sum(-1)  # [n, k / 32]
    quant_bound = 0.5 * dx @ w_abs.T * (1 + 2.0**-20)
    steps = 2 * k // 16
    float_bound = (steps + 2) * 2.0**-24 * 127 * (dx @ w_abs.T) * (1 + 2.0**-20)
    err = (got - exact).abs()
    assert bool((err <= quant_bound + float_bound).all()), float(
        (err / (quant_bound + float_bound)).max()
    )
    assert float((err / quant_bound).max()) > 0.01  # the bound is not vacuous


CHILD = """
import json, sys, torch
from radixrt_kernels.cpu import chain, library, quant
lib = library.load(sys.argv[1])
out = {}
for name, (qtype, x, packed_raw, n, k, bias) in torch.load(sys.argv[2]).items():
    packed = quant.pack(lib, qtype, packed_raw, k)
    for path in quant.PATHS:
        if quant.path_available(lib, qtype, path):
            out[f"{name}/{path}"] = quant.linear(lib, qtype, x, packed, n, k, bias, force_path=path)
    steps, y = chain.Chain(lib), torch.empty(x.shape[0], n, dtype=x.dtype)
    steps.quant_linear(qtype, x, packed, n, k, y, bias)
    steps.run(2)
    out[f"{name}/chain"] = y
torch.save(out, sys.argv[3])
"""


@pytest.mark.parametrize("flags", [AVX2_FLAGS, PORTABLE_FLAGS], ids=["avx2", "portable"])
def test_other_builds_give_the_native_bits(lib, flags: str, tmp_path: Path) -> None:
    """The library as built for an AVX2-only CPU and as built with no vector extensions, each
    in a subprocess of its own (a crash fails this test): every path it has equals the
    reference (and so the native paths) bit for bit, and so does a chain's step on its path."""
    cases, want = {}, {}
    for i, qtype in enumerate(TYPES):
        m, n, k = (1, 37, 512) if i % 2 else (70, 20, 256)
        raw, x = (
            make_raw(qtype, n, k, seed=20 + i, extreme=True),
            make_x(m, k, torch.bfloat16, seed=i),
        )
        bias = torch.randn(n) if i % 3 == 0 else None
        cases[qtype] = (qtype, x, raw, n, k, bias)
        want[qtype] = reference.linear(qtype, x, raw, n, k, bias)
    torch.save(cases, tmp_path / "cases.pt")
    env = {
        **os.environ,
        "RADIXRT_KERNEL_CFLAGS": flags,
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path / "cache"),
            str(tmp_path / "cases.pt"),
            str(tmp_path / "out.pt"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    expected_paths = (
        {"portable", "chain"} if "-mno-avx2" in flags else {"portable", "avx2", "chain"}
    )
    assert {key.split("/")[1] for key in got} == expected_paths, json.dumps(sorted(got))
    for key, y in got.items():
        assert torch.equal(y, want[key.split("/")[0]]), key


def test_refusals_name_what_is_wrong(lib) -> None:
    raw = make_raw("Q4_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="unknown quantization type 'Q3_K'"):
        quant.pack(lib, "Q3_K", raw, 64)
    with pytest.raises(ValueError, match="Q4_K: K = 576 is not a multiple of its block of 256"):
        quant.pack(lib, "Q4_K", torch.zeros(4, 576 // 256 * 144, dtype=torch.uint8), 576)
    with pytest.raises(ValueError, match="Q4_0: K = 48 is not a multiple"):
        quant.pack(lib, "Q4_0", raw, 48)
    with pytest.raises(ValueError, match=r"Q4_0: raw must be uint8 \[N, 36\]"):
        quant.pack(lib, "Q4_0", raw[:, :20], 64)
    with pytest.raises(ValueError, match=r"Q4_0: raw must be uint8"):
        quant.pack(lib, "Q4_0", raw.float(), 64)
    packed = quant.pack(lib, "Q4_0", raw, 64)
    with pytest.raises(ValueError, match=r"does not hold \[17, 64\]"):  # (N 1 .. 16: one panel)
        quant.linear(lib, "Q4_0", torch.randn(2, 64), packed, 17, 64)
    with pytest.raises(ValueError, match=r"x must be bf16 or float32 \[..., 64\]"):
        quant.linear(lib, "Q4_0", torch.randn(2, 32), packed, 4, 64)
    with pytest.raises(ValueError, match="x must be bf16 or float32"):
        quant.linear(lib, "Q4_0", torch.randn(2, 64).half(), packed, 4, 64)
    with pytest.raises(ValueError, match=r"the bias must be float32 or bf16 \[4\]"):
        quant.linear(lib, "Q4_0", torch.randn(2, 64), packed, 4, 64, bias=torch.randn(4).half())


def test_a_bf16_bias_adds_as_its_float32_value(lib) -> None:
    raw = make_raw("Q5_1", 40, 64, seed=3)
    packed = quant.pack(lib, "Q5_1", raw, 64)
    x, bias = torch.randn(5, 64).bfloat16(), torch.randn(40).bfloat16()
    y = quant.linear(lib, "Q5_1", x, packed, 40, 64, bias=bias)
    assert torch.equal(y, quant.linear(lib, "Q5_1", x, packed, 40, 64, bias=bias.float()))
    assert not torch.equal(y, quant.linear(lib, "Q5_1", x, packed, 40, 64))


def test_a_stacked_weight_writes_each_segment_s_columns(lib) -> None:
    """Segments of different types into one output: each the bits of its own call."""
    parts = [("Q8_0", 24), ("Q4_1", 40), ("Q6_K", 16)]
    x, k = torch.randn(3, 256).bfloat16(), 256
    segs = [
        quant.Segment(t, quant.pack(lib, t, make_raw(t, n, k, seed=i), k), n)
        for i, (t, n) in enumerate(parts)
    ]
    bias = torch.randn(80)
    y = quant.linear_stacked(lib, x, segs, k, bias)
    alone = [
        quant.linear(lib, s.qtype, x, s.packed, s.n, k, b)
        for s, b in zip(segs, bias.split([24, 40, 16]))
    ]
    assert y.shape == (3, 80) and torch.equal(y, torch.cat(alone, dim=1))


def test_nonfinite_activations_give_nan_rows(lib) -> None:
    raw = make_raw("Q4_K", 16, 256, seed=0)
    packed = quant.pack(lib, "Q4_K", raw, 256)
    x = torch.randn(3, 256)
    x[1, 7], x[2, 200] = float("inf"), float("nan")
    y = quant.linear(lib, "Q4_K", x, packed, 16, 256)
    assert y[1:].isnan().all() and not y[0].isnan().any()
    assert torch.equal(y[0], reference.linear("Q4_K", x[:1], raw, 16, 256)[0])


def test_paths_are_named(lib) -> None:
    assert quant.path(None, "Q4_0", 1) == "reference"
    assert quant.path(lib, "Q4_0", 1) in quant.PATHS
    assert all(quant.supported(lib, t) for t in TYPES) and not quant.supported(None, "Q4_0")
    assert quant.QTYPES["Q4_0"] == 2 and quant.QTYPES["Q6_K"] == 14
    assert np.array_equal(list(quant.QTYPES), TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_looked_up_rows_are_gguf_s_values(lib, qtype: str) -> None:
    """An embedding's rows from the raw blocks equal gguf's dequantization bit for bit (float32,
    and rounded to bf16 once), in the order asked, repeats included; ids outside are refused."""
    raw = make_raw(qtype, 40, 512, seed=11, extreme=True)
    ids = torch.tensor([39, 0, 7, 7, 21])
    want = formats.dequantize(qtype, raw[ids], 512)
    assert torch.equal(
        quant.rows(lib, qtype, raw, ids, 512).view(torch.int32), want.view(torch.int32)
    )
    got = quant.rows(lib, qtype, raw, ids, 512, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.bfloat16().view(torch.int16))
    assert torch.equal(quant.rows(None, qtype, raw, ids, 512, torch.bfloat16), got)
    with pytest.raises(ValueError, match=r"rows \[3, 40\] are not all in 0 .. 39"):
        quant.rows(lib, qtype, raw, torch.tensor([3, 40]), 512)
    packed = quant.pack(lib, qtype, raw, 512)  # a tied LM head's layout: the same values
    got_packed = quant.rows_packed(lib, qtype, packed, 40, 512, ids)
    assert torch.equal(got_packed.view(torch.int32), want.view(torch.int32))
    got_packed = quant.rows_packed(lib, qtype, packed, 40, 512, ids, torch.bfloat16)
    assert torch.equal(got_packed, got)
    with pytest.raises(ValueError, match=r"an id outside \[0, 40\)"):
        quant.rows_packed(lib, qtype, packed, 40, 512, torch.tensor([40]))
