"""The KV tiers through a remote allocator (`pagedkv allocator --kv-shared-store`):
the same tiers a worker gets from its embedded allocator, over gRPC.

What a user would notice: the same tokens with the tiers on as without; blocks
that really move (saves and loads issued, prompt tokens loaded from the host
tier and the store counted as cached); a prefix one worker computed loaded by
another from the store, and seen there by MatchPrefix and the metrics; a
kill -9 of the allocator that loses no entry of the tiers' index and turns no
unconfirmed save into a hit; a bad store flag a one-line error at start.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import Admit, Free, PoolConfig
from allocator_service.core.hashing import prompt_chain
from allocator_service.core.tiers import Moves, TierReport
from router.app import Router
from router.discovery import Discovery, MergedDiscovery, Worker
from tests.worker.test_tiers_engine import BLOCK, GREEDY, gib, make, prompts, tokens
from worker.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
STORE_GIB = "0.01"  # ~5,000 entries of the tiny model's 2 KiB blocks


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def reference(tiny):
    """The workloads on a pool big enough for everything, no tiers."""
    engine = make(tiny, num_blocks=2048)
    return {seed: tokens(engine, prompts(seed)) for seed in (0, 1)}


def remote(address: str):
    return lambda spec: GrpcAllocator(address, spec)


def settle(engine) -> dict[str, int]:
    """The last frees and confirmations sent; the pool sound at the allocator; its tier counters."""
    engine.step()
    assert engine.allocator.integrity_problems() == []
    assert engine.allocator.stats().used_blocks == 0
    return engine.allocator.dump()["tiers"]["counters"]


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_engine_on_a_remote_allocator_with_host_tier_and_store(
    tiny, reference, tmp_path, allocator_server
):
    """A host tier smaller than the workload: its evictions fall down to the store."""
    store = f"file://{tmp_path / 'kv'}"
    with allocator_server(
        "--kv-shared-store", store, "--kv-shared-store-size", STORE_GIB
    ) as server:
        engine = make(tiny, remote(server.address), kv_offloading_size=gib(tiny, 16), worker_id="w")
        assert engine.allocator.shared_store == store and engine.tiers.store is not None
        # 12 prompts at once on 40 blocks: evictions
        assert tokens(engine, prompts(0)) == reference[0]
        settle(engine)
        hits_before = engine.allocator.stats().prefix_hit_tokens
        c0 = engine.allocator.dump()["tiers"]["counters"]
        # one at a time again: each finds its prompt in the KV pool, the host tier or the store
        again = [engine.generate([p], GREEDY)[0] for p in prompts(0)]
        assert [o.token_ids for o in again] == reference[0]
        c = settle(engine)
        assert (
            c["host_saves"] > 40
            and c["store_saves"] > 10
            and c["host_loads"] > 0
            and c["store_loads"] > 10
        )
        assert c["saves_confirmed"] == c["host_saves"] + c["store_saves"] and c["refused"] == 0
        cached = sum(o.num_cached_tokens for o in again)
        # every tier's hits
        assert cached == engine.allocator.stats().prefix_hit_tokens - hits_before
        host, shared = (c[k] - c0[k] for k in ("host_hit_tokens", "store_hit_tokens"))
        assert 0 < host + shared <= cached and shared > 0
        assert c["host_hit_tokens"] > 0  # (in the first run, 12 prompts at once)
        assert any(p.is_file() for p in (tmp_path / "kv").rglob("*"))  # entries the worker wrote
        engine.allocator.close()


def test_two_pools_share_the_store(tiny, reference, tmp_path, allocator_server):
    """Pool b loads what pool a computed; MatchPrefix and /metrics say so."""
    with allocator_server(
        "--kv-shared-store",
        f"file://{tmp_path}",
        "--kv-shared-store-size",
        STORE_GIB,
        "--metrics-port",
        "0",
    ) as server:
        a = make(tiny, remote(server.address), worker_id="a")
        assert tokens(a, prompts(1)) == reference[1]
        ca = settle(a)
        assert ca["store_saves"] > 20 and ca["saves_confirmed"] == ca["store_saves"]
        b = make(tiny, remote(server.address), worker_id="b")
        fingerprint = b.allocator.spec.config.model_fingerprint
        router = RouterClient(server.address)
        seen = {m.pool_id: m for m in router.match_prefix(fingerprint, prompts(1)[0])}
        mb = seen[b.allocator.pool_id]
        assert mb.cached_tokens == 0 and mb.host_tokens == 0 and mb.store_tokens > 0
        assert mb.store_tokens % BLOCK == 0
        # The router asks MatchPrefix for pools with tiers (its view holds KV pools only) and
        # ranks a's KV hit (and its store hit past it) above b's hit in the store alone.
        listed = {p.pool_id: p for p in router.list_pools()}
        workers = [
            Worker(
                f"http://{w.allocator.pool_id}",
                w.allocator.pool_id[0],
                w.allocator.pool_id,
                fingerprint,
                num_blocks=listed[w.allocator.pool_id].num_blocks,
                block_size=BLOCK,
                free_blocks=listed[w.allocator.pool_id].free_blocks,
                tiered=listed[w.allocator.pool_id].use_shared_store,
            )
            for w in (a, b)
        ]
        discovery = Discovery(router, index=0)
        discovery.allocator_ok = True
        routing = Router(None, MergedDiscovery([discovery]), "kv", allocators=[router])
        matches = asyncio.run(routing.matching.cached_tokens(workers, prompts(1)[0], None))
        assert matches[(0, b.allocator.pool_id)] == (0, mb.free_blocks, 0, mb.store_tokens)
        ranked = routing.placement.ranked(workers, matches, len(prompts(1)[0]))
        assert [w.pool_id for w, _ in ranked] == [a.allocator.pool_id, b.allocator.pool_id]
        assert dict((w.pool_id, n) for w, n in ranked)[b.allocator.pool_id] == mb.store_tokens
        outs = [b.generate([p], GREEDY)[0] for p in prompts(1)]  # one at a time: one admission each
        assert [o.token_ids for o in outs] == reference[1]
        cb = settle(b)
        assert cb["store_loads"] > 20 and cb["refused"] == 0
        cached = sum(o.num_cached_tokens for o in outs)
        assert (
            cached == b.allocator.stats().prefix_hit_tokens >= cb["store_hit_tokens"] > cached // 2
        )
        m = metrics(server.metrics_url)
        key = frozenset(
            {"pool_id": b.allocator.pool_id, "worker_id": "b", "tier": "shared"}.items()
        )
        assert m[("pagedkv_allocator_kv_tier_hit_tokens_total", key)] == cb["store_hit_tokens"]
        assert m[("pagedkv_allocator_kv_tier_loaded_blocks_total", key)] == cb["store_loads"]
        assert m[("pagedkv_allocator_shared_store_capacity_bytes", frozenset())] == int(
            float(STORE_GIB) * 2**30
        )
        listed = {p.pool_id: p for p in router.list_pools()}
        assert listed[b.allocator.pool_id].use_shared_store
        assert listed[b.allocator.pool_id].store_hit_tokens == cb["store_hit_tokens"]
        assert (
            m[("pagedkv_allocator_shared_store_used_bytes", frozenset())]
            == listed["a/1"].store_used_bytes
            > 0
        )
        router.close()
        a.allocator.close()
        b.allocator.close()


def _prompt(i: int) -> list[int]:
    """Three full blocks and a token: three hashed blocks."""
    return [(7 * i + j) % 250 + 3 for j in range(3 * BLOCK + 1)]


def test_kill_9_keeps_the_tier_index_and_no_pending_save_becomes_a_hit(
    redis_store, allocator_server, tmp_path
):
    """Pools without workers behind them (their moves confirmed by hand): pool
    s saves to the store; pool h to its host tier of two slots, whose entries
    fall down to the store. Some saves are confirmed, the last ones pending
    when the allocator is killed."""

    def spec(worker: str, host_blocks: int) -> PoolSpec:
        return PoolSpec(
            worker,
            PoolConfig(
                num_blocks=4,
                block_size=BLOCK,
                enable_prefix_caching=True,
                model_fingerprint="fp",
                host_blocks=host_blocks,
                layout="L",
                block_bytes=2048,
                use_shared_store=True,
            ),
        )

    def cycle(client: GrpcAllocator, i: int, report: TierReport | None = None) -> Moves:
        """Admit prompt i (evicting the cached blocks of the one
        before) and free it: the moves of both."""
        r = client.step([Admit(f"s{i}", _prompt(i))], *([report] if report else []))
        assert r.all_ok
        f = client.step([Free(f"s{i}")])
        return Moves(*(a + b for a, b in zip(r.moves, f.moves, strict=True)))

    def confirming(m: Moves) -> TierReport:
        """Every save of `m` written."""
        return TierReport(list(m.host_saves[1::2]), [], list(m.store_saves), [], [])

    def seen(address: str) -> dict:
        router = RouterClient(address)
        try:
            return {
                i: {
                    x.pool_id: (x.cached_tokens, x.host_tokens, x.store_tokens)
                    for x in router.match_prefix("fp", _prompt(i))
                }
                for i in range(4)
            }
        finally:
            router.close()

    def store_figures(server) -> tuple[float, float]:
        m = metrics(server.metrics_url)
        return (
            m[("pagedkv_allocator_shared_store_entries", frozenset())],
            m[("pagedkv_allocator_shared_store_used_bytes", frozenset())],
        )

    with redis_store() as (url, _):
        args = (
            "--state",
            url,
            "--kv-shared-store",
            f"file://{tmp_path}",
            "--kv-shared-store-size",
            STORE_GIB,
            "--metrics-port",
            "0",
        )
        # the index goes through snapshots and replay
        env = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "5"}
        with allocator_server(*args, env=env) as server:
            s = GrpcAllocator(server.address, spec("s", 0), heartbeat=False)
            h = GrpcAllocator(server.address, spec("h", 2), heartbeat=False)
            assert s.shared_store == f"file://{tmp_path}"
            m = cycle(s, 0)
            m = cycle(s, 1, confirming(m))  # prompt 0's blocks leave the KV pool: three store saves
            m = cycle(s, 2, confirming(m))  # ... confirmed; prompt 1's too
            assert len(m.store_saves) >= 3 and not m.host_saves  # never confirmed
            m = cycle(h, 0)
            for i in range(1, 4):  # two host slots: their entries fall down to the store
                m = cycle(h, i, confirming(m))
            assert m.host_saves  # pending, never confirmed
            before = {c.pool_id: c.dump() for c in (s, h)}
            found, figures = seen(server.address), store_figures(server)
            assert found[0]["s/1"] == (0, 0, 3 * BLOCK)  # confirmed: found in the store
            # a prompt whose first block's store save is pending is not found there
            pending = set(before["s/1"]["tiers"]["store_pending"])
            heads = {i: prompt_chain("fp", _prompt(i), BLOCK, None)[0].hex() for i in range(4)}
            assert any(heads[i] in pending for i in range(3))
            for i in range(4):
                if heads[i] in pending:
                    assert found[i]["s/1"][2] == 0
            assert (
                before["s/1"]["tiers"]["store_pending"]
                and before["h/1"]["tiers"]["host"]["pending"]
            )
            # what pool s saved, h finds (and loaded) too
            assert found[0]["h/1"] == (0, 0, 3 * BLOCK)
            assert before["h/1"]["tiers"]["counters"]["store_loads"] > 0
            server.kill()

        with allocator_server(*args, env=env, listen=f"127.0.0.1:{server.port}") as again:
            assert "2 pools restored" in "\n".join(again.lines)
            for c in (s, h):  # the same clients: their pools and credentials are restored
                assert c.dump() == before[c.pool_id]
                assert c.integrity_problems() == []
            assert seen(again.address) == found and store_figures(again) == figures
            # the pending saves are dropped with their pool, and never found
            dropped = len(before["s/1"]["tiers"]["store_pending"])
            s.close()
            entries, used = store_figures(again)
            assert entries == figures[0] - dropped and used == figures[1] - dropped * 2048
            assert seen(again.address)[2]["h/1"] == found[2]["h/1"]
            h.close()


def test_bad_store_flags_are_one_line_errors(tmp_path):
    plain = tmp_path / "a-file"
    plain.write_text("")
    for args, text in (
        (["--kv-shared-store", "s3://bucket/kv", "--kv-shared-store-size", "1"], "unknown kind"),
        (
            ["--kv-shared-store", f"file://{plain}/kv", "--kv-shared-store-size", "1"],
            "cannot write to",
        ),
        (["--kv-shared-store", f"file://{tmp_path}"], "needs --kv-shared-store-size"),
        (["--kv-shared-store-size", "1"], "is for --kv-shared-store"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "allocator_service", "--listen", "127.0.0.1:0", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert p.returncode != 0, args
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], (args, p.stderr)


def test_a_worker_follows_the_store_when_the_allocator_changes_it(
    tiny, reference, redis_store, allocator_server, tmp_path
):
    """The allocator restarted on another `--kv-shared-store` drops the pools of the old
    one; their workers register again and write to the new store only."""
    old, new = tmp_path / "old", tmp_path / "new"

    def entries(folder: Path) -> int:
        return sum(1 for p in folder.rglob("*") if p.is_file())

    with redis_store() as (url, _):
        args = ("--state", url, "--kv-shared-store-size", STORE_GIB)
        with allocator_server(*args, "--kv-shared-store", f"file://{old}") as server:
            engine = make(tiny, remote(server.address), worker_id="w")
            assert tokens(engine, prompts(1)) == reference[1]
            settle(engine)
            written = entries(old)
            assert written > 20 and engine.tiers.store.store.url == f"file://{old}"
        with allocator_server(
            *args, "--kv-shared-store", f"file://{new}", listen=f"127.0.0.1:{server.port}"
        ):
            # its pool dropped: registered anew, computed again
            assert tokens(engine, prompts(1)) == reference[1]
            settle(engine)
            assert (
                engine.allocator.shared_store == f"file://{new}"
                and engine.tiers.store.store.url == f"file://{new}"
            )
            # nothing more went to the old store
            assert entries(new) > 20 and entries(old) == written
            engine.allocator.close()
