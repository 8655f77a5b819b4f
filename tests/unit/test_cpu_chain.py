"""The chain (``radixrt_kernels.cpu.chain``): norms, packed and quantized linears, rotary
embeddings and SiLU-and-mul in one C call give the separate calls' results bit for bit."""

from __future__ import annotations

import pytest
import torch

from radixrt.model import rope
from radixrt.model.weights import cache_dir
from radixrt.quant import arithmetic, rtn
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import elementwise
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear
from radixrt_kernels.cpu import quant as cpu_quant

HIDDEN, HEAD, HEADS, KV_HEADS, INTER = 160, 64, 3, 1, 192


def library_with(kernel: str):
    lib = cpu_library.load(cache_dir())
    if not cpu_linear.kernel_available(lib, kernel):
        pytest.skip(f"the {kernel} linear kernel does not run here")
    return lib


def layer_weights(lib, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.08):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    qkv_out = (HEADS + 2 * KV_HEADS) * HEAD
    cos, sin = rope.cos_sin_tables(HEAD, 4096, 10000.0, None)
    return {
        "norm1": 1 + w(HIDDEN, scale=0.1),
        "norm2": 1 + w(HIDDEN, scale=0.1),
        "qkv": cpu_linear.pack(lib, w(qkv_out, HIDDEN)),
        "qkv_bias": w(qkv_out),
        "o": cpu_linear.pack(lib, w(HIDDEN, HEADS * HEAD)),
        "gate_up": cpu_linear.pack(lib, w(2 * INTER, HIDDEN), gated=True),
        "down": cpu_linear.pack(lib, w(HIDDEN, INTER)),
        "cos": cos,
        "sin": sin,
        "qkv_out": qkv_out,
    }


def separate(lib, kernel, p, h, residual, positions, attn_out):
    """A layer's steps as separate calls: (qkv, the layer's output, the residual after it)."""
    residual = residual.clone()
    x = elementwise.rms_norm(lib, h, p["norm1"], 1e-5, residual)
    r = cpu_linear.Rope(positions, p["cos"], p["sin"], HEAD, (HEADS + KV_HEADS) * HEAD)
    qkv = cpu_linear.linear(lib, x, p["qkv"], p["qkv_out"], p["qkv_bias"], rope=r, kernel=kernel)
    o = cpu_linear.linear(lib, attn_out, p["o"], HIDDEN, kernel=kernel)
    x = elementwise.rms_norm(lib, o, p["norm2"], 1e-5, residual)
    act = cpu_linear.linear(lib, x, p["gate_up"], 2 * INTER, gated=True, kernel=kernel)
    return qkv, cpu_linear.linear(lib, act, p["down"], HIDDEN, kernel=kernel), residual


@pytest.mark.parametrize("kernel", cpu_chain.KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 13, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_chain_gives_the_separate_calls_results(kernel: str, rows: int, threads: int) -> None:
    lib = library_with(kernel)
    p = layer_weights(lib, rows)
    gen = torch.Generator().manual_seed(rows + 100)
    h = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    residual = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    attn_out = torch.randn(rows, HEADS * HEAD, generator=gen).bfloat16()
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    want_qkv, want_h, want_res = separate(lib, kernel, p, h, residual, positions, attn_out)

    # the chain's own buffers (a strided x for the first norm, as a view of a wider tensor)
    h_buf = torch.zeros(rows, HIDDEN + 32, dtype=torch.bfloat16)[:, :HIDDEN]
    h_buf.copy_(h)
    res_buf, x_buf = residual.clone(), torch.empty(rows, HIDDEN, dtype=torch.bfloat16)
    qkv_buf = torch.empty(rows, p["qkv_out"], dtype=torch.bfloat16)
    o_buf, out = torch.empty(rows, HIDDEN, dtype=torch.bfloat16), torch.empty_like(h)
    act = torch.empty(rows, INTER, dtype=torch.bfloat16)
    pos_buf = torch.zeros(64, dtype=torch.int64)
    pos_buf[:rows] = positions
    r = cpu_linear.Rope(pos_buf, p["cos"], p["sin"], HEAD, (HEADS + KV_HEADS) * HEAD)
    chain = cpu_chain.Chain(lib)
    chain.norm(h_buf, p["norm1"], 1e-5, x_buf, res_buf)
    chain.linear(kernel, x_buf, p["qkv"], p["qkv_out"], qkv_buf, p["qkv_bias"], rope=r)
    chain.linear(kernel, attn_out, p["o"], HIDDEN, o_buf)
    chain.norm(o_buf, p["norm2"], 1e-5, x_buf, res_buf)
    chain.linear(kernel, x_buf, p["gate_up"], 2 * INTER, act, gated=True)
    chain.linear(kernel, act, p["down"], HIDDEN, out)
    chain.run(threads)
    assert torch.equal(qkv_buf, want_qkv)
    assert torch.equal(out, want_h)
    assert torch.equal(res_buf, want_res)
    # run again on new inputs written into the same buffers
    h_buf.copy_(want_h)
    res_buf.copy_(residual)
    chain.run(threads)
    again_qkv, again_h, _ = separate(lib, kernel, p, want_h, residual, positions, attn_out)
    assert torch.equal(qkv_buf, again_qkv) and torch.equal(out, again_h)


def test_a_chain_refuses_steps_it_cannot_run() -> None:
    lib = library_with("fma")
    chain = cpu_chain.Chain(lib)
    w = cpu_linear.pack(lib, torch.randn(64, 96).bfloat16())
    x, y = torch.randn(2, 96).bfloat16(), torch.empty(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown linear kernel 'amx'"):
        chain.linear("amx", x, w, 64, y)
    with pytest.raises(ValueError, match=r"bf16 tensor \[\*, 64\]"):
        chain.linear("fma", x, w, 64, y.float())
    with pytest.raises(ValueError, match="does not hold"):
        chain.linear("fma", x, w, 32, y[:, :32])
    with pytest.raises(ValueError, match="contiguous bf16"):
        chain.norm(x, torch.ones(95, dtype=torch.bfloat16), 1e-5, torch.empty_like(x))
    # what only the C side knows: a rotary head of 96 (not a multiple of 64)
    cos, sin = rope.cos_sin_tables(96, 8, 10000.0, None)
    bad = cpu_linear.Rope(torch.zeros(2, dtype=torch.int64), cos, sin, 96, 96)
    chain.linear(
        "fma",
        x,
        cpu_linear.pack(lib, torch.randn(192, 96).bfloat16()),
        192,
        torch.empty(2, 192, dtype=torch.bfloat16),
        rope=bad,
    )
    with pytest.raises(ValueError, match="step 0 does not fit"):
        chain.run()


@pytest.mark.parametrize("kernel", cpu_chain.KERNELS)
@pytest.mark.parametrize("split", [False, True])
def test_an_attention_step_reads_what_the_linear_before_it_wrote(kernel: str, split: bool) -> None:
    """qkv linear → attention (storing the new K/V, over a shared prefix and private tails, or
    a lone request's keys in two halves: two parts merged) → o linear, as one chain, give the
    separate calls' outputs and KV buffers."""
    from radixrt_kernels.cpu import attention as cpu_attention

    lib = library_with(kernel)
    p = layer_weights(lib, 7)
    gen = torch.Generator().manual_seed(11)
    rows = 1 if split else 3
    lens = [300] if split else [40, 45, 33]
    slots_total = 2048
    table = torch.zeros(rows, 512, dtype=torch.int64)
    for i, n in enumerate(lens):  # requests 0 and 1 share 20 slots (a group)
        table[i, :n] = torch.randperm(slots_total - 1, generator=gen)[:n] + 1
    if not split:
        table[1, :20] = table[0, :20]
    seg = cpu_attention.decode_segments(
        lib, table, torch.arange(rows), lens, 16, 2, 256 if split else 0
    )
    assert seg.two_parts
    new_slots = torch.tensor([int(table[i, n - 1]) for i, n in enumerate(lens)])
    x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    k_buf = torch.randn(slots_total, KV_HEADS, HEAD, generator=gen).bfloat16()
    v_buf = torch.randn(slots_total, KV_HEADS, HEAD, generator=gen).bfloat16()
    cols = HEADS * HEAD

    def views(qkv):
        return (
            qkv[:, :cols].view(rows, HEADS, HEAD),
            qkv[:, cols : cols + KV_HEADS * HEAD].view(rows, KV_HEADS, HEAD),
            qkv[:, cols + KV_HEADS * HEAD :].view(rows, KV_HEADS, HEAD),
        )

    # separate calls
    kb, vb = k_buf.clone(), v_buf.clone()
    qkv = cpu_linear.linear(lib, x, p["qkv"], p["qkv_out"], p["qkv_bias"], kernel=kernel)
    q, k, v = views(qkv)
    o = cpu_attention.attention(lib, q, kb, vb, seg, 0.125, (k, v, new_slots), bf16_dots=True)
    want = cpu_linear.linear(lib, o.view(rows, cols), p["o"], HIDDEN, kernel=kernel)
    # one chain
    qkv_buf = torch.empty(rows, p["qkv_out"], dtype=torch.bfloat16)
    o_buf, out = torch.empty(rows, cols, dtype=torch.bfloat16), torch.empty_like(x)
    q, k, v = views(qkv_buf)
    args = torch.zeros(lib.radixrt_chain_attention_fields(), dtype=torch.int64)
    chain = cpu_chain.Chain(lib)
    chain.linear(kernel, x, p["qkv"], p["qkv_out"], qkv_buf, p["qkv_bias"])
    chain.attention(args, k_buf, v_buf)
    chain.linear(kernel, o_buf, p["o"], HIDDEN, out)
    call = cpu_attention.AttentionCall(
        lib, q, k_buf, seg, 0.125, (k, v, new_slots), True, o_buf.view(rows, HEADS, HEAD)
    )
    args.copy_(torch.tensor(call.fields))
    chain.run()
    assert torch.equal(o_buf, o.view(rows, cols))
    assert torch.equal(out, want)
    assert torch.equal(k_buf, kb) and torch.equal(v_buf, vb)
    args[9] = 48  # head_dim 48: not a multiple of 32, refused before anything runs
    with pytest.raises(ValueError, match="step 1 does not fit"):
        chain.run()


# ---- quantized linears and SiLU-and-mul ---------------------------------------------------------

Q_HIDDEN, Q_INTER = 256, 512


def quant_weights(lib, types: tuple[str, str, str], seed: int) -> dict:
    """A layer's GGUF weights: qkv stacked from segments of types[0] and types[1] (q | k, v), the
    others of types[2]; each a list of ``quant.Segment``."""
    gen = torch.Generator().manual_seed(seed)

    def seg(qtype: str, n: int, k: int) -> cpu_quant.Segment:
        """Random blocks: random bytes, the fp16 fields (d, m or dmin) scales near 1e-2."""
        blocks, size = k // arithmetic.BLOCK[qtype], arithmetic.TYPE_SIZE[qtype]
        raw = torch.randint(0, 256, (n, blocks, size), generator=gen, dtype=torch.uint8)
        fields = (
            [208]
            if qtype == "Q6_K"
            else [0, 2]
            if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
            else [0]
        )
        for at in fields:
            scale = (torch.rand(n, blocks, generator=gen) - 0.5) * 0.02
            raw[..., at : at + 2] = scale.half().view(torch.uint8).view(n, blocks, 2)
        return cpu_quant.Segment(qtype, cpu_quant.pack(lib, qtype, raw.view(n, -1), k), n)

    q_out, kv_out = HEADS * HEAD, 2 * KV_HEADS * HEAD
    cos, sin = rope.cos_sin_tables(HEAD, 4096, 10000.0, None)
    return {
        "norm": 1 + (torch.randn(Q_HIDDEN, generator=gen) * 0.1).bfloat16(),
        "qkv": [seg(types[0], q_out, Q_HIDDEN), seg(types[1], kv_out, Q_HIDDEN)],
        "qkv_bias": (torch.randn(q_out + kv_out, generator=gen) * 0.1).bfloat16(),
        "gate_up": [seg(types[2], 2 * Q_INTER, Q_HIDDEN)],
        "down": [seg(types[2], Q_HIDDEN, Q_INTER)],
        "cos": cos,
        "sin": sin,
    }


def quant_separate(lib, p, h, residual, positions):
    """(q and k rotated | v, the MLP's output, the residual after the norm), as separate calls."""
    residual = residual.clone()
    x = elementwise.rms_norm(lib, h, p["norm"], 1e-5, residual)
    qkv = cpu_quant.linear_stacked(lib, x, p["qkv"], Q_HIDDEN, p["qkv_bias"])
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD].view(qkv.shape[0], -1, HEAD)
    elementwise.rope_(lib, qk, positions, p["cos"], p["sin"])
    act = elementwise.silu_mul(lib, cpu_quant.linear_stacked(lib, x, p["gate_up"], Q_HIDDEN))
    return qkv, cpu_quant.linear_stacked(lib, act, p["down"], Q_INTER), residual


@pytest.mark.parametrize(
    "types", [("Q4_1", "Q8_0", "Q4_1"), ("Q5_0", "Q6_K", "Q4_K"), ("Q4_0", "Q5_1", "Q5_K")]
)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_quantized_steps_give_the_separate_calls_results(types, rows: int, threads: int) -> None:
    lib = cpu_library.load(cache_dir())
    if lib is None:
        pytest.skip("no kernels' library")
    p = quant_weights(lib, types, rows)
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, Q_HIDDEN, generator=gen).bfloat16()
    residual = torch.randn(rows, Q_HIDDEN, generator=gen).bfloat16()
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    want_qkv, want_out, want_res = quant_separate(lib, p, h, residual, positions)

    res_buf, x = residual.clone(), torch.empty(rows, Q_HIDDEN, dtype=torch.bfloat16)
    qkv = torch.empty(rows, want_qkv.shape[1], dtype=torch.bfloat16)
    gate_up, act = (torch.empty(rows, n, dtype=torch.bfloat16) for n in (2 * Q_INTER, Q_INTER))
    out = torch.empty(rows, Q_HIDDEN, dtype=torch.bfloat16)
    chain, col = cpu_chain.Chain(lib), 0
    chain.norm(h, p["norm"], 1e-5, x, res_buf)
    for s in p["qkv"]:  # a stacked weight: each segment's step writes its columns
        bias = p["qkv_bias"][col : col + s.n]
        chain.quant_linear(s.qtype, x, s.packed, s.n, Q_HIDDEN, qkv[:, col : col + s.n], bias)
        col += s.n
    chain.rope(
        qkv[:, : (HEADS + KV_HEADS) * HEAD].view(rows, -1, HEAD), positions, p["cos"], p["sin"]
    )
    (g,), (d,) = p["gate_up"], p["down"]
    chain.quant_linear(g.qtype, x, g.packed, g.n, Q_HIDDEN, gate_up)
    chain.silu_mul(gate_up, act)
    chain.quant_linear(d.qtype, act, d.packed, d.n, Q_INTER, out)
    chain.run(threads)
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(out, want_out) and torch.equal(res_buf, want_res)


def test_quantized_steps_refuse_what_they_cannot_run() -> None:
    lib = cpu_library.load(cache_dir())
    if lib is None:
        pytest.skip("no kernels' library")
    w = torch.randn(32, 64) * 0.05
    packed = cpu_quant.pack(lib, "Q8_0", rtn.quantize(w, "Q8_0").raw, 64)
    x, y = torch.randn(2, 64).bfloat16(), torch.empty(2, 32, dtype=torch.bfloat16)
    chain = cpu_chain.Chain(lib)
    with pytest.raises(ValueError, match=r"bf16 tensor \[\*, 64\]"):
        chain.quant_linear("Q8_0", x.float(), packed, 32, 64, y)
    with pytest.raises(ValueError, match="does not hold"):
        chain.quant_linear("Q8_0", x, packed, 16, 64, y[:, :16])
    with pytest.raises(ValueError, match=r"output must be \[2, 32\]"):
        chain.quant_linear("Q8_0", x, packed, 32, 64, y.half())
    with pytest.raises(ValueError, match="bias must be contiguous float32 or bf16"):
        chain.quant_linear("Q8_0", x, packed, 32, 64, y, torch.zeros(32, dtype=torch.float16))
    with pytest.raises(ValueError, match="SiLU-and-mul takes contiguous bf16"):
        chain.silu_mul(y.t(), torch.empty(32, 1, dtype=torch.bfloat16))
