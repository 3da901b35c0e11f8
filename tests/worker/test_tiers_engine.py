"""The engine with KV tiers (worker/engine/tiers.py): a host tier, the shared
store through an embedded allocator's index, swap preemption.

What a user would notice: the same tokens with tiers on and off (greedy), with
pools small enough that blocks are evicted, saved and loaded many times; prompt
tokens loaded from a tier counted in `cached_tokens` (read back through the
HTTP API); a broken store entry refused, counted, and computed instead; a
preempted sequence resumed in swap mode computing no more than its tail; bad
tier settings a one-line error at start.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from allocator_service.client import EmbeddedAllocator
from allocator_service.core.hashing import prompt_chain
from allocator_service.core.tier_index import SharedStore
from tests.support.http import metric, openai_client
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.kv_pool import bytes_per_block
from worker.model.loader import load_model
from worker.tiers import Refused, decode_entry, encode_entry, entry_key

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def gib(tiny, blocks: int) -> float:
    """--kv-offloading-size for a host tier of `blocks` blocks of the tiny model."""
    c = tiny.config
    return (
        blocks
        * bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, tiny.model.dtype)
        / 2**30
    )


def prompts(seed: int = 0, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def make(tiny, allocator=None, **kw) -> LLMEngine:
    cfg = {"num_blocks": 40, "block_size": BLOCK, "enable_prefix_caching": True, **kw}
    return LLMEngine(tiny, EngineConfig(**cfg), allocator=allocator)


def tokens(engine: LLMEngine, ps, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(ps, params)]


def settle(engine: LLMEngine) -> dict[str, int]:
    """The last frees sent, then the confirmations of the saves they caused;
    the pool intact; its tier counters."""
    engine.step()
    engine.step()
    pool = engine.allocator.pool
    assert pool.integrity_problems() == []
    assert engine.allocator.stats().used_blocks == 0
    return asdict(pool.tiers.stats)


@pytest.fixture(scope="module")
def reference(tiny):
    """Each workload on a pool big enough for everything, no tiers."""
    engine = make(tiny, num_blocks=2048)
    return {seed: tokens(engine, prompts(seed)) for seed in (0, 1)}


def tier_metric(engine: LLMEngine, name: str, tier: str, **labels) -> float | None:
    for fam in engine.metrics.registry.collect():
        for s in fam.samples:
            if (
                s.name == name
                and s.labels.get("tier") == tier
                and all(s.labels.get(k) == v for k, v in labels.items())
            ):
                return s.value
    return None


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_host_tier_same_tokens_and_hits(tiny, reference, async_scheduling):
    engine = make(tiny, kv_offloading_size=gib(tiny, 256), async_scheduling=async_scheduling)
    # 12 prompts at once on 40 blocks: evictions, preemptions
    assert tokens(engine, prompts(0)) == reference[0]
    pool = engine.allocator.pool
    hits_before, host_before = pool.stats().prefix_hit_tokens, pool.tiers.stats.host_hit_tokens
    # one at a time again: each finds its prompt in the KV pool or (mostly) the host tier
    again = [engine.generate([p], GREEDY)[0] for p in prompts(0)]
    assert [o.token_ids for o in again] == reference[0]
    c = settle(engine)
    assert c["host_saves"] > 40 and c["saves_confirmed"] == c["host_saves"] and c["host_loads"] > 40
    host_hits = c["host_hit_tokens"] - host_before
    cached = sum(o.num_cached_tokens for o in again)
    # every tier's hits, as the usage says
    assert cached == pool.stats().prefix_hit_tokens - hits_before
    assert cached >= host_hits > cached // 2
    assert (
        tier_metric(engine, "pagedkv_worker_kv_tier_hit_tokens_total", "host")
        == c["host_hit_tokens"]
    )
    assert (
        tier_metric(engine, "pagedkv_worker_kv_tier_loaded_blocks_total", "host") == c["host_loads"]
    )
    assert (
        tier_metric(engine, "pagedkv_worker_kv_tier_saved_blocks_total", "host") == c["host_saves"]
    )
    assert (
        tier_metric(engine, "pagedkv_worker_kv_tier_capacity_bytes", "host")
        == engine.tiers.host.bytes_total
    )
    used = tier_metric(engine, "pagedkv_worker_kv_tier_used_bytes", "host")
    assert used == min(256, c["host_saves"]) * engine.tiers.host.block_bytes


def test_no_tier_hits_less(tiny, reference):
    """The same workload without the tier: the evicted prompts are computed again."""
    engine = make(tiny)
    tokens(engine, prompts(0))
    again = engine.generate(prompts(0), GREEDY)
    tiered = make(tiny, kv_offloading_size=gib(tiny, 256))
    tokens(tiered, prompts(0))
    tiered_again = tiered.generate(prompts(0), GREEDY)
    assert [o.token_ids for o in again] == reference[0]
    assert sum(o.num_cached_tokens for o in again) < sum(o.num_cached_tokens for o in tiered_again)
    assert (
        engine.tiers is None
        and tier_metric(engine, "pagedkv_worker_kv_tier_hit_tokens_total", "host") is None
    )


GROUP_KEY = b"a store group's secret, 32 bytes or more"


def in_group(store, group: str = "g"):
    """An embedded allocator placing its pool in store group `group` (what a remote
    allocator does from the worker's credential)."""
    return lambda spec: EmbeddedAllocator(
        replace(spec, config=replace(spec.config, store_group=group)), shared_store=store
    )


@pytest.mark.parametrize(("host_blocks", "key"), [(0, None), (16, None), (0, GROUP_KEY)])
def test_two_engines_share_the_store(tiny, reference, tmp_path, host_blocks, key):
    """Two workers on one store (one index, a `file://` directory): the second
    loads what the first computed, written through to the store when freed,
    with a small host tier or none; sealed with their group's key or plain."""
    index = SharedStore(1000 * 2048)
    store = (f"file://{tmp_path}", index)
    size = gib(tiny, host_blocks)
    a = make(tiny, in_group(store), kv_offloading_size=size, worker_id="a", kv_store_key=key)
    assert tokens(a, prompts(1)) == reference[1]
    ca = settle(a)
    assert ca["store_saves"] > 20 and ca["saves_confirmed"] >= ca["store_saves"]
    b = make(tiny, in_group(store), kv_offloading_size=size, worker_id="b", kv_store_key=key)
    # one at a time: no preemption, one admission each
    outs = [b.generate([p], GREEDY)[0] for p in prompts(1)]
    assert [o.token_ids for o in outs] == reference[1]
    cb = settle(b)
    assert cb["store_loads"] > 20 and cb["refused_loads"] == 0
    cached = sum(o.num_cached_tokens for o in outs)
    assert cached == b.allocator.stats().prefix_hit_tokens >= cb["store_hit_tokens"] > cached // 2
    assert (
        tier_metric(b, "pagedkv_worker_kv_tier_hit_tokens_total", "shared")
        == cb["store_hit_tokens"]
    )
    assert index.integrity_problems() == []


def test_refused_store_entries_are_computed(tiny, reference, tmp_path):
    index = SharedStore(1000 * 2048)
    store = (f"file://{tmp_path}", index)
    a = make(tiny, lambda spec: EmbeddedAllocator(spec, shared_store=store), worker_id="a")
    tokens(a, prompts(1))
    settle(a)
    broken = 0
    for root, _, files in os.walk(tmp_path):  # flip the last payload byte of every entry
        for f in files:
            p = Path(root, f)
            data = bytearray(p.read_bytes())
            data[-1] ^= 0xFF
            p.write_bytes(bytes(data))
            broken += 1
    assert broken == len(index.lru.present) > 20
    b = make(tiny, lambda spec: EmbeddedAllocator(spec, shared_store=store), worker_id="b")
    # its prompt was in the store: every block refused
    alone = b.generate(prompts(1)[:1], GREEDY)[0]
    outs = b.generate(prompts(1), GREEDY)
    assert [o.token_ids for o in outs] == reference[1] and alone.token_ids == reference[1][0]
    assert alone.num_cached_tokens == 0
    cb = settle(b)
    refused = tier_metric(
        b, "pagedkv_worker_kv_tier_refused_entries_total", "shared", reason="checksum"
    )
    # reported, and the index dropped them
    assert refused == cb["refused_loads"] == index.stats.refused_drops > 20
    # the loads that were not refused: entries b saved again itself (the refused ones it computed)
    loaded = cb["store_loads"] - cb["refused_loads"]
    assert tier_metric(b, "pagedkv_worker_kv_tier_hit_tokens_total", "shared") == loaded * BLOCK


def test_loads_past_a_refused_block_are_not_hits(tiny, reference, tmp_path):
    """A prompt whose first block's entry is corrupt computes from its start:
    the later blocks it loaded are computed too, so the worker counts no hit
    for them (its tier hits are cached tokens it kept, as usage reports)."""
    index = SharedStore(1000 * 2048)
    store = (f"file://{tmp_path}", index)
    a = make(tiny, lambda spec: EmbeddedAllocator(spec, shared_store=store), worker_id="a")
    prompt = prompts(1)[0]
    assert tokens(a, [prompt]) == [reference[1][0]]
    settle(a)
    b = make(tiny, lambda spec: EmbeddedAllocator(spec, shared_store=store), worker_id="b")
    config = b.allocator.spec.config
    chain = prompt_chain(config.model_fingerprint, prompt, BLOCK)
    assert len(chain) > 2 and all(
        (b.allocator.store_namespace, h) in index.lru.present for h in chain
    )
    first = tmp_path.rglob(entry_key(b.allocator.store_namespace, chain[0]))
    path = next(first)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # its checksum no longer holds
    path.write_bytes(bytes(data))
    out = b.generate([prompt], GREEDY)[0]
    assert out.token_ids == reference[1][0] and out.num_cached_tokens == 0
    cb = settle(b)
    assert cb["store_loads"] == len(chain) and cb["refused_loads"] == 1
    assert tier_metric(b, "pagedkv_worker_kv_tier_hit_tokens_total", "shared") in (None, 0)


def test_forged_entries_never_reach_a_worker_with_a_store_key(tiny, reference, tmp_path):
    """Whoever can write the store but holds no group key (another group's worker, a
    store reader) replaces every entry with forged K/V under a valid header and
    checksum: a worker with the key refuses each (`seal`), computes instead and
    answers the same tokens. The entries themselves are sealed: without the key
    none decodes."""
    index = SharedStore(1000 * 2048)
    store = (f"file://{tmp_path}", index)
    a = make(tiny, in_group(store), worker_id="a", kv_store_key=GROUP_KEY)
    tokens(a, prompts(1))
    settle(a)
    layout, namespace = a.tiers.layout, a.allocator.store_namespace
    assert namespace == f"g.{layout.key}"
    forged = 0
    for root, _, files in os.walk(tmp_path):
        for f in files:
            p = Path(root, f)
            ns, _, hex_hash = f.rpartition("-")
            assert ns == namespace
            h = bytes.fromhex(hex_hash)
            got = decode_entry(p.read_bytes(), layout, h)  # a reader without the key
            assert isinstance(got, Refused) and got.reason == "seal"
            # plain, checksum valid
            p.write_bytes(encode_entry(layout, h, os.urandom(layout.block_bytes)))
            forged += 1
    assert forged == len(index.lru.present) > 20
    b = make(tiny, in_group(store), worker_id="b", kv_store_key=GROUP_KEY)
    alone = b.generate(prompts(1)[:1], GREEDY)[0]
    outs = b.generate(prompts(1), GREEDY)
    assert [o.token_ids for o in outs] == reference[1] and alone.token_ids == reference[1][0]
    assert alone.num_cached_tokens == 0
    cb = settle(b)
    refused = tier_metric(
        b, "pagedkv_worker_kv_tier_refused_entries_total", "shared", reason="seal"
    )
    assert refused == cb["refused_loads"] == index.stats.refused_drops > 20


def test_without_store_opted_out(tiny, tmp_path):
    """`--no-kv-shared-store`: the pool registers without the store, nothing is saved there."""
    index = SharedStore(1000 * 2048)
    e = make(
        tiny,
        lambda spec: EmbeddedAllocator(spec, shared_store=(f"file://{tmp_path}", index)),
        kv_shared_store=False,
    )
    tokens(e, prompts(1))
    assert e.tiers is None and e.allocator.pool.tiers is None and not any(tmp_path.iterdir())


def resumes(engine: LLMEngine) -> list[tuple[int, int]]:
    """(tokens it holds, tokens computed) of each preempted sequence's resume
    step: the first step of each admission after its first."""
    seen: set[str] = set()
    out: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def observe(batch):
        for e in batch.entries:
            alloc_id = e.seq.alloc_id  # a new one per admission: `REQUEST#N`
            if not alloc_id.endswith("#1") and alloc_id not in seen:
                seen.add(alloc_id)
                out.append((len(e.seq.token_ids), e.num_new))
        return execute(batch)

    engine.runner.execute = observe
    return out


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_swap_resumes_without_recompute(tiny, async_scheduling):
    rng = random.Random(1)
    ps = [[rng.randrange(3, 300) for _ in range(rng.randint(10, 30))] for _ in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = tokens(make(tiny, num_blocks=2048), ps, params)
    runs = {}
    for mode in ("recompute", "swap"):
        e = make(
            tiny,
            kv_offloading_size=gib(tiny, 512),
            preemption_mode=mode,
            max_num_seqs=8,
            async_scheduling=async_scheduling,
        )
        seen = resumes(e)
        assert tokens(e, ps, params) == ref
        assert e.num_preemptions >= 4 and len(seen) == e.num_preemptions
        runs[mode] = seen
        settle(e)
    # swap: a resumed sequence computes at most its last partial block (here: its last token)
    assert all(new <= (held - 1) % BLOCK + 1 for held, new in runs["swap"]), runs["swap"]
    assert sum(n for _, n in runs["swap"]) < sum(n for _, n in runs["recompute"]), runs


def test_cached_tokens_over_http(worker_process, tiny):
    """A real worker: a prompt evicted from its 16-block pool comes back from
    the host tier, and the API's cached_tokens says so."""
    size = f"{gib(tiny, 128):.9f}"
    with worker_process(
        "tiny-random",
        "--num-blocks",
        "16",
        "--block-size",
        str(BLOCK),
        "--kv-offloading-size",
        size,
    ) as url:
        client = openai_client(url)
        target = list(range(5, 45))  # 40 tokens: 10 blocks
        first = client.completions.create(
            model="tiny-random", prompt=target, max_tokens=4, temperature=0
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        for k in range(4):  # others fill the pool: the target's blocks are evicted to the host tier
            client.completions.create(
                model="tiny-random", prompt=[50 + 40 * k + i for i in range(40)], max_tokens=2
            )
        again = client.completions.create(
            model="tiny-random", prompt=target, max_tokens=4, temperature=0
        )
        assert again.choices[0].text == first.choices[0].text
        hits = metric(url, "pagedkv_worker_kv_tier_hit_tokens_total", {"tier": "host"})
        assert hits and hits > 0
        assert again.usage.prompt_tokens_details.cached_tokens >= hits
        # every block but the last token's
        assert again.usage.prompt_tokens_details.cached_tokens == 36


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--kv-offloading-size", "100000"],
            "--kv-offloading-size 100000 GiB is more than the memory available",
        ),
        (
            ["--kv-offloading-size", "-1"],
            "argument --kv-offloading-size: expected a number of GiB >= 0 or 'none'",
        ),
        (["--preemption-mode", "swap"], "--preemption-mode swap needs a host tier"),
        (["--kv-offloading-size", "0.001", "--no-enable-prefix-caching"], "needs prefix caching"),
    ],
)
def test_bad_tier_settings_are_one_line_errors(args, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "tiny-random", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if not lines[0].startswith("usage:"):
        # (a flag's own parse error comes after the usage, as argparse has it)
        assert len(lines) == 1, proc.stderr
    assert needle in lines[-1] and "Traceback" not in proc.stderr, proc.stderr
