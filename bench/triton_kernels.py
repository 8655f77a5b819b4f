"""Attention kernel benchmark on CUDA: Triton decode/extend against torch SDPA.

One attention layer shaped like Llama-3-8B (32 query heads, 8 KV heads, head
dim 128) in bf16, KV in a paged pool whose slots are a random permutation (so
every request's KV is scattered, as after a while of serving).

- Decode, batch 1..256 × context 512..32k: ``decode_attention`` with
  ``choose_num_kv_splits`` for the device, against SDPA on the same K/V
  gathered beforehand into dense ``[B, KH, L, D]`` (the gather is not timed:
  the baseline is the ideal dense case). Achieved bandwidth = bytes of K and V
  read / median time, next to the device's copy bandwidth (a large
  device-to-device copy, read + write bytes / time).
  Target: >= 80 % of copy bandwidth at batch >= 32 and context >= 4k.
- Extend, prefix 0..8k × suffix 128..4k (batch max(1, 4096 // suffix), so
  small suffixes still fill the device): ``extend_attention`` against SDPA on gathered
  K/V with a bottom-right causal mask. TFLOP/s count the causal work,
  4·H·D·(suffix·prefix + suffix·(suffix+1)/2) per request, next to a measured
  bf16 matmul peak (8192³ ``torch.matmul``).
  Target: >= 40 % of that peak at prefix 4k, suffix 2k.
Times are ``triton.testing.do_bench`` medians. Prints a table and writes
bench/results/kernels.json. Without a CUDA device it says so and exits 0.

    python bench/triton_kernels.py            # all sizes
    python bench/triton_kernels.py --quick    # a few sizes, including both target points
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 2048, 4096, 8192, 16384, 32768)
EXTEND_PREFIXES = (0, 1024, 4096, 8192)
EXTEND_SUFFIXES = (128, 512, 2048, 4096)
QUICK_DECODE = ((1, 4096), (32, 4096), (64, 8192), (256, 32768))
QUICK_EXTEND = ((0, 2048), (4096, 2048), (8192, 512))
DECODE_TARGET, EXTEND_TARGET = 0.80, 0.40
EXTEND_TOKENS = 4096  # new tokens per extend batch (at least one request)


@dataclass
class DecodeRow:
    batch: int
    context: int
    num_kv_splits: int
    triton_us: float
    sdpa_us: float
    triton_gbps: float
    copy_fraction: float
    target: str  # "met" / "MISSED" / "" where no target applies


@dataclass
class ExtendRow:
    batch: int
    prefix: int
    suffix: int
    triton_us: float
    sdpa_us: float
    triton_tflops: float
    sdpa_tflops: float
    peak_fraction: float
    target: str


def bench(fn) -> float:
    """Median time of fn in µs."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def check_same(ours: torch.Tensor, sdpa: torch.Tensor, what: str) -> None:
    """A benchmark of a wrong kernel is worthless: compare once with SDPA (bf16 tolerance)."""
    err = (ours.float() - sdpa.float()).abs().max().item()
    if not err <= 3e-2:
        raise AssertionError(f"{what}: Triton and SDPA outputs differ by {err:.3g}")


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=DTYPE, device=DEVICE)
    b = torch.randn(n, n, dtype=DTYPE, device=DEVICE)
    us = bench(lambda: a @ b)
    return 2 * n**3 / us / 1e6


def paged_pool(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k/v buffers of sum(lens) + 1 slots, kv_indptr, kv_indices (a random permutation)."""
    total = sum(lens)
    k_buf = torch.randn(total + 1, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v_buf = torch.randn_like(k_buf)
    indices = torch.randperm(total, device=DEVICE) + 1
    indptr = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
    return k_buf, v_buf, indptr, indices


def gathered(buf: torch.Tensor, indices: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Dense [batch, KH, length, D] copy of equal-length sequences' K or V."""
    return buf[indices].view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()


def bench_decode(batch: int, context: int, copy_gbps: float, num_sms: int) -> DecodeRow:
    from radixrt_kernels.triton.decode_attention import (
        DecodeWorkspace,
        choose_num_kv_splits,
        decode_attention,
    )

    k_buf, v_buf, indptr, indices = paged_pool([context] * batch)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    o = torch.empty_like(q)
    splits = choose_num_kv_splits(batch, KV_HEADS, context, num_sms)
    ws = DecodeWorkspace.allocate(batch, HEADS, HEAD_DIM, splits, DEVICE)
    scale = HEAD_DIM**-0.5
    triton_us = bench(
        lambda k_buf=k_buf, v_buf=v_buf: decode_attention(
            q, k_buf, v_buf, o, indptr, indices, scale, splits, ws
        )
    )
    k, v = gathered(k_buf, indices, batch, context), gathered(v_buf, indices, batch, context)
    del k_buf, v_buf
    qd = q[:, :, None, :]  # [B, H, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    check_same(o, sdpa()[:, :, 0], f"decode batch {batch} context {context}")
    sdpa_us = bench(sdpa)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k.element_size()
    gbps = kv_bytes / triton_us / 1e3
    applies = batch >= 32 and context >= 4096
    met = "met" if gbps >= DECODE_TARGET * copy_gbps else "MISSED"
    return DecodeRow(
        batch, context, splits, triton_us, sdpa_us, gbps, gbps / copy_gbps, met if applies else ""
    )


def causal_flops(batch: int, prefix: int, suffix: int) -> float:
    return 4.0 * HEADS * HEAD_DIM * batch * (suffix * prefix + suffix * (suffix + 1) / 2)


def bench_extend(prefix: int, suffix: int, peak_tflops: float) -> ExtendRow:
    from torch.nn.attention.bias import causal_lower_right

    from radixrt_kernels.triton.extend_attention import extend_attention

    batch = max(1, EXTEND_TOKENS // suffix)
    k_buf, v_buf, kv_indptr, kv_indices = paged_pool([prefix] * batch)
    t = batch * suffix
    q = torch.randn(t, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k_new, v_new = (
        torch.randn(t, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE) for _ in range(2)
    )
    qo_indptr = torch.arange(0, t + 1, suffix, device=DEVICE)
    o = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    triton_us = bench(
        lambda: extend_attention(
            q, k_new, v_new, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale, suffix
        )
    )
    group = HEADS // KV_HEADS

    def dense(buf, new):  # [B, H, prefix + suffix, D], KV heads repeated for the causal bias path
        cat = torch.cat(
            [
                gathered(buf, kv_indices, batch, prefix),
                new.view(batch, suffix, KV_HEADS, HEAD_DIM).transpose(1, 2),
            ],
            dim=2,
        )
        return cat.repeat_interleave(group, dim=1)

    k, v = dense(k_buf, k_new), dense(v_buf, v_new)
    qd = q.view(batch, suffix, HEADS, HEAD_DIM).transpose(1, 2)
    mask = causal_lower_right(suffix, prefix + suffix)
    sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)  # noqa: E731
    check_same(
        o,
        sdpa().transpose(1, 2).reshape(t, HEADS, HEAD_DIM),
        f"extend prefix {prefix} suffix {suffix}",
    )
    sdpa_us = bench(sdpa)
    flops = causal_flops(batch, prefix, suffix)
    tflops = flops / triton_us / 1e6
    applies = prefix == 4096 and suffix == 2048
    met = "met" if tflops >= EXTEND_TARGET * peak_tflops else "MISSED"
    return ExtendRow(
        batch,
        prefix,
        suffix,
        triton_us,
        sdpa_us,
        tflops,
        flops / sdpa_us / 1e6,
        tflops / peak_tflops,
        met if applies else "",
    )


def print_table(title: str, rows: list) -> None:
    if not rows:
        return
    names = list(asdict(rows[0]))
    cells = [[_fmt(v) for v in asdict(r).values()] for r in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    print(f"\n{title}")
    print("  ".join(n.rjust(w) for n, w in zip(names, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a few sizes, including the target points"
    )
    parser.add_argument(
        "--max-kv-gb", type=float, default=40.0, help="skip decode sizes whose KV exceeds this"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/triton_kernels.py: no CUDA device, nothing to benchmark (needs a GPU).")
        return 0
    props = torch.cuda.get_device_properties(0)
    copy_gbps, peak = copy_bandwidth_gbps(), matmul_tflops()
    print(f"{props.name}: copy bandwidth {copy_gbps:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    decode_sizes = (
        QUICK_DECODE if args.quick else [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    )
    extend_sizes = (
        QUICK_EXTEND if args.quick else [(p, s) for p in EXTEND_PREFIXES for s in EXTEND_SUFFIXES]
    )
    kv_gb = lambda b, c: 2 * b * c * KV_HEADS * HEAD_DIM * 2 / 1e9  # noqa: E731
    decode = []
    for b, c in decode_sizes:
        if kv_gb(b, c) <= args.max_kv_gb:
            decode.append(bench_decode(b, c, copy_gbps, props.multi_processor_count))
            torch.cuda.empty_cache()
    extend = []
    for p, s in extend_sizes:
        extend.append(bench_extend(p, s, peak))
        torch.cuda.empty_cache()
    print_table(
        f"decode (H={HEADS}, KH={KV_HEADS}, D={HEAD_DIM}, bf16; target >= {DECODE_TARGET:.0%} "
        f"of copy bandwidth at batch >= 32, context >= 4k)",
        decode,
    )
    print_table(
        f"extend (target >= {EXTEND_TARGET:.0%} of matmul peak at prefix 4k, suffix 2k)", extend
    )
    import triton

    result = dict(
        device=props.name,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE)),
        copy_gbps=copy_gbps,
        matmul_tflops=peak,
        decode=[asdict(r) for r in decode],
        extend=[asdict(r) for r in extend],
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
