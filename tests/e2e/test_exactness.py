"""Exact outputs: a request's tokens, logprobs, top logprobs and prompt logprobs are the same
bits whatever the batch around it, its arrival, the cache state (flushed, warm, partly
evicted, the host and storage tiers), the chunk size, the page size and retraction; equal to
its run alone on a cold engine (``==`` on the floats).

Random workloads come from hypothesis, for the tiny model in float32 and bf16. The engines are
built once per dtype: a reference (page 1, no chunking, no time budget, decode steps apart from
prefill steps, a large pool) and variants, which mix running requests' tokens into prefill
steps and budget steps by time (pages of 4;
chunks of 16; pages of 16 with chunks of 37 and prefill batches of 64 tokens; a pool small
enough that requests are retracted and prefixes evicted to the host tier and to storage)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt import Engine, SamplingParams
from radixrt.testing import output_bits

VOCAB_LO, VOCAB_HI = 10, 2000


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request, tiny_llama, tmp_path_factory):
    dtype = request.param
    storage = tmp_path_factory.mktemp(f"exact-storage-{dtype}")
    made = {
        "reference": Engine(
            model=tiny_llama,
            dtype=dtype,
            max_total_tokens=8192,
            max_prefill_step_ms=0,
            disable_mixed_chunk=True,
        ),
        "paged": Engine(model=tiny_llama, dtype=dtype, max_total_tokens=8192, page_size=4),
        "chunked": Engine(
            model=tiny_llama, dtype=dtype, max_total_tokens=8192, chunked_prefill_size=16
        ),
        "odd": Engine(
            model=tiny_llama,
            dtype=dtype,
            max_total_tokens=8192,
            page_size=16,
            chunked_prefill_size=37,
            max_prefill_tokens=64,
        ),
        "tight": Engine(
            model=tiny_llama,
            dtype=dtype,
            max_total_tokens=320,
            enable_hierarchical_cache=True,
            hicache_storage_dir=str(storage),
            hicache_ratio=2.0,
        ),
    }
    assert all(e.runner.exactness.exact for e in made.values()), made["reference"].runner.exactness
    yield made
    for eng in made.values():
        eng.check_memory()
        eng.shutdown()


class Alone:
    """Each (prompt, params, prompt-scoring start) run alone on a flushed reference engine,
    remembered."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.seen = eng, {}

    def __call__(self, ids: list[int], sp: SamplingParams, start: int | None):
        key = (tuple(ids), repr(sp), start)
        if key not in self.seen:
            self.eng.flush_cache()
            req = self.eng.add_request(ids, sp, logprob_start_len=start)
            while not req.finished:
                self.eng.step()
            self.seen[key] = output_bits(self.eng.make_output(req))
        return self.seen[key]


_alone: dict[int, Alone] = {}


@st.composite
def workloads(draw):
    """Prompts sharing random prefixes, their sampling parameters, arrival rounds and the
    cache state to start from."""
    prefixes = [
        draw(st.lists(st.integers(VOCAB_LO, VOCAB_HI), min_size=1, max_size=70))
        for _ in range(draw(st.integers(1, 3)))
    ]
    reqs = []
    for _ in range(draw(st.integers(1, 7))):
        ids = draw(st.sampled_from(prefixes)) + draw(
            st.lists(st.integers(VOCAB_LO, VOCAB_HI), min_size=1, max_size=30)
        )
        seeded = draw(st.booleans())
        sp = SamplingParams(
            max_new_tokens=draw(st.integers(1, 8)),
            temperature=0.8 if seeded else 0.0,
            top_p=draw(st.sampled_from([1.0, 0.9])) if seeded else 1.0,
            seed=draw(st.integers(0, 1000)) if seeded else None,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=draw(st.integers(0, 3)),
        )
        start = draw(st.one_of(st.none(), st.integers(1, len(ids) - 1))) if len(ids) > 1 else None
        reqs.append((ids, sp, start, draw(st.integers(0, 3))))  # the last: its arrival step
    cache = draw(st.sampled_from(["flushed", "warm", "partly"]))
    engine = draw(st.sampled_from(["reference", "paged", "chunked", "odd", "tight"]))
    return reqs, cache, engine


def prepare_cache(eng: Engine, reqs, cache: str) -> None:
    """Flushed; warm (every prompt run once before); or partly (some of them run before)."""
    eng.flush_cache()
    if cache == "flushed":
        return
    warm = [r for i, r in enumerate(reqs) if cache == "warm" or i % 2 == 0]
    eng.generate(
        input_ids=[ids for ids, *_ in warm],
        sampling_params=[SamplingParams(max_new_tokens=2, ignore_eos=True)] * len(warm),
    )


def run_arriving(eng: Engine, reqs) -> list:
    """Each request added at its arrival step, then every request driven to the end."""
    pending, made = sorted(enumerate(reqs), key=lambda x: x[1][3]), {}
    step = 0
    while pending or not all(r.finished for r in made.values()):
        while pending and pending[0][1][3] <= step:
            i, (ids, sp, start, _) = pending.pop(0)
            made[i] = eng.add_request(ids, sp, logprob_start_len=start)
        if any(not r.finished for r in made.values()):
            eng.step()
        step += 1
    return [output_bits(eng.make_output(made[i])) for i in range(len(reqs))]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(work=workloads())
def test_outputs_equal_each_request_alone(engines, work):
    reqs, cache, name = work
    alone = _alone.setdefault(id(engines["reference"]), Alone(engines["reference"]))
    want = [alone(ids, sp, start) for ids, sp, start, _ in reqs]
    eng = engines[name]
    prepare_cache(eng, reqs, cache)
    got = run_arriving(eng, reqs)
    eng.check_memory()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} differs on engine {name!r} with the cache {cache}"


def test_retraction_and_tiers_were_exercised(engines):
    """The tight engine's pool forces retraction and evictions to the host tier (so the
    random workloads above reach those paths)."""
    eng = engines["tight"]
    eng.flush_cache()
    ids = [[VOCAB_LO + (7 * i + j) % 1900 for j in range(60)] for i in range(6)]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = eng.generate(input_ids=ids, sampling_params=[sp] * len(ids))
    stats = eng.stats()
    assert stats["retractions"] > 0, stats
    again = eng.generate(input_ids=ids, sampling_params=[sp] * len(ids))
    assert sum(o.cached_tokens_details["host"] + o.cached_tokens_details["storage"] for o in again)
    alone = _alone.setdefault(id(engines["reference"]), Alone(engines["reference"]))
    for i, o in enumerate([*outs, *again]):
        assert output_bits(o) == alone(ids[i % len(ids)], sp, None)


def test_structured_outputs_are_exact(engines):
    """Grammar-constrained requests among unconstrained ones: the same bits as alone."""
    eng = engines["reference"]
    alone = _alone.setdefault(id(eng), Alone(eng))
    ids = [[VOCAB_LO + (13 * i + 3 * j) % 1900 for j in range(20 + i)] for i in range(5)]
    sps = [
        SamplingParams(
            max_new_tokens=8,
            temperature=0.0,
            logprobs=True,
            top_logprobs=2,
            regex="[a-z]{3,6}" if i % 2 else None,
            ignore_eos=i % 2 == 0,
        )
        for i in range(len(ids))
    ]
    want = [alone(p, sp, None) for p, sp in zip(ids, sps)]
    eng.flush_cache()
    assert [output_bits(o) for o in eng.generate(input_ids=ids, sampling_params=sps)] == want


@pytest.mark.parametrize("kernel", ["fma", "avx512_bf16"])
def test_the_decode_chain_keeps_outputs_exact(tiny_llama, kernel):
    """bf16 on a kernel the decode chain runs: batched with the chain on, the same bits as
    alone layer by layer."""
    from radixrt_kernels.cpu import chain as cpu_chain
    from radixrt_kernels.cpu import library as cpu_library
    from radixrt_kernels.cpu import linear as cpu_linear

    lib = cpu_library.loaded()
    if kernel not in cpu_chain.KERNELS or not cpu_linear.kernel_available(lib, kernel):
        pytest.skip(f"the {kernel} linear kernel does not run here")
    args = dict(model=tiny_llama, dtype="bfloat16", max_total_tokens=4096, linear_kernel=kernel)
    ids = [[VOCAB_LO + (17 * i + 5 * j) % 1900 for j in range(40)] for i in range(3)]
    ids += [ids[0][:30] + [VOCAB_LO + 3 * i + j for j in range(6)] for i in range(5)]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2)
    with Engine(**args, disable_decode_chain=True) as plain:
        alone = Alone(plain)
        want = [alone(p, sp, None) for p in ids]
    with Engine(**args) as chained:
        assert chained.runner.decode_chain is not None, chained.runner.decode_chain_info
        assert chained.runner.exactness.exact
        got = [output_bits(o) for o in chained.generate(input_ids=ids, sampling_params=sp)]
    assert got == want
