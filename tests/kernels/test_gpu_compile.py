"""The kernels compile for an H100/H200 (sm_90) with their default GPU configs, no GPU needed.

Triton compiles ahead of time from source plus a signature (its bundled ptxas
makes the cubin), so a CPU machine can check what the interpreter cannot:
that the code lowers for a real target, that each config fits in 227 KB of
shared memory, and (``ptxas -v``) that fp16/bf16 kernels do not spill
registers; and that the quantized linears' kernels hold no FMA (their float
steps round one at a time), divide correctly rounded and sum on int8 MMAs.
Pointer and stride arguments are marked 16-divisible as the launcher marks
them, which decides vectorisation. Runs with
TRITON_INTERPRET=0 (see ``KERNEL_ENV``): interpreted functions cannot compile.
"""

from __future__ import annotations

import re
import subprocess
import tempfile

import pytest
import torch

KERNEL_ENV = {"TRITON_INTERPRET": "0"}

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
except ImportError as e:  # another Triton layout: nothing to check against
    pytest.skip(
        f"Triton's ahead-of-time compiler API is not available: {e}", allow_module_level=True
    )

# Below the Triton checks on purpose: the kernel modules import triton (hence noqa: E402).
import radixrt_kernels.triton.decode_attention as decode  # noqa: E402
import radixrt_kernels.triton.deterministic_attention as fixed  # noqa: E402
import radixrt_kernels.triton.extend_attention as extend  # noqa: E402
import radixrt_kernels.triton.fused_moe as moe  # noqa: E402
import radixrt_kernels.triton.quant_matmul as quant  # noqa: E402
import radixrt_kernels.triton.store_kv as store  # noqa: E402

SM90 = 90
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
MAX_SHARED_BYTES = 227 * 1024
TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# (dtype, head_dim, query heads per KV head) of the decode kernels
DECODE_SHAPES = [
    (torch.bfloat16, 64, 4),
    (torch.bfloat16, 128, 1),
    (torch.bfloat16, 128, 8),
    (torch.bfloat16, 256, 4),
    (torch.float32, 128, 4),
]


def _split_pointers(t: str) -> dict[str, str]:
    """Pointer types of a kernel writing one decode split per program (both families)."""
    pointers = {"Q": t, "K_buf": t, "V_buf": t, "Kv_indptr": "i64", "Kv_indices": "i64"}
    return pointers | {"Partial_o": "fp32", "Partial_lse": "fp32"}


def _compile(fn, pointers: dict[str, str], meta: dict[str, object]) -> tuple[int, int]:
    """Compile ``fn`` for sm_90 → (shared memory bytes, register spill-store bytes)."""
    kernel = _build(fn, pointers, meta)
    return kernel.metadata.shared, _spill_bytes(kernel.asm["ptx"])


def _build(fn, pointers: dict[str, str], meta: dict[str, object]):
    """``fn`` compiled for sm_90 (Triton's compiled kernel: ``.asm``, ``.metadata``)."""
    constexprs = {k: v for k, v in meta.items() if k not in LAUNCH_OPTIONS}
    options = {k: meta[k] for k in LAUNCH_OPTIONS if k in meta}
    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name in pointers:
            signature[p.name] = "*" + pointers[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in ("qk_scale", "cap_in", "cap_out"):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32"
            if p.name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", SM90, 32), options=options)


def _window(windowed: bool) -> tuple[int | None, float | None]:
    """A layer's (window, softcap): both (a sliding window and a soft cap), or neither."""
    return (4096, 50.0) if windowed else (None, None)


def _spill_bytes(ptx: str) -> int:
    try:
        ptxas = get_ptxas(SM90).path
    except Exception as e:  # noqa: BLE001 - any failure to find ptxas means: cannot check spills
        pytest.skip(f"no ptxas: {e}")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{SM90}a", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


@pytest.mark.parametrize(
    "dtype,head_dim",
    [
        (torch.bfloat16, 64),
        (torch.bfloat16, 128),
        (torch.bfloat16, 256),
        (torch.float16, 128),
        (torch.float32, 128),
    ],
    ids=str,
)
@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "windowed"])
def test_extend_compiles_for_sm90(dtype, head_dim, windowed):
    t = TYPE[dtype]
    pointers = {n: t for n in ("Q", "K_new", "V_new", "O", "K_buf", "V_buf")}
    pointers |= {n: "i64" for n in ("Qo_indptr", "Kv_indptr", "Kv_indices")}
    meta = extend.launch_meta(dtype, 32, 8, head_dim, None, *_window(windowed))
    shared, spills = _compile(extend._extend_kernel, pointers, meta)
    assert shared <= MAX_SHARED_BYTES
    if dtype != torch.float32:  # fp32 (three-pass TF32 dots) is a correctness path: spills allowed
        assert spills == 0


@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "windowed"])
@pytest.mark.parametrize("dtype,head_dim,group", DECODE_SHAPES, ids=str)
def test_decode_compiles_for_sm90(dtype, head_dim, group, windowed):
    t = TYPE[dtype]
    meta = decode.launch_meta(dtype, 8 * group, 8, head_dim, None, *_window(windowed))
    shared, spills = _compile(decode._decode_stage1, _split_pointers(t), meta)
    assert shared <= MAX_SHARED_BYTES
    assert spills == 0
    merge_meta = dict(NUM_SPLITS=8, HEAD_DIM=head_dim, BLOCK_S=8, BLOCK_D=head_dim, num_warps=4)
    _, spills = _compile(
        decode._decode_stage2, {"Partial_o": "fp32", "Partial_lse": "fp32", "O": t}, merge_meta
    )
    assert spills == 0


@pytest.mark.parametrize(
    "dtype,head_dim,group",
    DECODE_SHAPES + [(torch.bfloat16, 256, 32), (torch.float16, 128, 32), (torch.float32, 256, 8)],
    ids=str,
)
@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "windowed"])
def test_deterministic_kernels_compile_for_sm90(dtype, head_dim, group, windowed):
    """Decode's two stages and extend, with the one launch meta they share."""
    t = TYPE[dtype]
    meta = fixed.launch_meta(dtype, 8 * group, 8, head_dim, None, *_window(windowed))
    assert meta["enable_fp_fusion"] is False
    merge = {"Partial_o": "fp32", "Partial_lse": "fp32", "Kv_indptr": "i64", "O": t}
    extend_ptrs = {n: t for n in ("Q", "O", "K_buf", "V_buf")}
    extend_ptrs |= {n: "i64" for n in ("Qo_indptr", "Kv_indptr", "Kv_indices")}
    for kernel, pointers, kernel_meta in (
        (fixed._decode_split_kernel, _split_pointers(t), meta),
        (fixed._decode_merge_kernel, merge, fixed.merge_meta(meta)),
        (fixed._extend_kernel, extend_ptrs, meta),
    ):
        shared, spills = _compile(kernel, pointers, kernel_meta)
        assert shared <= MAX_SHARED_BYTES
        assert spills == 0, f"{kernel.__name__} spills {spills} bytes"


def test_store_kv_compiles_for_sm90():
    pointers = {"K": "bf16", "V": "bf16", "K_buf": "bf16", "V_buf": "bf16", "Slots": "i64"}
    _, spills = _compile(store._store_kv_kernel, pointers, store.launch_meta(8, 128))
    assert spills == 0


@pytest.mark.parametrize("tiling", sorted(quant.TILINGS))
@pytest.mark.parametrize("qtype", sorted(quant.TYPE_CODE))
def test_quant_matmul_compiles_for_sm90(qtype, tiling):
    """Each block type's matmul at each tiling (bias, bf16 out: the widest epilogue)."""
    pointers = {"XQ": "i8", "DX": "fp32", "SX": "i32", "W": "u8", "Bias": "fp32", "Out": "i16"}
    meta = quant.kernel_meta(qtype, True, torch.bfloat16, quant.TILINGS[tiling])
    assert meta["enable_fp_fusion"] is False
    kernel = _build(quant._quant_matmul_kernel, pointers, meta)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= MAX_SHARED_BYTES
    assert _spill_bytes(ptx) == 0
    assert "fma.rn.f32" not in ptx  # the float chain's mul and add round one at a time
    assert re.search(r"\bw?mma\S*s8\.s8", ptx), "the integer sums are not int8 MMAs"


@pytest.mark.parametrize("bf16", [True, False])
def test_quantize_x_compiles_for_sm90(bf16):
    pointers = {"X": "i16" if bf16 else "fp32", "XQ": "i8", "DX": "fp32", "SX": "i32"}
    meta = dict(X_BF16=bf16, BLOCKS=quant.X_BLOCKS_PER_PROGRAM, enable_fp_fusion=False)
    ptx = _build(quant._quantize_x_kernel, pointers, meta).asm["ptx"]
    assert _spill_bytes(ptx) == 0
    assert "fma.rn.f32" not in ptx and "div.full" not in ptx  # correctly rounded divisions
    assert "div.rn.f32" in ptx


@pytest.mark.parametrize(
    "dtype,weights",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # mixtral's float32 routing weights: float32 products
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
    ids=str,
)
def test_fused_moe_compiles_for_sm90(dtype, weights):
    """The gate-up, down and combine kernels of the fused MoE at the default tiling."""
    t, p = TYPE[dtype], TYPE[torch.promote_types(dtype, weights)]
    meta = moe.launch_meta(dtype, moe.default_tiling(dtype))
    index = {"Pairs": "i32", "BlockExpert": "i32"}
    gate_up = {"X": t, "W": t, "Hbuf": t} | index
    down = {"Hbuf": t, "W": t, "Weights": TYPE[weights], "P": p} | index
    combine = {"P": p, "Out": t}
    for kernel, pointers, kernel_meta in (
        (moe._gate_up_kernel, gate_up, meta | {"TOP_K": 8}),
        (moe._down_kernel, down, meta | {"P_BF16": p == "bf16"}),
        (moe._combine_kernel, combine, moe.combine_meta(dtype, 8)),
    ):
        shared, spills = _compile(kernel, pointers, kernel_meta)
        assert shared <= MAX_SHARED_BYTES
        if dtype != torch.float32:  # fp32 (FMA dots) is a correctness path: spills allowed
            assert spills == 0, f"{kernel.__name__} spills {spills} bytes"
