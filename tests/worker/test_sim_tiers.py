"""KV tiers on a simulated device (`--device sim:NAME --kv-offloading-size GIB`,
the allocator's shared store): the real tiers' bookkeeping with every move
timed on the device stream at the GPU's host link, no bytes moved.

What a user notices: the same tokens with tiers on and off; prompt tokens
found in the host tier or the store counted in `cached_tokens`; saves
confirmed to the allocator as a real worker's are; each step's device time
longer by exactly the bytes its moves carry over the host link (64 GB/s on
an H100); swap preemption resuming without recompute; a bad setting refused
in one line.
"""

from __future__ import annotations

import random
from dataclasses import asdict, replace

import pytest

from allocator_service.client import EmbeddedAllocator
from allocator_service.core.tier_index import SharedStore
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.sim import load_sim_model
from worker.sim import write_config

BLOCK = 4
# Llama-3-8B: 131,072 K/V bytes a token (32 layers x 8 KV heads x 128 x 2 x 2 B), 4 tokens a block
BLOCK_BYTES = 131_072 * BLOCK
H100_HOST = 64e9  # B/s, PCIe Gen5 one way (the GPU table)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_sim_model(write_config("llama-3-8b", tmp_path_factory.mktemp("llama-3-8b")))


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 2**30


def prompts(seed: int = 0, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def make(llama, allocator=None, **kw) -> LLMEngine:
    cfg = {
        "num_blocks": 40,
        "block_size": BLOCK,
        "enable_prefix_caching": True,
        "clock": "virtual",
        **kw,
    }
    engine = LLMEngine(
        llama,
        EngineConfig(model="llama-3-8b", device="sim:h100", dtype="bfloat16", **cfg),
        allocator=allocator,
    )
    engine.step_seconds = []  # each step's roofline time, as launched (its moves not included)
    launch = engine.runner.launch

    def timed(batch):
        launched = launch(batch)
        engine.step_seconds.append(launched.cost.seconds)
        return launched

    engine.runner.launch = timed
    return engine


def tokens(engine: LLMEngine, ps) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(ps, PARAMS)]


def settle(engine: LLMEngine) -> dict[str, int]:
    """The last frees sent, then the confirmations they caused; the allocator's tier counters."""
    engine.step()
    engine.step()
    pool = engine.allocator.pool
    assert pool.integrity_problems() == [] and engine.allocator.stats().used_blocks == 0
    return asdict(pool.tiers.stats)


def moved_seconds(engine: LLMEngine) -> float:
    """The device time beyond the steps' own: the tier moves (no copy-on-write here)."""
    return engine.runner.device_seconds - sum(engine.step_seconds)


@pytest.fixture(scope="module")
def reference(llama):
    engine = make(llama, num_blocks=2048)
    return {seed: tokens(engine, prompts(seed)) for seed in (0, 1)}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "synchronous"])
def test_host_tier_same_tokens_hits_and_time(llama, reference, async_scheduling):
    engine = make(llama, kv_offloading_size=gib(256), async_scheduling=async_scheduling)
    assert engine.overlapped == async_scheduling
    host = engine.tiers.host
    assert host.num_slots == 256 and not host.pinned  # counted as on CUDA; no memory taken
    # 12 prompts on 40 blocks: evictions, preemptions
    assert tokens(engine, prompts(0)) == reference[0]
    pool = engine.allocator.pool
    hits_before = pool.stats().prefix_hit_tokens
    # one at a time: found in the host tier
    again = [engine.generate([p], PARAMS)[0] for p in prompts(0)]
    assert [o.token_ids for o in again] == reference[0]
    c = settle(engine)
    assert c["host_saves"] > 40 and c["saves_confirmed"] == c["host_saves"] and c["host_loads"] > 40
    cached = sum(o.num_cached_tokens for o in again)
    assert cached == pool.stats().prefix_hit_tokens - hits_before
    assert cached > c["host_hit_tokens"] // 2 > 0
    # every block moved: 524,288 B over 64 GB/s = 8.192 us of device time, no more, no less
    assert moved_seconds(engine) == pytest.approx(
        (c["host_saves"] + c["host_loads"]) * 8.192e-6, rel=1e-9
    )
    # the virtual clock: device time
    assert engine.clock.now() == pytest.approx(engine.runner.device_seconds)


def test_a_prompt_back_from_the_host_tier_costs_its_loads(llama):
    """Hand-worked: a 40-token prompt (10 blocks) is evicted from a 16-block pool by
    four others and asked again: 9 blocks come back from the host tier (the last
    token is computed), 36 tokens cached; that request's steps take their roofline
    time plus its moves' bytes over the host link."""
    engine = make(llama, num_blocks=16, kv_offloading_size=gib(128))
    target = list(range(5, 45))
    first = engine.generate([target], PARAMS)[0]
    for k in range(4):
        engine.generate([[50 + 40 * k + i for i in range(40)]], PARAMS)
    c0, moved0 = settle(engine), moved_seconds(engine)
    again = engine.generate([target], PARAMS)[0]
    c1 = settle(engine)
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 36
    loads, saves = c1["host_loads"] - c0["host_loads"], c1["host_saves"] - c0["host_saves"]
    assert loads == 9
    assert moved_seconds(engine) - moved0 == pytest.approx(
        (loads + saves) * BLOCK_BYTES / H100_HOST, rel=1e-9
    )


def in_group(store, group: str = "g"):
    return lambda spec: EmbeddedAllocator(
        replace(spec, config=replace(spec.config, store_group=group)), shared_store=store
    )


@pytest.mark.parametrize("host_blocks", [0, 16])
def test_two_simulated_workers_share_the_store(llama, reference, tmp_path, host_blocks):
    """The second worker loads what the first computed, through the allocator's store
    index: confirmed saves, hits counted as cached, never refused; the store's backend
    holds no bytes (a simulated entry is an index entry only)."""
    index = SharedStore(1000 * BLOCK_BYTES)  # bytes: 1,000 entries
    store = (f"file://{tmp_path}", index)
    size = gib(host_blocks)
    a = make(llama, in_group(store), kv_offloading_size=size, worker_id="a")
    assert tokens(a, prompts(1)) == reference[1]
    ca = settle(a)
    assert (
        ca["store_saves"] > 20
        and ca["saves_confirmed"] >= ca["store_saves"]
        and ca["saves_failed"] == 0
    )
    b = make(llama, in_group(store), kv_offloading_size=size, worker_id="b")
    outs = [b.generate([p], PARAMS)[0] for p in prompts(1)]
    assert [o.token_ids for o in outs] == reference[1]
    cb = settle(b)
    assert cb["store_loads"] > 20 and cb["refused_loads"] == 0
    cached = sum(o.num_cached_tokens for o in outs)
    assert cached == b.allocator.stats().prefix_hit_tokens >= cb["store_hit_tokens"] > cached // 2
    assert index.integrity_problems() == []
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]  # nothing written to the backend
    for engine, c in ((a, ca), (b, cb)):
        moves = c["store_saves"] + c["store_loads"] + c["host_saves"] + c["host_loads"]
        assert moved_seconds(engine) == pytest.approx(moves * BLOCK_BYTES / H100_HOST, rel=1e-9)


def test_swap_preemption_resumes_without_recompute(llama):
    rng = random.Random(1)
    ps = [[rng.randrange(3, 300) for _ in range(rng.randint(10, 30))] for _ in range(8)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in make(llama, num_blocks=2048).generate(ps, params)]
    computed = {}
    for mode in ("recompute", "swap"):
        engine = make(llama, kv_offloading_size=gib(512), preemption_mode=mode, max_num_seqs=8)
        launch, new = engine.runner.launch, []

        def counting(batch, launch=launch, new=new):
            new.append(sum(e.num_new for e in batch.entries))
            return launch(batch)

        engine.runner.launch = counting
        assert [o.token_ids for o in engine.generate(ps, params)] == ref
        assert engine.num_preemptions >= 4
        settle(engine)
        computed[mode] = sum(new)
    assert computed["swap"] < computed["recompute"], computed


def test_a_host_save_is_done_once_the_stream_has_done_it(llama):
    """A save queued behind the step in flight is done (so confirmed) only when
    the device stream reaches its end, as a CUDA side-stream copy."""
    engine = make(llama, kv_offloading_size=gib(8))
    runner, host = engine.runner, engine.tiers.host
    before = runner.device_seconds
    _, step_done = runner.stream.launch(0.001)  # a step in flight
    save = host.save([0, 1], [0, 1])
    assert save.seconds == 2 * BLOCK_BYTES / H100_HOST
    assert runner.device_seconds - before == save.seconds
    runner.clock.wait_until(step_done)
    assert not save.done()
    runner.clock.wait_until(step_done + save.seconds)
    assert save.done() and host.poll() == 0
