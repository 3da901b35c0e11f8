"""Store groups: the shared store's trust domains, against a real allocator process.

The attack they close: a worker holding only its own token admits a prompt
others will send, frees it (the allocator asks it to write the blocks through
to the store), writes forged K/V and confirms the save. Without groups the
entry is then findable by every pool of the layout: an honest worker loads the
forgery instead of computing, and its own save is skipped because the entry
exists. With groups a pool finds, confirms and skips against its own group's
entries only; the operator puts workers that trust each other in one group
(`group=` in --worker-tokens-file), and a worker token without one is a group
of its own.
"""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Free, PoolConfig
from allocator_service.core.tiers import TierReport
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import stub

BLOCK = 4
LAYOUT = "d" * 64
PROMPT = [(5 * j) % 250 + 3 for j in range(3 * BLOCK + 1)]  # three full blocks: three hashes
TOKENS = """\
evil http://evil:8000 tok-evil
honest http://honest:8000 tok-honest
peer-1 http://peer-1:8000 tok-peer-1 group=team
peer-2 http://peer-2:8000 tok-peer-2 group=team
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, allocator_server):
    d = tmp_path_factory.mktemp("groups")
    (d / "workers").write_text(TOKENS)
    with allocator_server(
        "--worker-tokens-file",
        str(d / "workers"),
        "--kv-shared-store",
        f"file://{d / 'kv'}",
        "--kv-shared-store-size",
        "0.01",
    ) as s:
        yield s


def pool(server, worker: str) -> GrpcAllocator:
    spec = PoolSpec(
        worker,
        PoolConfig(
            num_blocks=16,
            block_size=BLOCK,
            enable_prefix_caching=True,
            model_fingerprint="fp",
            layout=LAYOUT,
            block_bytes=2048,
            use_shared_store=True,
        ),
        advertise_url=f"http://{worker}:8000",
    )
    return GrpcAllocator(server.address, spec, auth_token=f"tok-{worker}", heartbeat=False)


def save_and_confirm(client: GrpcAllocator, seq: str) -> list[bytes]:
    """Admit PROMPT, free it (its blocks are written through to the store) and confirm
    every save, as a worker that wrote them would (a forger writes what it likes)."""
    assert client.step([Admit(seq, PROMPT)]).all_ok
    saves = list(client.step([Free(seq)]).moves.store_saves)
    client.step([], TierReport([], [], saves, [], []))
    return saves


def test_a_worker_cannot_plant_entries_for_another_group(server):
    evil, honest = pool(server, "evil"), pool(server, "honest")
    try:
        assert (
            evil.store_namespace == f"evil.{LAYOUT}"
            and honest.store_namespace == f"honest.{LAYOUT}"
        )
        planted = save_and_confirm(evil, "bait")
        assert len(planted) == 3
        victim = honest.step([Admit("v", PROMPT)])
        assert victim.all_ok and victim[0].cached_tokens == 0  # nothing of evil's is found ...
        assert list(victim.moves.store_loads) == []  # ... or loaded
        # ... and the honest worker's own saves are issued, not skipped for evil's entries
        assert sorted(honest.step([Free("v")]).moves.store_saves) == sorted(planted)
        assert evil.dump()["tiers"]["counters"]["store_saves"] == 3
    finally:
        evil.close()
        honest.close()


def test_workers_of_one_group_share_entries(server):
    a, b = pool(server, "peer-1"), pool(server, "peer-2")
    try:
        assert a.store_namespace == b.store_namespace == f"team.{LAYOUT}"
        save_and_confirm(a, "s")
        r = b.step([Admit("s", PROMPT)])
        assert r[0].cached_tokens == 3 * BLOCK and len(r.moves.store_loads) == 3
    finally:
        a.close()
        b.close()


def test_a_worker_cannot_name_its_own_group(server):
    s, md, channel = stub(server.address, "tok-evil")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            s.RegisterPool(
                pb.RegisterPoolRequest(
                    worker_id="evil",
                    advertise_url="http://evil:8000",
                    shape=pb.PoolShape(
                        num_blocks=8,
                        block_size=BLOCK,
                        model_fingerprint="fp",
                        enable_prefix_caching=True,
                        layout=LAYOUT,
                        block_bytes=2048,
                        use_shared_store=True,
                        store_group="team",
                    ),
                ),
                metadata=md,
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "store_group is the allocator's to set" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            # nor reach into a group through its layout key
            s.RegisterPool(
                pb.RegisterPoolRequest(
                    worker_id="evil",
                    advertise_url="http://evil:8000",
                    shape=pb.PoolShape(
                        num_blocks=8,
                        block_size=BLOCK,
                        model_fingerprint="fp",
                        enable_prefix_caching=True,
                        layout=f"team.{LAYOUT}",
                        block_bytes=2048,
                        use_shared_store=True,
                    ),
                ),
                metadata=md,
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layout must be at most 64 characters of [A-Za-z0-9_-]" in refused.value.details()
    finally:
        channel.close()


def test_a_pool_that_never_confirms_cannot_leave_no_room_for_others(server):
    """The attacker's saves are never confirmed, each entry half the store: with
    two pools using the store it may hold no more than half of it pending, so
    the honest pool's saves are still issued."""
    half = int(0.01 * 2**30) // 2
    prompt = [(7 * j) % 250 + 3 for j in range(3 * BLOCK + 1)]
    honest = pool(server, "honest")
    evil = GrpcAllocator(
        server.address,
        PoolSpec(
            "evil",
            replace(honest.spec.config, block_bytes=half),
            advertise_url="http://evil:8000",
        ),
        auth_token="tok-evil",
        heartbeat=False,
    )
    try:
        assert evil.step([Admit("hog", prompt)]).all_ok
        hogged = evil.step([Free("hog")]).moves.store_saves
        assert len(hogged) == 1  # one entry of half the store, never confirmed; no second
        assert honest.step([Admit("v", prompt)]).all_ok
        assert len(honest.step([Free("v")]).moves.store_saves) == 3
    finally:
        evil.close()
        honest.close()
