"""Async scheduling (the allocator call of step N+1 sent while step N
computes) never changes what a user gets: the same greedy tokens as the
synchronous engine (`--no-async-scheduling`), at every block size, with the
prefix cache on and off, with pools small enough to preempt, with parallel
samples (forks), stop strings and one-token requests (deferred frees), with
chunked prefill, embedded and through a real allocator process (memory state
and Redis journal); and every block comes back."""

from __future__ import annotations

import pytest

from tests.worker.test_engine import make, prompts_mixed
from worker.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed requests: greedy, seeded parallel samples (forked blocks), a
    one-token request and early stops (frees that follow a finish)."""
    prompts = prompts_mixed(seed=3, n=10)
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    params[6] = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[5, 17, 101, 260])
    params[8] = SamplingParams(max_tokens=9, temperature=0.9, seed=11, n=2, ignore_eos=True)
    return prompts, params


def outcome(engine) -> list[list[tuple[list[int], str | None]]]:
    """Every sample's tokens and finish reason; then every block is back and the pool is sound."""
    prompts, params = workload()
    try:
        outs = engine.generate_samples(prompts, params)
        while engine.has_unfinished():
            engine.step()
        engine.step()  # the frees of the last finished requests go out with a step
        engine.step()  # ... and are collected by the next one (async)
        st = engine.allocator.stats()
        assert st.used_blocks == 0, "blocks held after every request finished"
        alloc = engine.allocator
        problems = alloc.pool.integrity_problems() if hasattr(alloc, "pool") else alloc.integrity_problems()
        assert problems == []
        return [[(o.token_ids, o.finish_reason) for o in samples] for samples in outs]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def synchronous(tiny):
    """The synchronous engine, one request at a time with a big pool."""
    return outcome(make(tiny, max_num_seqs=3, num_blocks=4096, block_size=4, async_scheduling=False))


@pytest.fixture(scope="module")
def tiny():
    from worker.model.loader import load_model

    return load_model("tiny-random")


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_async_equals_sync_under_preemption(tiny, synchronous, block_size, caching):
    """A pool of 192 token slots for 10 requests (17 samples) of up to 84
    tokens: both engines preempt, and both give the synchronous outputs."""
    small = {"num_blocks": 192 // block_size, "block_size": block_size, "enable_prefix_caching": caching}
    sync = make(tiny, async_scheduling=False, **small)
    pipelined = make(tiny, async_scheduling=True, **small)
    assert outcome(sync) == synchronous
    assert outcome(pipelined) == synchronous
    assert pipelined.num_preemptions > 0


def test_async_with_chunked_prefill_and_cache(tiny, synchronous):
    engine = make(tiny, enable_prefix_caching=True, num_blocks=28, max_num_batched_tokens=13)
    assert outcome(engine) == synchronous
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("redis", [False, True], ids=["memory", "redis"])
def test_async_through_a_real_allocator(tiny, synchronous, allocator_server, redis_store, redis):
    """A real allocator process, memory state or a Redis journal; the pool
    small enough to preempt: the synchronous outputs, and the same ones with
    async scheduling off."""
    import contextlib

    with (redis_store() if redis else contextlib.nullcontext(("", None))) as (url, _):
        with allocator_server(*(("--state", url) if redis else ())) as server:
            for on in (True, False):
                engine = make(tiny, num_blocks=48, block_size=4, enable_prefix_caching=True,
                              allocator=server.address, worker_id=f"w-{on}", async_scheduling=on)
                assert outcome(engine) == synchronous
                assert engine.num_preemptions > 0


def test_the_flag_and_its_variable(monkeypatch):
    """On by default; `--no-async-scheduling` or PAGEDKV_WORKER_ASYNC_SCHEDULING=false
    turns it off; a flag wins over its variable; a bad value is refused."""
    import argparse

    from worker.cli import add_arguments, engine_config

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p.parse_args(["--model", "tiny-random", *argv])

    monkeypatch.delenv("PAGEDKV_WORKER_ASYNC_SCHEDULING", raising=False)
    assert engine_config(parse()).async_scheduling is True
    assert engine_config(parse("--no-async-scheduling")).async_scheduling is False
    monkeypatch.setenv("PAGEDKV_WORKER_ASYNC_SCHEDULING", "off")
    assert engine_config(parse()).async_scheduling is False
    assert engine_config(parse("--async-scheduling")).async_scheduling is True
    monkeypatch.setenv("PAGEDKV_WORKER_ASYNC_SCHEDULING", "sometimes")
    with pytest.raises(SystemExit):
        parse()
