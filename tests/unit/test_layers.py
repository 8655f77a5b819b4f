"""Model layers on the kernels chosen at load: packed CPU weights (bf16: the AMX kernel's layout,
or oneDNN's) and the fused forms give the plain layers' results."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from radixrt.model import linear_methods
from radixrt.model.kernel_set import Kernels, choose_kernels
from radixrt.model.layers import GateUpLinear, Linear, LMHead, prepare_weights
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear

HAS_ONEDNN = linear_methods.onednn_works()
needs_onednn = pytest.mark.skipif(
    not HAS_ONEDNN, reason="this PyTorch build has no oneDNN linear ops"
)
CPU = torch.device("cpu")


def library_with(kernel: str = "amx"):
    """The kernels' library, where it runs ``kernel`` (else the test is skipped)."""
    lib = cpu_library.load(cache_dir())
    if not cpu_linear.kernel_available(lib, kernel):
        why = cpu_library.why_unavailable() or "built"
        pytest.skip(f"the {kernel} linear kernel does not run here (library: {why})")
    return lib


def amx_library():
    return library_with("amx")


def kernels_for(packing: str) -> Kernels:
    """Every linear on ``packing``: a packed kernel (cpu_linear.KERNELS) or oneDNN's layout."""
    if packing in cpu_linear.KERNELS:
        return Kernels(packing, library_with(packing))
    return Kernels(packing)


class Tiny(nn.Module):
    """An MLP ([gate; up] with SiLU-and-mul, down with a bias) and an LM head."""

    def __init__(
        self, dtype: torch.dtype, kernels: Kernels | None = None, hidden: int = 32
    ) -> None:
        super().__init__()
        kernels = kernels or Kernels()
        torch.manual_seed(0)
        self.up = GateUpLinear(hidden, 64, kernels)
        self.down = Linear(64, hidden, bias=True, kernels=kernels)
        self.head = LMHead(100, hidden, kernels)
        for p in self.parameters():
            p.data.normal_(std=0.3)
        self.to(dtype)
        prepare_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.up(x)))


PACKED = list(cpu_linear.KERNELS)  # amx, avx512_bf16, fma: one packed layout
PACKINGS = [pytest.param("onednn", marks=needs_onednn), *PACKED]


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_bf16_model_matches_plain(packing: str, rows: int) -> None:
    plain = Tiny(torch.bfloat16)
    packed = Tiny(torch.bfloat16, kernels_for(packing))
    assert packed.down.method.name == packed.head.method.name == packing
    # SiLU-and-mul in the packed kernels' pass; with oneDNN's layout, PyTorch's after it
    fused = "onednn, then torch" if packing == "onednn" else f"{packing} + silu_mul"
    assert packed.up.method.name == fused
    assert plain.up.method.name == "torch, then torch"
    assert packed.up.weight.is_mkldnn == (packing == "onednn")
    assert packed.head.matmul_weight is not None and not packed.head.weight.is_mkldnn  # kept plain
    x = torch.randn(rows, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = packed(x), plain(x)
    assert got.dtype == want.dtype == torch.float32  # logits
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-1)
    weight = packed.down.weight
    prepare_weights(packed)  # nothing left to lay out
    assert packed.down.weight is weight


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 45, 64, 100, 700])
def test_amx_linear_equals_pytorch(rows: int) -> None:
    # Up to 32 rows (a decode batch) and for large prefills the kernel adds the products in
    # oneDNN's order: bit-equal to F.linear. In between oneDNN picks kernels of other orders, so
    # there: equal up to bf16 rounding, and as close to a float64 product as F.linear.
    lib = amx_library()
    torch.manual_seed(rows)
    n, k = 200, 96  # a short last block of features (200 = 6·32 + 8)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(rows, 3 * k, dtype=torch.bfloat16)[:, k : 2 * k]  # strided rows
    packed = cpu_linear.pack(lib, w)
    exact = (x.double() @ w.double().T + bias.double()).float()
    for b in (None, bias):
        got = cpu_linear.linear(lib, x, packed, n, b)
        want = torch.nn.functional.linear(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        if rows <= 32:
            assert torch.equal(got, want)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0.05)
    got = cpu_linear.linear(lib, x, packed, n, bias, float_out=True)
    assert got.dtype == torch.float32
    assert torch.equal(got, cpu_linear.linear(lib, x, packed, n, bias).float())
    err_ours = (got - exact).abs().mean()
    err_torch = (torch.nn.functional.linear(x, w, bias).float() - exact).abs().mean()
    assert err_ours <= err_torch * 1.05


@pytest.mark.parametrize("k", [576, 1024])  # a pass's x fits in L1 (streamed weight tiles), or not
def test_amx_prefill_gives_each_32_row_slice_the_bits_of_f_linear(k: int) -> None:
    # A prefill's grouped passes (several groups of blocks, a short last slice of rows) add in the
    # order of a decode batch: each 32-row slice gets F.linear's bits for those rows alone, with
    # a bias, widened to float32, and through the gated and rotary epilogues (written a slice of
    # rows at a time during the next unit's products).
    from radixrt.model.layers import RotaryEmbedding
    from radixrt_kernels.cpu import elementwise

    lib = amx_library()
    torch.manual_seed(k)
    n, rows = 1152, 700  # 36 blocks: more than one group of 16
    w = (torch.randn(n, k) * 0.05).bfloat16()
    bias = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    want = torch.cat(
        [torch.nn.functional.linear(x[r : r + 32], w, bias) for r in range(0, rows, 32)]
    )
    packed = cpu_linear.pack(lib, w)
    assert torch.equal(cpu_linear.linear(lib, x, packed, n, bias), want)
    assert torch.equal(cpu_linear.linear(lib, x, packed, n, bias, float_out=True), want.float())
    plain = cpu_linear.linear(lib, x, packed, n)
    gated = cpu_linear.linear(lib, x, cpu_linear.pack(lib, w, gated=True), n, gated=True)
    assert torch.equal(gated, elementwise.silu_mul(lib, plain))
    rotary = RotaryEmbedding(128, 4096, 10000.0)
    positions = torch.randint(0, 4096, (rows,))
    rope = cpu_linear.Rope(positions, rotary.cos, rotary.sin_signed, 128, 512)
    rotated = cpu_linear.linear(lib, x, packed, n, bias, rope=rope)
    elementwise.rope_(
        lib, want[:, :512].view(rows, 4, 128), positions, rotary.cos, rotary.sin_signed
    )
    assert torch.equal(rotated, want)


@pytest.mark.parametrize("kernel", ["avx512_bf16", "fma"])
@pytest.mark.parametrize("rows", [1, 2, 3, 12, 13, 32, 45, 100, 700])
def test_vector_kernels_equal_pytorch_within_bf16_rounding(kernel: str, rows: int) -> None:
    # float32 sums in input-feature order, rounded once: within bf16 rounding of F.linear, and
    # as close to a float64 product. Rows cover register blocks (12; 4 on narrow vectors, whose
    # 1-2 rows take both tiles in one pass) and their remainders, a 32-row pass and the grouped
    # passes of a prefill; 200 features: a short last block.
    lib = library_with(kernel)
    torch.manual_seed(rows)
    n, k = 200, 320  # 10 chunks: more than one segment of the FMA kernel
    w = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(rows, 3 * k, dtype=torch.bfloat16)[:, k : 2 * k]  # strided rows
    packed = cpu_linear.pack(lib, w)
    exact = (x.double() @ w.double().T + bias.double()).float()
    got = cpu_linear.linear(lib, x, packed, n, bias, kernel=kernel)
    want = torch.nn.functional.linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0.1)
    err_ours = (got.float() - exact).abs().mean()
    err_torch = (want.float() - exact).abs().mean()
    assert err_ours <= err_torch * 1.05
    wide = cpu_linear.linear(lib, x, packed, n, bias, float_out=True, kernel=kernel)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())


@pytest.mark.parametrize("rows", [1, 17, 32, 100, 700])
@pytest.mark.parametrize("kernel", PACKED)
def test_gated_linear_is_silu_and_mul_of_the_two_products(rows: int, kernel: str) -> None:
    # [gate; up] packed gated: silu(gate)·up in the same pass, bit-equal to the two steps apart
    # (the linear, then elementwise.silu_mul, which rounds as PyTorch's F.silu(gate) * up does).
    from radixrt_kernels.cpu import elementwise

    lib = library_with(kernel)
    torch.manual_seed(rows)
    w = (torch.randn(192, 96) * 0.2).bfloat16()  # gate and up: 96 rows each (3 blocks of 32)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = cpu_linear.linear(
        lib, x, cpu_linear.pack(lib, w, gated=True), 192, gated=True, kernel=kernel
    )
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    assert torch.equal(
        got,
        elementwise.silu_mul(
            lib, cpu_linear.linear(lib, x, cpu_linear.pack(lib, w), 192, kernel=kernel)
        ),
    )
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(
        got.float(), (torch.nn.functional.silu(gate) * up).float(), rtol=2**-7, atol=1e-2
    )
    with pytest.raises(ValueError, match="gate; up"):
        cpu_linear.pack(lib, w[:160], gated=True)  # halves of 80 rows: not whole blocks


def test_llama_mlp_fuses_silu_into_its_gate_up_linear() -> None:
    kernels = kernels_for("amx")

    def mlp(kernels: Kernels) -> nn.ModuleDict:
        torch.manual_seed(0)
        m = nn.ModuleDict(
            {"gate_up": GateUpLinear(64, 96, kernels), "down": Linear(96, 64, kernels=kernels)}
        )
        for p in m.parameters():
            p.data.normal_(std=0.2)
        m.to(torch.bfloat16)
        prepare_weights(m)
        return m

    fused, plain = mlp(kernels), mlp(Kernels())
    assert fused.gate_up.method.name == "amx + silu_mul"  # (kernels_for("amx"))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert fused.gate_up(x).shape == (5, 96)
        want = plain.down(plain.gate_up(x))
        torch.testing.assert_close(fused.down(fused.gate_up(x)), want, rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("kernel", PACKED)
@pytest.mark.parametrize("head_dim,bias", [(64, False), (64, True), (128, True)])
def test_qkv_linear_rotates_q_and_k_in_its_own_pass(head_dim: int, bias: bool, kernel: str) -> None:
    # RotaryQKVLinear on the AMX kernel: q and k rotated in the linear's own pass, bit-equal to
    # the same kernel's plain output followed by the rotary embedding (elementwise.rope_), eager
    # and under torch.compile.
    from radixrt.model.layers import QKVLinear, RotaryEmbedding, RotaryQKVLinear
    from radixrt_kernels.cpu import elementwise

    kernels = kernels_for(kernel)
    lib = kernels.lib
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)

    def build(cls, *extra):
        torch.manual_seed(head_dim)
        m = cls(96, head_dim, 4, 2, *extra, bias=bias, kernels=kernels)
        for p in m.parameters():  # bf16 weights; the rotary tables stay float32
            p.data = p.data.normal_(std=0.3).bfloat16()
        prepare_weights(m)
        return m

    fused, unrotated = build(RotaryQKVLinear, rotary), build(QKVLinear)
    assert fused.method.name == f"{kernel} + rotary" and unrotated.method.name == kernel

    def flat(x, positions, layer=fused):
        return torch.cat([t.reshape(x.shape[0], -1) for t in layer(x, positions)], dim=1)

    compiled = torch.compile(flat, dynamic=True)
    with torch.inference_mode():
        for rows in (1, 33, 300):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            positions = torch.randint(0, 4096, (rows,))
            want = flat(x, positions, unrotated)
            elementwise.rope_(
                lib,
                want[:, : 6 * head_dim].view(rows, 6, head_dim),
                positions,
                rotary.cos,
                rotary.sin_signed,
            )
            assert torch.equal(flat(x, positions), want)
            assert torch.equal(compiled(x, positions), want)


def test_amx_linear_rejects_what_it_cannot_take() -> None:
    lib = amx_library()
    w = torch.randn(64, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack(lib, torch.randn(64, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack(lib, w.float())
    packed = cpu_linear.pack(lib, w)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear(lib, torch.randn(2, 64, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(ValueError, match="bf16"):
        cpu_linear.linear(lib, torch.randn(2, 96), packed, 64)


def test_amx_packing_needs_packable_weights() -> None:
    # in_features that are not a multiple of 32: no AMX layout for that weight; oneDNN's, where it
    # exists, and the AMX kernel for the others
    model = Tiny(torch.bfloat16, kernels_for("amx"), hidden=40)  # the others: 32 or 64
    fallback = "onednn" if HAS_ONEDNN else "torch"
    assert model.up.method.name == f"{fallback}, then torch" and model.head.method.name == fallback
    assert model.down.method.name == "amx"  # in_features 64
    with torch.inference_mode():
        x = torch.randn(3, 40, dtype=torch.bfloat16)
        torch.testing.assert_close(
            model(x), Tiny(torch.bfloat16, hidden=40)(x), rtol=1e-2, atol=1e-1
        )


@pytest.mark.parametrize("packing", PACKINGS)
def test_packed_layers_compile(packing: str) -> None:
    # Inductor cannot lower the packed layouts: under torch.compile the packed linears and the
    # LM head go through the opaque radixrt::amx_linear / radixrt::onednn_linear ops, the very
    # kernels eager runs: with AMX (SiLU-and-mul inside the op) the same results bit for bit;
    # with oneDNN's layout Inductor fuses the SiLU-and-mul itself, rounding once instead of
    # twice, so there: equal up to that rounding.
    packed = Tiny(torch.bfloat16, kernels_for(packing))
    compiled = torch.compile(packed, dynamic=True)
    exact = packing != "onednn"
    with torch.inference_mode():
        for rows in (3, 17):
            x = torch.randn(rows, 32, dtype=torch.bfloat16)
            torch.testing.assert_close(
                compiled(x), packed(x), rtol=0 if exact else 0.05, atol=0 if exact else 0.5
            )


def test_kernels_chosen_for_dtype_device_and_compile(monkeypatch) -> None:
    from radixrt.model import kernel_set as kernels_module
    from radixrt.model.calibrate import Choice

    lib = cpu_library.load(cache_dir())
    fp32 = choose_kernels(CPU, torch.float32, lib)
    assert fp32.linear_for(64, 32).name == "torch"
    meta = choose_kernels(torch.device("meta"), torch.bfloat16, lib)
    assert meta.describe() == Kernels().describe()
    forced = choose_kernels(CPU, torch.bfloat16, lib, linear="fma")
    assert forced.linear_for(64, 32).name == "fma"
    assert forced.norm.name == ("c" if lib is not None else "torch")
    assert (
        choose_kernels(CPU, torch.bfloat16, lib, compiled=True, linear="fma").norm.name == "torch"
    )
    # auto: each shape's paths from the calibration (here a stand-in), split by rows
    picks = {(64, 32): Choice("fma", "torch_fp32"), (128, 64): Choice("fma", "amx")}
    monkeypatch.setattr(
        kernels_module.Calibrator, "choice", lambda self, n, k, large=True: picks[(n, k)]
    )
    auto = choose_kernels(CPU, torch.bfloat16, lib)
    assert auto.linear_for(64, 32).name == "fma (rows <= 64), torch_fp32"  # two layouts: ByRows
    assert auto.linear_for(128, 64).name == "fma (rows <= 64), amx"  # one packed weight
    assert auto.describe()["linear"] == {
        "64x32": "fma (rows <= 64), torch_fp32",
        "128x64": "fma (rows <= 64), amx",
    }
    compiled = choose_kernels(CPU, torch.bfloat16, lib, compiled=True)
    assert compiled.linear_for(64, 32).name == "fma"  # compiled: one layout per layer
    model = Tiny(torch.float32, fp32)
    assert model.up.method.name == f"torch, then {fp32.act.name}" and not model.up.weight.is_mkldnn


def test_a_path_that_does_not_run_here_is_refused(monkeypatch) -> None:
    lib = cpu_library.load(cache_dir())
    monkeypatch.setattr(cpu_linear, "kernel_available", lambda lib, kernel: kernel == "fma")
    with pytest.raises(ValueError, match="linear_kernel 'amx' does not run on this CPU"):
        choose_kernels(CPU, torch.bfloat16, lib, linear="amx")


def test_bf16_cpu_engine_runs_the_chosen_paths(tiny_llama: str, monkeypatch, tmp_path) -> None:
    from radixrt import Engine
    from radixrt.model import calibrate
    from radixrt.model.calibrate import PATHS

    # Calibrated afresh in tmp_path, timed on small inputs: the test checks that the engine runs
    # the paths its calibration chose, not which path is fastest on this CPU.
    init = calibrate.Calibrator.__init__
    monkeypatch.setattr(
        calibrate.Calibrator,
        "__init__",
        lambda self, lib, cache_dir, *a, **kw: init(self, lib, str(tmp_path), *a, **kw),
    )
    monkeypatch.setattr(calibrate, "COLD_BYTES", 1 << 20)
    monkeypatch.setattr(calibrate, "LARGE_ROWS", 96)
    monkeypatch.setattr(calibrate, "ATTEMPTS", 1)
    with Engine(
        model=tiny_llama, dtype="bfloat16", max_total_tokens=256, linear_kernel="fma"
    ) as eng:
        assert eng.runner.model.model.layers[0].self_attn.o_proj.method.name == "fma"
    with Engine(model=tiny_llama, dtype="bfloat16", max_total_tokens=256) as eng:
        chosen = eng.runner.kernels.describe()["linear"]
        assert len(chosen) == 5  # qkv, o, gate_up, down, lm_head
        for path in chosen.values():
            assert all(p.split(" ")[0] in PATHS for p in path.split(", "))
    kept = [json.loads(f.read_text()) for f in (tmp_path / "calibration").glob("*.json")]
    measured = {key.split(":")[0] for t in kept for key in t if not key.startswith("attention")}
    assert measured == set(chosen)  # each path chosen by this test's calibration
    with Engine(model=tiny_llama, dtype="float32", max_total_tokens=256) as eng:
        assert set(eng.runner.kernels.describe()["linear"].values()) == {"f32"}  # exact
    with Engine(
        model=tiny_llama,
        dtype="float32",
        max_total_tokens=256,
        disable_deterministic_inference=True,
    ) as eng:
        assert set(eng.runner.kernels.describe()["linear"].values()) == {"torch"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_rotate_half_bit_for_bit(dtype) -> None:
    # Hugging Face's form: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1].
    from radixrt.model.layers import RotaryEmbedding

    rope = RotaryEmbedding(64, 256, 10000.0)
    torch.manual_seed(0)
    positions = torch.randint(0, 256, (7,))
    x = torch.randn(7, 12, 64, dtype=dtype)
    cos = rope.cos[positions].unsqueeze(1).to(dtype)
    sin = torch.cat([rope.sin_signed[:, 32:]] * 2, dim=-1)[positions].unsqueeze(1).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos + torch.cat([-x2, x1], dim=-1) * sin
    assert torch.equal(rope(positions, x), want)
    assert torch.equal(rope(positions, x[:, 3:9]), want[:, 3:9])  # a strided view of some heads


@pytest.mark.parametrize(
    "flags", [["-mno-amx-tile"], ["-mno-avx512bf16"], ["-mno-avx512f"], ["-mno-avx"]]
)
def test_builds_for_cpus_without_amx_or_avx512(flags: list[str], monkeypatch, tmp_path) -> None:
    """The library as built on CPUs without AMX, without AVX512-BF16, without AVX-512 (AVX2:
    the FMA kernel on 8 lanes) or without AVX (4 lanes, as on SSE or NEON): AMX is refused, the
    vector kernels that build give the native build's results, with every epilogue."""
    from radixrt_kernels.cpu import library

    native = library.load(cache_dir())
    monkeypatch.setattr(library, "CFLAGS", [*library.CFLAGS, *flags])
    lib = library._build_and_load(tmp_path)
    assert not cpu_linear.available(lib)
    assert cpu_linear.kernel_available(lib, "fma")
    assert cpu_linear.kernel_available(lib, "avx512_bf16") == (
        "-mno-amx-tile" in flags and (cpu_linear.kernel_available(native, "avx512_bf16"))
    )
    torch.manual_seed(5)
    w = torch.randn(192, 128, dtype=torch.bfloat16)
    bias = torch.randn(192, dtype=torch.bfloat16)
    x = torch.randn(37, 128, dtype=torch.bfloat16)
    packed, gated = cpu_linear.pack(lib, w), cpu_linear.pack(lib, w, gated=True)
    with pytest.raises(ValueError, match="does not take"):
        cpu_linear.linear(lib, x, packed, 192)  # amx
    for kernel in ("fma", "avx512_bf16"):
        if not cpu_linear.kernel_available(lib, kernel):
            continue
        for args in ((packed, 192, bias), (gated, 192, None, False, True)):
            got = cpu_linear.linear(lib, x, *args, kernel=kernel)
            want = cpu_linear.linear(native, x, *args, kernel=kernel)
            # (gated: the portable build's exp and reciprocal may move a result by one bf16 step)
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)
        # this build's chain gives this build's separate calls
        from radixrt_kernels.cpu import chain as cpu_chain
        from radixrt_kernels.cpu import elementwise

        chain, normed = cpu_chain.Chain(lib), torch.empty(37, 192, dtype=torch.bfloat16)
        y, act = (
            torch.empty(37, 192, dtype=torch.bfloat16),
            torch.empty(37, 96, dtype=torch.bfloat16),
        )
        chain.linear(kernel, x, packed, 192, y, bias)
        chain.norm(y, bias, 1e-5, normed)
        chain.linear(kernel, x, gated, 192, act, gated=True)
        chain.run()
        want = cpu_linear.linear(lib, x, packed, 192, bias, kernel=kernel)
        assert torch.equal(y, want)
        assert torch.equal(normed, elementwise.rms_norm(lib, want, bias, 1e-5))
        assert torch.equal(act, cpu_linear.linear(lib, x, gated, 192, gated=True, kernel=kernel))
    assert choose_kernels(CPU, torch.bfloat16, lib, linear="fma").linear_for(192, 128).name == "fma"
