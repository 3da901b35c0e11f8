"""The `peer://` store's index, in-process (no gRPC): each entry records the
pool that wrote it, a load names the writer's advertised URL, a dropped
writer takes its entries along (no load is ever issued against it), and a
journal replay, from a snapshot or not, rebuilds all of it; older states of
other stores still load as before."""

from __future__ import annotations

import random

import pytest

from allocator_service.config import ServiceConfig
from allocator_service.core import Admit, Free, PoolConfig
from allocator_service.core import tiers as tiers_module
from allocator_service.core.tier_index import SharedStore
from allocator_service.service import AllocatorService, PoolRef
from allocator_service.service.pools import Advertised
from allocator_service.wire.codec import encode_ops, step_from_proto
from allocator_service.wire.errors import BadRequest
from tests.allocator.test_state import FakeJournal, full_state

BLOCK = 4
BLOCK_BYTES = 1000
SHAPE = PoolConfig(
    num_blocks=16,
    block_size=BLOCK,
    enable_prefix_caching=True,
    model_fingerprint="m",
    layout="lay",
    block_bytes=BLOCK_BYTES,
    use_shared_store=True,
)
PROMPT = list(range(3, 3 + 3 * BLOCK + 1))  # three full blocks before the last token


def _service(
    journal: FakeJournal, snapshot_every: int = 1000, store_blocks: int = 40
) -> AllocatorService:
    config = ServiceConfig(
        snapshot_every=snapshot_every,
        shared_store="peer://",
        shared_store_bytes=store_blocks * BLOCK_BYTES,
    )
    return AllocatorService(config, journal)


class Pool:
    """One registered pool, stepping as its worker would."""

    def __init__(self, svc: AllocatorService, worker: str) -> None:
        self.url = f"http://{worker}:8000"
        r = svc.pools.register(worker, SHAPE, "", Advertised(self.url, "m"))
        self.svc, self.ref, self.step_id = svc, PoolRef(r.pool_id, r.credential), 0
        self.registration = r

    def step(self, ops: list, store_saved: list[bytes] = ()):
        msg = encode_ops(ops)
        if store_saved:
            msg.report.store_saved = b"".join(store_saved)
        self.step_id += 1
        return self.svc.steps.step(self.ref, self.step_id, *step_from_proto(msg))

    def save(self, seq: str, prompt: list[int]) -> list[bytes]:
        """Admit, free (written through) and confirm: its entries are present."""
        self.step([Admit(seq, prompt)])
        saves = self.step([Free(seq)]).moves.store_saves
        hashes = [saves[i : i + 32] for i in range(0, len(saves), 32)]
        self.step([], hashes)
        return hashes


def _writers(svc: AllocatorService) -> dict[bytes, str]:
    lru = svc.registry.store.lru
    return {h: loc for part in (lru.present, lru.pending) for (_, h), (loc, _) in part.items()}


def test_a_load_names_the_writers_url_and_the_writer_takes_its_entries_along():
    svc = _service(FakeJournal())
    a, b = Pool(svc, "prefill-1"), Pool(svc, "decode-1")
    assert a.registration.peer_key == b.registration.peer_key != ""  # one group: one key
    assert a.registration.peer_store_bytes == 40 * BLOCK_BYTES
    hashes = a.save("s", PROMPT)
    assert len(hashes) == 3
    assert _writers(svc) == {h: a.ref.pool_id for h in hashes}
    r = b.step([Admit("s", PROMPT)])
    assert r.cached_tokens[0] == 3 * BLOCK
    assert list(r.moves.store_load_from) == [a.url] * 3
    b.step([Free("s")])  # b's own copies are not saved: the store has them

    svc.pools.deregister(a.ref)
    assert _writers(svc) == {}  # gone with its writer's memory
    r = b.step([Admit("t", PROMPT)])
    # b's KV pool still holds them, cached: nothing is loaded from anywhere
    assert r.cached_tokens[0] == 3 * BLOCK and not r.moves.store_loads
    assert svc.registry.store.integrity_problems() == []


def _deletes(moves) -> set[bytes]:
    d = moves.store_deletes
    return {d[i : i + 32] for i in range(0, len(d), 32)}


@pytest.mark.parametrize("snapshot_every", [1000, 1])
def test_entries_another_pools_save_evicts_are_deleted_by_their_writer(snapshot_every):
    """The writer's worker holds a peer entry's bytes: when another pool's save
    evicts it from the index, the delete goes to the writer (its next step),
    not to the pool that evicted it, whose memory never held it; a restart in
    between keeps it owed."""
    journal = FakeJournal()
    svc = _service(journal, snapshot_every, store_blocks=6)
    a, b = Pool(svc, "prefill-1"), Pool(svc, "decode-1")
    written = set(a.save("s", PROMPT))
    b.save("t", [9000 + t for t in PROMPT])  # the store is full
    b.step([Admit("u", [8000 + t for t in PROMPT])])
    r = b.step([Free("u")])  # its saves evict a's entries
    assert len(r.moves.store_saves) == 3 * 32
    assert not _writers(svc).keys() & written
    assert not _deletes(r.moves) & written
    if snapshot_every == 1:  # the allocator restarts before the writer's next step
        svc = _service(journal, snapshot_every, store_blocks=6)
        a.svc = svc
    r = a.step([])
    assert _deletes(r.moves) == written
    assert set(r.moves.store_delete_layouts) == {"lay"}
    assert not _deletes(a.step([]).moves)  # owed once


def test_owed_deletes_go_a_few_per_answer_and_never_delete_an_entry_written_again(monkeypatch):
    """At most OWED_DELETES_PER_STEP owed deletes per answer (the answer stays
    small); an entry its writer saves again before its delete went out is not
    deleted after (its new bytes are what the index finds)."""
    monkeypatch.setattr(tiers_module, "OWED_DELETES_PER_STEP", 1)
    svc = _service(FakeJournal(), store_blocks=6)
    a, b = Pool(svc, "prefill-1"), Pool(svc, "decode-1")
    written = set(a.save("s", PROMPT))
    b.save("t", [9000 + t for t in PROMPT])
    b.save("u", [8000 + t for t in PROMPT])  # a's three entries evicted: three deletes owed
    assert not _writers(svc).keys() & written
    first = _deletes(a.step([Admit("again", PROMPT)]).moves)  # (its KV pool still holds them)
    assert len(first) == 1 and first < written
    r = a.step([Free("again")])  # written through again: the two left are no longer owed
    saved = [r.moves.store_saves[i : i + 32] for i in range(0, len(r.moves.store_saves), 32)]
    assert set(saved) == written and not _deletes(r.moves)
    a.step([], saved)
    assert not _deletes(a.step([]).moves)
    assert all(_writers(svc)[h] == a.ref.pool_id for h in written)  # found, and still held


def test_a_pool_without_an_advertised_url_cannot_use_a_peer_store():
    svc = _service(FakeJournal())
    with pytest.raises(BadRequest, match="must advertise"):
        svc.pools.register("w", SHAPE)


@pytest.mark.parametrize("snapshot_every", [1000, 5])
def test_replay_rebuilds_every_writer_and_the_peer_key(snapshot_every):
    journal = FakeJournal()
    svc = _service(journal, snapshot_every)
    rng = random.Random(snapshot_every)
    pools = [Pool(svc, f"w{i}") for i in range(3)]
    for n in range(12):
        p = rng.choice(pools)
        p.save(f"s{n}", [rng.randrange(4) for _ in range(rng.randrange(1, 4 * BLOCK))])
    svc.pools.deregister(pools[1].ref)  # its entries go, the others' stay
    live = {pools[0].ref.pool_id, pools[2].ref.pool_id}
    assert set(_writers(svc).values()) <= live and _writers(svc)
    again = _service(journal, snapshot_every)
    assert full_state(again) == full_state(svc)
    assert again.registry.store.to_state() == svc.registry.store.to_state()
    assert _writers(again) == _writers(svc)
    assert again.registry.peer_key("") == svc.registry.peer_key("") != ""
    # the writers' pools keep naming their entries after the restart
    for p in (pools[0], pools[2]):
        assert again.registry.pools[p.ref.pool_id].pool.tiers.writer == p.ref.pool_id


def test_other_stores_dump_as_before_and_older_dumps_load():
    store = SharedStore(100)
    state = store.to_state()
    assert set(state) == {"capacity_bytes", "present", "pending", "counters"}
    older = {"capacity_bytes": 100, "present": [["lay", "ab" * 32, 10]], "pending": []}
    older["counters"] = {}
    back = SharedStore.from_state(older)
    assert not back.peer and back.lru.present[("lay", bytes.fromhex("ab" * 32))] == (0, 10)
    peer = SharedStore(100, peer=True)
    peer.lru.add_pending(("lay", b"h" * 32), "w/1", 10)
    peer.lru.confirm(("lay", b"h" * 32))
    again = SharedStore.from_state(peer.to_state())
    assert again.peer and again.to_state() == peer.to_state()
    assert again.drop_writer("w/2") == 0 and again.drop_writer("w/1") == 1 and not again.lru
