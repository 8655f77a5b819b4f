"""The chain (``radixrt_kernels.cpu.chain``): norms and packed linears in one C call give the
separate calls' results bit for bit."""

from __future__ import annotations

import pytest
import torch

from radixrt.model import rope
from radixrt.model.weights import cache_dir
from radixrt_kernels.cpu import chain as cpu_chain
from radixrt_kernels.cpu import elementwise
from radixrt_kernels.cpu import library as cpu_library
from radixrt_kernels.cpu import linear as cpu_linear

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
