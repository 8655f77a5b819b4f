"""quant_linear (radixrt_kernels/triton/quant_matmul.py) against radixrt.quant.arithmetic, bit for
bit: every block type, bf16 and float32 x, with and without bias, both tilings; a row's bits
alone equal its bits in any batch; the activation quantization equals the reference's (round
half to even, zero, tiny and non-finite blocks); what is not taken is refused by name.

The reference runs on CPU copies; on a GPU the kernels run there (``kernel_cases.DEVICE``)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, make_generator

from radixrt.quant import arithmetic as reference
from radixrt.quant.formats import QuantTensor
from radixrt_kernels.triton import INTERPRET
from radixrt_kernels.triton.quant_matmul import TILINGS, quant_linear, quant_matmul, quantize_x
from radixrt_kernels.triton.quant_method import TritonQuantLinear

TYPES = list(reference.BLOCK)
X_DTYPES = [torch.float32, torch.bfloat16]
SPECIAL_F16 = [0.0, -0.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, 1.0]
# (M, N, K): the brief's small shapes; a GPU also runs a model-sized one
SHAPES = [(m, n, k) for m in (1, 17) for n in (16, 40) for k in (256, 512)]  # 17: past a tile
if not INTERPRET:
    SHAPES += [(1, 576, 1536), (70, 1536, 576), (33, 960, 2304)]


def f16_fields(qtype: str) -> list[int]:
    """Byte offsets of a block's fp16 fields (d, and m or dmin)."""
    if qtype == "Q6_K":
        return [208]
    return [0, 2] if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0]


def make_raw(gen: torch.Generator, qtype: str, n: int, k: int, extreme: bool = False):
    """Random GGUF blocks [n, row_bytes] (CPU): random bytes, fp16 scales of about 1e-2
    (``extreme``: a quarter from SPECIAL_F16 and a tenth of the blocks all zeros)."""
    blocks = k // reference.BLOCK[qtype]
    shape = (n, blocks, reference.TYPE_SIZE[qtype])
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    for at in f16_fields(qtype):
        sign = (torch.rand(n, blocks, generator=gen) - 0.3).sign()
        scale = (torch.rand(n, blocks, generator=gen) * 0.02 + 1e-3) * sign
        if extreme:
            pick = torch.randint(0, len(SPECIAL_F16), (n, blocks), generator=gen)
            rare = torch.rand(n, blocks, generator=gen) < 0.25
            scale = torch.where(rare, torch.tensor(SPECIAL_F16)[pick], scale)
        raw[..., at : at + 2] = scale.half().view(torch.uint8).view(n, blocks, 2)
    if extreme:
        raw[torch.rand(n, blocks, generator=gen) < 0.1] = 0
    return raw.view(n, -1)


def make_x(gen: torch.Generator, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """x [m, k] (CPU) with blocks of scales far apart, an all-zero block and a tiny one."""
    scale = torch.rand(m, k // 32, 1, generator=gen).pow(4).repeat_interleave(32, 1).view(m, k)
    x = torch.randn(m, k, generator=gen) * scale
    x[:, 32:64] = 0
    x[:, 64:96] *= 2.0**-126  # amax below 2^-120 (subnormal in float32: a zero block)
    return x.to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit equality, NaN where the reference has NaN (payloads aside)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    zero = torch.zeros((), dtype=got.dtype)
    same = torch.equal(got.where(~nan, zero), want.where(~nan, zero))
    if not same:
        diff = (got.float() - want.float()).abs().where(~nan, 0)
        where = divmod(int(diff.argmax()), got.shape[1])
        pytest.fail(f"max |diff| {diff.max().item():.3g} at {where}: {got[where]} vs {want[where]}")


@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES)
def test_equals_the_reference_bit_for_bit(request, qtype, dtype):
    gen, seed = make_generator(request)
    for i, (m, n, k) in enumerate(SHAPES):
        raw, x = make_raw(gen, qtype, n, k, extreme=i % 2 == 1), make_x(gen, m, k, dtype)
        bias = torch.randn(n, generator=gen) if i % 3 else None
        out_dtype = torch.float32 if i % 4 == 3 else None  # logits: float32 out of bf16 x
        want = reference.linear(qtype, x, raw, n, k, bias, out_dtype)
        args = (x.to(DEVICE), raw.to(DEVICE), n, k, None if bias is None else bias.to(DEVICE))
        for tiling in TILINGS:
            got = quant_linear(qtype, *args[:2], n, k, args[4], out_dtype, tiling=tiling)
            try:
                assert_same(got, want)
            except AssertionError as e:
                raise AssertionError(f"seed {seed}, M N K {m} {n} {k}, {tiling}: {e}") from e


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K"])
def test_float16_x_and_out_equal_the_reference(request, qtype):
    gen, _ = make_generator(request)
    for m, n, k in [(1, 16, 256), (17, 40, 512)]:
        raw, x = make_raw(gen, qtype, n, k), make_x(gen, m, k, torch.float16)
        bias = torch.randn(n, generator=gen)
        for out_dtype in (None, torch.float32):
            want = reference.linear(qtype, x, raw, n, k, bias, out_dtype)
            got = quant_linear(
                qtype, x.to(DEVICE), raw.to(DEVICE), n, k, bias.to(DEVICE), out_dtype
            )
            assert_same(got, want)


def test_segments_of_a_stacked_weight_write_their_columns(request):
    """One quantized x, two weights of different types into column slices of one output."""
    gen, _ = make_generator(request)
    m, k, parts = 5, 256, [("Q4_0", 16), ("Q6_K", 24), ("Q5_K", 16)]
    x = make_x(gen, m, k, torch.bfloat16)
    bias = torch.randn(56, generator=gen)
    raws = [make_raw(gen, t, rows, k) for t, rows in parts]
    act = quantize_x(x.to(DEVICE))
    out, col = torch.empty(m, 56, dtype=torch.bfloat16, device=DEVICE), 0
    wants = []
    for (qtype, rows), raw in zip(parts, raws):
        b = bias[col : col + rows]
        quant_matmul(qtype, act, raw.to(DEVICE), k, b.to(DEVICE), out[:, col : col + rows])
        wants.append(reference.linear(qtype, x, raw, rows, k, b))
        col += rows
    assert_same(out, torch.cat(wants, dim=1))


def test_the_linear_method_equals_the_reference_per_segment(request):
    """TritonQuantLinear over a stacked weight of two types: apply (3-D x, bias) and logits."""
    gen, _ = make_generator(request)
    k, parts = 512, [("Q4_K", 16), ("Q8_0", 24)]
    segments = [QuantTensor(t, make_raw(gen, t, rows, k), k) for t, rows in parts]
    method = TritonQuantLinear(segments, DEVICE)
    w = method.prepare(segments)
    x = make_x(gen, 6, k, torch.bfloat16)
    bias = torch.randn(40, generator=gen).bfloat16()
    got = method.apply(x.view(2, 3, k).to(DEVICE), w, bias.to(DEVICE), 40)
    logits = method.logits(x.to(DEVICE), w, 40)
    for out_dtype, b, out in ((None, bias, got.view(6, 40)), (torch.float32, None, logits)):
        want, row = [], 0
        for s in segments:
            part = None if b is None else b[row : row + s.shape[0]]
            want.append(reference.linear(s.qtype, x, s.raw, s.shape[0], k, part, out_dtype))
            row += s.shape[0]
        assert_same(out, torch.cat(want, dim=1))
    with pytest.raises(ValueError, match="41 outputs asked of a weight of 40 rows"):
        method.apply(x.to(DEVICE), w, None, 41)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q8_0"])
def test_a_row_alone_equals_the_row_in_any_batch(request, qtype):
    gen, _ = make_generator(request)
    n, k = 40, 512
    raw = make_raw(gen, qtype, n, k).to(DEVICE)
    x = make_x(gen, 21, k, torch.bfloat16).to(DEVICE)
    batch = quant_linear(qtype, x, raw, n, k)
    flipped = quant_linear(qtype, x.flip(0), raw, n, k, tiling="decode").flip(0)
    assert torch.equal(batch, flipped)
    for row in (0, 7, 20):
        for tiling in TILINGS:
            alone = quant_linear(qtype, x[row : row + 1], raw, n, k, tiling=tiling)
            assert torch.equal(alone[0], batch[row])


def test_non_finite_activations_make_only_their_row_nan(request):
    gen, _ = make_generator(request)
    n, k = 16, 256
    raw = make_raw(gen, "Q4_K", n, k)
    x = make_x(gen, 4, k, torch.float32)
    x[1, 200], x[2, 5] = float("inf"), float("nan")
    want = reference.linear("Q4_K", x, raw, n, k)
    got = quant_linear("Q4_K", x.to(DEVICE), raw.to(DEVICE), n, k)
    assert_same(got, want)
    assert got[1:3].isnan().all() and not got[[0, 3]].isnan().any()


@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
def test_activation_quantization_equals_the_reference(request, dtype):
    gen, _ = make_generator(request)
    x = make_x(gen, 5, 512, dtype)
    halves = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5] * 4)  # ties: to even
    x[0, 128:160] = halves.to(dtype)
    x[1, 160:192] = -halves.to(dtype)
    x[2, 0:32] = torch.full((32,), 2.0**-121).to(dtype)  # amax below 2^-120: all zeros
    x[3, 256] = float("inf")
    x[4, 300] = float("nan")
    want = reference.quantize_activations(x)
    xq, dx, sx = quantize_x(x.to(DEVICE))
    assert torch.equal(xq.cpu().short(), want.xq)
    assert torch.equal(dx.cpu().isnan(), want.dx.isnan())
    assert torch.equal(dx.cpu().nan_to_num(), want.dx.nan_to_num())
    assert torch.equal(sx.cpu(), want.sx16.view(5, -1, 2).sum(-1))
    assert xq[0, 129:135].tolist() == [2, 4, -2, -4, 0, 0]


def test_an_empty_batch_gives_an_empty_result():
    raw = torch.zeros(16, 8 * 18, dtype=torch.uint8, device=DEVICE)
    out = quant_linear("Q4_0", torch.empty(0, 256, device=DEVICE), raw, 16, 256)
    assert out.shape == (0, 16) and out.dtype == torch.float32


def _refusals() -> dict[str, tuple[dict, str]]:
    """what → (quant_linear arguments, a phrase the ValueError must hold). Built in the test:
    collection must not depend on the device."""
    raw = torch.zeros(16, 8 * 18, dtype=torch.uint8, device=DEVICE)
    x = torch.zeros(2, 256, device=DEVICE)
    ok = dict(qtype="Q4_0", x=x, raw=raw, n=16, k=256)
    return {
        "unknown type": (ok | dict(qtype="Q2_K"), "Q2_K"),
        "K not whole blocks": (ok | dict(qtype="Q4_K", k=96), "multiple of its block of 256"),
        "raw of the wrong width": (ok | dict(raw=raw[:, :100]), "raw must be uint8 [N, 144]"),
        "raw not uint8": (ok | dict(raw=raw.to(torch.int16)), "raw must be uint8"),
        "raw of other rows": (ok | dict(n=17), "for 17 outputs"),
        "x of another K": (ok | dict(x=torch.zeros(2, 288, device=DEVICE)), "x must be [M, 256]"),
        "x 3-D": (ok | dict(x=torch.zeros(1, 2, 256, device=DEVICE)), "x must be [M, 256]"),
        "x float64": (ok | dict(x=x.double()), "x has dtype torch.float64"),
        "x strided": (ok | dict(x=torch.zeros(256, 2, device=DEVICE).t()), "contiguous last dim"),
        "float64 out": (ok | dict(out_dtype=torch.float64), "out_dtype torch.float64"),
        "bias of N + 1": (ok | dict(bias=torch.zeros(17, device=DEVICE)), "bias must be"),
        "unknown tiling": (ok | dict(tiling="huge"), "unknown tiling 'huge'"),
    }


REFUSALS = [
    "unknown type",
    "K not whole blocks",
    "raw of the wrong width",
    "raw not uint8",
    "raw of other rows",
    "x of another K",
    "x 3-D",
    "x float64",
    "x strided",
    "float64 out",
    "bias of N + 1",
    "unknown tiling",
]


def test_quant_matmul_refuses_mismatched_act_and_out():
    raw = torch.zeros(16, 8 * 18, dtype=torch.uint8, device=DEVICE)
    act = quantize_x(torch.zeros(2, 256, device=DEVICE))
    with pytest.raises(ValueError, match=r"act must be quantize_x's of an x \[3, 256\]"):
        quant_matmul("Q4_0", act, raw, 256, None, torch.empty(3, 16, device=DEVICE))
    wide = torch.empty(16, 2, device=DEVICE).t()
    with pytest.raises(ValueError, match="out must be .* contiguous last dim"):
        quant_matmul("Q4_0", act, raw, 256, None, wide)


@pytest.mark.parametrize("what", REFUSALS)
def test_what_is_not_taken_is_refused_by_name(what):
    cases = _refusals()
    assert sorted(cases) == sorted(REFUSALS)
    kwargs, phrase = cases[what]
    with pytest.raises(ValueError) as info:
        quant_linear(**kwargs)
    assert phrase in str(info.value), str(info.value)
