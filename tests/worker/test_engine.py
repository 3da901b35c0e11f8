"""The engine on a tiny random model (CPU): continuous batching, preemption,
prefix caching and chunked prefill never change greedy outputs, and every
block comes back."""

from __future__ import annotations

import random

import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.core import PoolConfig
from worker.engine import EngineConfig, LLMEngine, RequestError, SamplingParams
from worker.model.loader import load_model

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def prompts_mixed(seed: int = 0, n: int = 8, system: int = 24) -> list[list[int]]:
    """Mixed lengths, all starting with one shared 'system prompt'."""
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(3, 300) for _ in range(system)]
    return [
        sys_prompt + [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))] for _ in range(n)
    ]


def make(tiny, **kw) -> LLMEngine:
    cfg = {"num_blocks": 512, "block_size": 4, **kw}
    return LLMEngine(tiny, EngineConfig(**cfg))


def run(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    engine.step()  # the frees of the last finished requests go out with a step
    st = engine.allocator.stats()
    assert st.used_blocks == 0, "blocks held after every request finished"
    alloc = engine.allocator
    problems = (
        alloc.pool.integrity_problems() if hasattr(alloc, "pool") else alloc.integrity_problems()
    )
    assert problems == []
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny):
    """Each prompt alone, one at a time, with a big pool: the ground truth."""
    engine = make(tiny, max_num_seqs=1)
    return run(engine, prompts_mixed())


def test_batched_equals_one_at_a_time(tiny, reference):
    assert run(make(tiny), prompts_mixed()) == reference


def test_tiny_pool_preempts_and_matches(tiny, reference):
    engine = make(tiny, num_blocks=40)
    assert run(engine, prompts_mixed()) == reference
    assert engine.num_preemptions > 0
    text = engine.metrics.registry.get_sample_value(
        "pagedkv_worker_preemptions_total",
        {
            "worker": "worker-0",
            "model": "tiny-random",
            "model_name": "tiny-random",
            "cause": "out_of_blocks",
        },
    )
    assert text == engine.num_preemptions


@pytest.mark.parametrize("caching", [False, True])
def test_queried_tokens_agree_with_the_allocator(tiny, reference, caching):
    """The worker counts the prompt tokens looked up as its pool does: none with caching off."""
    engine = make(tiny, enable_prefix_caching=caching)
    assert run(engine, prompts_mixed()) == reference
    labels = {"worker": "worker-0", "model": "tiny-random", "model_name": "tiny-random"}
    sample = engine.metrics.registry.get_sample_value
    queried = sample("pagedkv_worker_prefix_cache_queried_tokens_total", labels) or 0
    hit = sample("pagedkv_worker_prefix_cache_hit_tokens_total", labels) or 0
    st = engine.allocator.stats()
    assert (queried, hit) == (st.prefix_queried_tokens, st.prefix_hit_tokens)
    if caching:
        assert queried == sum(map(len, prompts_mixed())) and hit > 0
    else:
        assert queried == 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_caching_matches_and_hits(tiny, reference, block_size):
    engine = make(
        tiny, enable_prefix_caching=True, block_size=block_size, num_blocks=2048 // block_size
    )
    assert run(engine, prompts_mixed()) == reference
    st = engine.allocator.stats()
    assert st.prefix_hit_tokens > 0  # the shared system prompt was reused


def test_shared_system_prompt_hits_the_cache(tiny):
    engine = make(tiny, enable_prefix_caching=True)
    prompts = prompts_mixed()
    first = engine.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    later = engine.generate(prompts[1:], GREEDY)
    # 24 shared tokens at block size 4: 6 full blocks come from the cache
    assert all(o.num_cached_tokens >= 24 for o in later)


def test_prefix_caching_with_preemption_and_chunking(tiny, reference):
    engine = make(tiny, enable_prefix_caching=True, num_blocks=40, max_num_batched_tokens=16)
    assert run(engine, prompts_mixed()) == reference
    assert engine.num_preemptions > 0


def test_chunked_prefill_matches(tiny, reference):
    engine = make(tiny, max_num_batched_tokens=7)
    assert run(engine, prompts_mixed()) == reference


def test_request_that_can_never_fit_is_refused(tiny):
    engine = make(tiny, num_blocks=8)  # 32 token slots
    with pytest.raises(RequestError, match="KV pool"):
        engine.add_request(list(range(3, 40)), GREEDY)
    with pytest.raises(RequestError, match="exceeds"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=30, temperature=0))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([5, 10**9], GREEDY)
    assert not engine.has_unfinished()


def test_abort_frees_blocks(tiny):
    engine = make(tiny)
    rid = engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.allocator.stats().used_blocks > 0
    engine.abort(rid)
    engine.step()  # the free goes out with the next step
    assert engine.allocator.stats().used_blocks == 0
    assert not engine.has_unfinished()


def test_sampling_seed_top_k_stop(tiny, reference):
    engine = make(tiny)
    p = prompts_mixed()[:3]
    seeded = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a = [o.token_ids for o in engine.generate(p, seeded)]
    b = [o.token_ids for o in engine.generate(p[:1], seeded)]
    assert a[0] == b[0]  # a seeded request does not depend on its batch
    topk1 = SamplingParams(max_tokens=20, temperature=1.0, top_k=1, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(p, topk1)] == reference[:3]
    # stop token: the reference's 5th token ends the reply
    stop_tok = reference[0][4]
    out = engine.generate(
        p[:1],
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_tok,), ignore_eos=True),
    )[0]
    first = reference[0].index(stop_tok)
    assert out.finish_reason == "stop" and out.token_ids == reference[0][: first + 1]
    out = engine.generate(p[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == reference[0][:3]


def test_stop_string_cuts_text(tiny):
    engine = make(tiny)
    full = engine.generate(
        ["hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    assert len(full.text) > 4
    needle = full.text[2:4]
    out = engine.generate(
        ["hello"], SamplingParams(max_tokens=12, temperature=0, stop=(needle,), ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(needle)]


def test_engine_with_an_explicit_allocator_client(tiny, reference):
    spec = PoolSpec("w", PoolConfig(512, 4, False, tiny.fingerprint))
    engine = LLMEngine(
        tiny, EngineConfig(num_blocks=512, block_size=4), allocator=EmbeddedAllocator(spec)
    )
    assert run(engine, prompts_mixed()) == reference


@pytest.mark.parametrize("caching", [False, True])
def test_through_the_grpc_allocator(tiny, reference, caching, allocator_server):
    """The same outputs with the allocator as a real gRPC server process,
    with a pool small enough to preempt."""
    server = allocator_server()
    try:
        engine = make(tiny, num_blocks=40, allocator=server.address, enable_prefix_caching=caching)
        try:
            assert run(engine, prompts_mixed()) == reference
            assert engine.num_preemptions > 0
        finally:
            engine.close()
    finally:
        server.terminate()


def test_streamed_deltas_never_take_text_back(tiny):
    """With a stop string, text that might start it is held back, so the
    streamed deltas always add up to the final text."""
    engine = make(tiny)
    full = engine.generate(
        ["hello"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    )[0].text
    needle = full[5:8]
    params = SamplingParams(
        max_tokens=16, temperature=0, stop=(needle, "never-there"), ignore_eos=True
    )
    engine.add_request("hello", params, request_id="r")
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_text)
            last = out
    assert last.finished and last.finish_reason == "stop"
    assert last.text == full[: full.find(needle)]
    assert "".join(deltas) == last.text
