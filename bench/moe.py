"""The mixture-of-experts block on the CPU (radixrt/model/moe.py) against two dense baselines.

Per token count T, the time of one forward of:

- ``moe``: ``SparseMoeBlock`` (router, top-k, the experts: on packed bf16 weights one C call
  for all of them, else each chosen expert once over its tokens; the weighted sum in rank
  order); of its routing alone (``route``); of the block with its experts called one by one
  (``grouped``: ``ExpertList.grouped``, what the one call replaces);
- ``dense_active``: a dense SiLU-gated MLP of width k·I, the same parameters per token as the
  block's k experts (the dense model of the same active size);
- ``all_experts``: every expert over all T tokens, summed with the routing weights (zero for an
  expert not chosen): what the block computes without the sparsity.

All on the kernels a model of ``--dtype`` gets (``choose_kernels``; ``--exact``, the CPU's
default, or not), weights random, tokens random. Each contender runs as ``--layers`` layers of
their own weights, one pass over all of them per call, so that a layer's weights come from
memory, not from a cache that still holds them from the last call (as in a model's forward);
times are per layer, the fastest pass of ``--repeats`` after a warm-up. The block's ratio to
``dense_active`` is what the sparsity costs on top of the active weights: at T = 1 both stream
the same bytes; at larger T the tokens' experts differ and the block streams up to min(E, T·k)
experts' weights. Prints a table and writes bench/results/moe.json:

    RADIXRT_CACHE_DIR=... python bench/moe.py [--hidden 1024 --inter 512 --experts 64 --top-k 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from radixrt.model.kernel_set import Kernels, choose_kernels
from radixrt.model.layers import prepare_weights
from radixrt.model.moe import ExpertMLP, MoeSpec, SparseMoeBlock
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import library

RESULTS = Path(__file__).parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def randomized(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """``module`` in ``dtype`` with random weights of unit-sized outputs, prepared."""
    gen = torch.Generator().manual_seed(seed)
    module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    prepare_weights(module)
    return module


def all_experts(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, weighted by the routing (zero where not chosen)."""
    routing = block.route(x)
    weights = torch.zeros(x.shape[0], block.spec.num_experts, dtype=routing.weights.dtype)
    weights.scatter_(1, routing.experts, routing.weights)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e, expert in enumerate(block.experts):
        out += expert(x) * weights[:, e : e + 1]
    return out.to(x.dtype)


def per_layer(fn, layers: list, x: torch.Tensor, repeats: int) -> float:
    """Seconds of ``fn(layer, x)`` per layer, over a pass of all ``layers``."""

    def run() -> None:
        for layer in layers:
            fn(layer, x)

    return fastest(run, repeats) / len(layers)


def grouped(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block with its experts called one by one, the weighted sum in PyTorch."""
    return block.experts.grouped(x, *block.route(x))


def row(blocks: list, denses: list, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Seconds per layer of each contender on tokens x."""
    with torch.inference_mode():
        return {
            "moe": per_layer(SparseMoeBlock.forward, blocks, x, repeats),
            "route": per_layer(SparseMoeBlock.route, blocks, x, repeats),
            "grouped": per_layer(grouped, blocks, x, repeats),
            "dense_active": per_layer(ExpertMLP.forward, denses, x, repeats),
            "all_experts": per_layer(all_experts, blocks, x, max(1, repeats // 4)),
        }


def kernels_for(dtype: torch.dtype, exact: bool) -> Kernels:
    lib = library.load(cache_dir())
    if lib is None:
        raise SystemExit(f"no kernels' library: {library.why_unavailable()}")
    return choose_kernels(torch.device("cpu"), dtype, lib, cache_dir=cache_dir(), exact=exact)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512, help="one expert's width")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 16, 64, 256])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", default=str(RESULTS / "moe.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    kernels = kernels_for(dtype, args.exact)
    spec = MoeSpec(args.hidden, args.experts, args.top_k, args.inter, norm_topk_prob=True)
    blocks = [randomized(SparseMoeBlock(spec, kernels), dtype, i) for i in range(args.layers)]
    width = args.top_k * args.inter
    denses = [
        randomized(ExpertMLP(args.hidden, width, kernels), dtype, -1 - i)
        for i in range(args.layers)
    ]
    print(
        f"H {args.hidden}, E {args.experts} x I {args.inter}, top-{args.top_k}, {args.dtype}, "
        f"exact {args.exact}, {args.layers} layers, threads {torch.get_num_threads()}; ms per layer"
    )
    print(
        "    T   moe ms  route ms  grouped ms  dense_active ms  all_experts ms  moe/dense  moe/all"
    )
    rows = []
    for t in args.tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t)).to(dtype)
        r = row(blocks, denses, x, args.repeats)
        speed = {
            "vs_dense_active": r["dense_active"] / r["moe"],
            "vs_all": r["all_experts"] / r["moe"],
        }
        rows.append({"tokens": t, **{f"{k}_s": v for k, v in r.items()}, **speed})
        ms = [r[k] * 1e3 for k in ("moe", "route", "grouped", "dense_active", "all_experts")]
        print(
            f"{t:5} {ms[0]:8.3f} {ms[1]:9.3f} {ms[2]:11.3f} {ms[3]:16.3f} {ms[4]:15.3f} "
            f"{speed['vs_dense_active']:10.2f} {speed['vs_all']:8.2f}",
            flush=True,
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "cpu": platform.processor() or platform.machine(),
                "load": os.getloadavg(),
                "args": vars(args),
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
