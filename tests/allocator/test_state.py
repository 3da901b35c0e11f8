"""The service's state machine in-process (no gRPC, no Redis): the one step
function (`run_step`, on columns, through the wire's encoding) against a
reference model of the step semantics, snapshots and journal replay rebuild
the exact state, and an ambiguous journal failure never double-applies."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import (
    Admit,
    AllocatorError,
    Append,
    BlockPool,
    Fork,
    Free,
    OpResult,
    PoolConfig,
    execute_step,
    run_step,
    step_columns,
)
from allocator_service.service import AllocatorService, PoolRef, check_step
from allocator_service.store import registry as state
from allocator_service.store.journal import Loaded
from allocator_service.wire.codec import (
    columns_from_proto,
    decode_results,
    encode_ops,
    result_to_proto,
)
from allocator_service.wire.errors import BadRequest, StepConflict, StoreUnavailable
from tests.support.allocator import random_steps, step_call

SHAPE = PoolConfig(num_blocks=24, block_size=4, model_fingerprint="m", enable_prefix_caching=True)

seq_ids = st.sampled_from(["a", "b", "c", "d", ""])
tokens = st.lists(st.integers(0, 5), max_size=12)
ops = st.lists(
    st.one_of(
        st.builds(
            Admit,
            seq_ids,
            tokens,
            st.sampled_from([None, "", "t"]),
            st.sampled_from([None, 0, 1, 3]),
        ),
        st.builds(Append, seq_ids, tokens),
        st.builds(Free, seq_ids),
        st.builds(Fork, seq_ids, seq_ids),
    ),
    max_size=8,
)


def reference_step(pool: BlockPool, step: list) -> list[OpResult]:
    """The step semantics, written plainly on the pool's one-operation
    methods: frees first, then the rest in the order given; each operation
    all-or-nothing; a failure is that operation's result, never the step's."""
    results: list[OpResult | None] = [None] * len(step)
    frees = [i for i, op in enumerate(step) if isinstance(op, Free)]
    for i in frees + [i for i in range(len(step)) if i not in frees]:
        op = step[i]
        before = pool.to_state()
        try:
            if isinstance(op, Free):
                pool.free(op.seq)
                results[i] = OpResult()
            elif isinstance(op, Append):
                r = pool.append(op.seq, op.tokens)
                results[i] = OpResult(keep=r.keep, append=r.new_blocks, copies=r.copies)
            elif isinstance(op, Admit):
                a = pool.admit(op.seq, op.tokens, op.salt, op.num_new_tokens)
                results[i] = OpResult(
                    append=a.table, cached_tokens=a.cached_tokens, num_stored=a.num_stored
                )
            else:
                results[i] = OpResult(append=pool.fork(op.parent, op.child))
        except AllocatorError as exc:
            after = pool.to_state()
            # counts the refusal
            after["counters"]["out_of_blocks"] = before["counters"]["out_of_blocks"]
            assert after == before, f"{op} failed ({exc.code}) but changed the pool"
            results[i] = OpResult(ok=False, error=exc.code, message=str(exc))
    return results  # type: ignore[return-value]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=10), st.booleans(), st.integers(1, 4))
def test_run_step_follows_the_step_semantics(steps, prefix, block_size):
    config = PoolConfig(
        num_blocks=12, block_size=block_size, enable_prefix_caching=prefix, model_fingerprint="m"
    )
    ref, pool, objects = BlockPool(config), BlockPool(config), BlockPool(config)
    for i, step in enumerate(steps, 1):
        expected = reference_step(ref, step)
        # The service's path: wire columns in, checked, run, wire columns out.
        columns = columns_from_proto(encode_ops(step))
        # the same columns; the wire's tokens known valid (uint32), run_step checks none
        assert columns == step_columns(step)._replace(tokens_valid=True)
        check_step(columns, Limits())
        got = run_step(pool, columns)
        assert list(got) == expected
        assert decode_results(result_to_proto(i, got), len(step)) == expected
        # The embedded client's path: operation objects.
        assert execute_step(objects, step) == expected
        assert pool.to_state() == ref.to_state() == objects.to_state()


class FakeJournal:
    """A durable journal in a Python list; `fail_after_write` makes the next
    append store the record and then report an error (a Redis timeout after
    the write landed: the ambiguous case)."""

    durable = True
    # the leader lease (store/leader.py): one instance, always the leader
    address, lease_s, token, leader = "", 1.0, "", ""

    def claim(self, force: bool) -> bool:
        return True

    def renew(self) -> int:
        return 1

    def release(self) -> None:
        pass

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.snapshot: bytes | None = None
        self.head: bytes | None = None
        self.fail_after_write = False
        self.down = False
        self.snapshot_down = False
        self.snapshot_attempts = 0

    def load(self, take_ownership=True, check_owner=True):
        if self.down:
            raise StoreUnavailable("down")
        return Loaded(self.snapshot, list(self.records), self.head)

    def append(self, entry: bytes, prev_head: bytes, new_head: bytes) -> None:
        if self.down:
            raise StoreUnavailable("down")
        assert (self.head or b"") == prev_head
        self.records.append(entry)
        self.head = new_head
        if self.fail_after_write:
            self.fail_after_write = False
            raise StoreUnavailable("timeout after write")

    def write_snapshot(self, snapshot: bytes, hint: int, chain: bytes) -> bool:
        """As Redis does: trim the records up to the one with `chain`."""
        self.snapshot_attempts += 1
        if self.snapshot_down:
            raise StoreUnavailable("snapshot refused")
        upto = next((i + 1 for i, r in enumerate(self.records) if r[36:68] == chain), 0)
        if not upto:
            return False
        self.snapshot = snapshot
        del self.records[:upto]
        return True

    def reseed(self, snapshot: bytes, head: bytes) -> None:
        self.snapshot, self.head = snapshot, head
        self.records.clear()

    def probe(self, head: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "fake"


def full_state(svc: AllocatorService) -> dict:
    reg = svc.registry
    return {
        "index": reg.index,
        "events": svc.events.next_sequence,
        "epochs": reg.epochs,
        "idle": list(reg.idle),
        "epoch_floor": reg.epoch_floor,
        "pools": {
            p: (
                e.pool.to_state(),
                e.last_step_id,
                e.last_digest,
                e.last_response,
                e.credential_digest,
                e.protocol_version,
            )
            for p, e in reg.pools.items()
        },
    }


@pytest.mark.parametrize("snapshot_every", [1000, 7])
def test_restart_from_journal_rebuilds_everything(snapshot_every):
    journal = FakeJournal()
    svc = AllocatorService(ServiceConfig(snapshot_every=snapshot_every), journal)
    a = svc.pools.register("wa", SHAPE)
    b = svc.pools.register("wb", SHAPE)
    # its Steps must name prev_step_id, after a restart too
    d = svc.pools.register("wd", SHAPE, protocol_version=2)
    ref_a = PoolRef(a.pool_id, a.credential)
    ref_b = PoolRef(b.pool_id, b.credential)
    for i, (sa, sb) in enumerate(zip(random_steps(1, 40), random_steps(2, 40), strict=True), 1):
        svc.steps.step(ref_a, i, *step_call(sa))
        svc.steps.step(ref_b, i, *step_call(sb))
        if i == 20:
            svc.steps.reset_prefix_cache(ref_a)
    c = svc.pools.register("wc", SHAPE)
    svc.pools.register("wc", SHAPE, c.credential)  # a new epoch replaces c
    svc.pools.deregister(ref_b)
    assert (journal.snapshot is not None) == (snapshot_every < 1000)

    again = AllocatorService(ServiceConfig(snapshot_every=snapshot_every), journal)
    assert full_state(again) == full_state(svc)
    assert c.pool_id not in again.registry.pools
    assert again.registry.pools[d.pool_id].protocol_version == 2
    # The last step's answer survives, and a retry of it is not applied again.
    last = svc.registry.pools[a.pool_id].last_response
    assert again.steps.step(ref_a, 40, *step_call(random_steps(1, 40)[-1])) == last
    assert full_state(again) == full_state(svc)
    with pytest.raises(StepConflict):
        again.steps.step(ref_a, 40, *step_call([Free("nope")]))
    with pytest.raises(StepConflict):
        again.steps.step(ref_a, 3, *step_call([Free("nope")]))


def _cycle(svc: AllocatorService, worker_id: str) -> str:
    """Register a pool for `worker_id` and deregister it; its pool id."""
    r = svc.pools.register(worker_id, SHAPE)
    svc.pools.deregister(PoolRef(r.pool_id, r.credential))
    return r.pool_id


def test_register_deregister_cycles_keep_the_epoch_map_bounded():
    """Workers whose ids are fresh each start (the default HOSTNAME-PID-RANDOM)
    register and go: the epochs remembered stay at IDLE_EPOCHS_KEPT, however
    many cycles, and no pool id is ever issued twice, to a forgotten id
    either; a restart from the journal issues the same next ids."""
    journal = FakeJournal()
    svc = AllocatorService(ServiceConfig(snapshot_every=997), journal)
    live = svc.pools.register("steady", SHAPE)
    kept = state.IDLE_EPOCHS_KEPT
    issued = [_cycle(svc, f"w-{i}") for i in range(kept + 3000)]
    reg = svc.registry
    # the idle ones kept, and the live one
    assert len(reg.idle) == kept and len(reg.epochs) == kept + 1
    assert reg.epoch_floor == 1 and "steady" in reg.epochs and "w-0" not in reg.epochs
    # Once ids are forgotten, a fresh id starts above the floor.
    last = f"w-{kept + 2999}"
    assert issued[:2] == ["w-0/1", "w-1/1"] and issued[-1] == f"{last}/2"
    # A forgotten id, a remembered one and the live one: new ids only.
    issued += [_cycle(svc, "w-0"), _cycle(svc, last), _cycle(svc, last)]
    again = svc.pools.register("steady", SHAPE, live.credential).pool_id
    issued.append(again)
    assert issued[-4:] == ["w-0/2", f"{last}/3", f"{last}/4", "steady/2"]
    assert len(set(issued)) == len(issued)
    restarted = AllocatorService(ServiceConfig(snapshot_every=997), journal)
    assert full_state(restarted) == full_state(svc)
    assert [restarted.registry.next_epoch(w) for w in ("w-0", "w-1", last, "new")] == [3, 2, 5, 2]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sampled_from("abcdefgh"), max_size=60))
def test_no_pool_id_is_issued_twice_whatever_is_forgotten(monkeypatch, workers):
    monkeypatch.setattr(state, "IDLE_EPOCHS_KEPT", 3)
    svc = AllocatorService(ServiceConfig(), FakeJournal())
    issued = [_cycle(svc, w) for w in workers]
    assert len(set(issued)) == len(issued)
    assert len(svc.registry.idle) <= 3 and len(svc.registry.epochs) <= 3


def test_ambiguous_journal_failure_reloads_and_applies_once():
    journal = FakeJournal()
    svc = AllocatorService(ServiceConfig(), journal)
    r = svc.pools.register("w", SHAPE)
    ref = PoolRef(r.pool_id, r.credential)
    steps = random_steps(3, 6)
    for i, s in enumerate(steps[:5], 1):
        svc.steps.step(ref, i, *step_call(s))
    journal.fail_after_write = True
    with pytest.raises(StoreUnavailable):
        svc.steps.step(ref, 6, *step_call(steps[5]))
    # The record landed but memory did not apply it: the retry reloads from
    # the journal, finds step 6 applied, and answers it without applying again.
    answer = svc.steps.step(ref, 6, *step_call(steps[5]))
    reference = BlockPool(PoolConfig(24, 4, True, "m"))
    for s in steps[:5]:
        execute_step(reference, s)
    assert answer == result_to_proto(6, run_step(reference, step_columns(steps[5])))
    assert svc.registry.pools[r.pool_id].pool.to_state() == reference.to_state()


def test_store_down_refuses_changes_and_keeps_reads():
    journal = FakeJournal()
    svc = AllocatorService(ServiceConfig(), journal)
    r = svc.pools.register("w", SHAPE)
    ref = PoolRef(r.pool_id, r.credential)
    svc.steps.step(ref, 1, *step_call([Admit("a", [1, 2, 3, 4, 5])]))
    before = svc.registry.pools[r.pool_id].pool.to_state()
    journal.down = True
    with pytest.raises(StoreUnavailable):
        svc.steps.step(ref, 2, *step_call([Append("a", [6])]))
    with pytest.raises(StoreUnavailable):
        svc.pools.register("w2", SHAPE)
    assert svc.reads.block_table(ref, "a") == ([0, 1], 5)  # reads still answer
    assert svc.pools.heartbeat(ref) > 0
    assert svc.registry.pools[r.pool_id].pool.to_state() == before
    journal.down = False
    assert svc.steps.step(ref, 2, *step_call([Append("a", [6])])).errors == [0]


def test_lease_expiry_drops_only_the_silent_pool():
    now = [0.0]
    svc = AllocatorService(ServiceConfig(lease_ttl_s=10), clock=lambda: now[0])
    a = svc.pools.register("a", SHAPE)
    b = svc.pools.register("b", SHAPE)
    now[0] = 8
    svc.pools.heartbeat(PoolRef(a.pool_id, a.credential))
    now[0] = 12
    assert svc.pools.expire_leases() == [b.pool_id]
    assert list(svc.registry.pools) == [a.pool_id]
    now[0] = 17.9
    assert svc.pools.expire_leases() == []
    now[0] = 18.1
    assert svc.pools.expire_leases() == [a.pool_id]


def test_failed_snapshot_backs_off():
    """A snapshot that fails is not tried again on every change: the next
    try waits 1 s, then 2 s, 4 s ... (capped at 60 s); a success resets it."""
    now = [0.0]
    journal = FakeJournal()
    svc = AllocatorService(ServiceConfig(snapshot_every=1), journal, clock=lambda: now[0])
    r = svc.pools.register("w", SHAPE)  # first snapshot: fine
    assert journal.snapshot_attempts == 1
    ref = PoolRef(r.pool_id, r.credential)
    journal.snapshot_down = True
    attempts_at = []
    for i in range(1, 41):
        now[0] = i * 0.25
        before = journal.snapshot_attempts
        svc.steps.step(ref, i, *step_call([]))
        if journal.snapshot_attempts > before:
            attempts_at.append(now[0])
    # tries at 0.25 s, then >= 1 s, >= 2 s, >= 4 s later
    assert attempts_at == [0.25, 1.25, 3.25, 7.25]
    assert svc.snapshot_failures == 4
    journal.snapshot_down = False
    now[0] = 100.0
    svc.steps.step(ref, 41, *step_call([]))
    assert journal.snapshot is not None and journal.records == []
    svc.steps.step(ref, 42, *step_call([]))
    assert journal.snapshot_attempts == 7  # 1 + 4 failed + 2: no backoff after a success


def test_prev_step_id_mismatch_drops_the_pool():
    from allocator_service.wire.errors import PoolNotFound

    journal = FakeJournal()
    svc = AllocatorService(ServiceConfig(), journal)
    r = svc.pools.register("w", SHAPE)
    ref = PoolRef(r.pool_id, r.credential)
    first = svc.steps.step(ref, 1, *step_call([Admit("a", [1, 2, 3])]), prev_step_id=0)
    assert svc.steps.step(ref, 1, *step_call([Admit("a", [1, 2, 3])]), prev_step_id=0) == first
    # The worker says it got an answer for step 2, which this server never had.
    with pytest.raises(
        PoolNotFound, match="follows step 2 but the allocator's last step for it is 1"
    ):
        svc.steps.step(ref, 3, *step_call([]), prev_step_id=2)
    assert r.pool_id not in svc.registry.pools
    again = AllocatorService(ServiceConfig(), journal)  # the drop was journaled
    assert r.pool_id not in again.registry.pools


def test_check_step_refuses_tokens_on_free_and_fork():
    limits = ServiceConfig().limits
    check_step(columns_from_proto(encode_ops([Free("a"), Append("b", [1])])), limits)
    for op in (Free("a"), Fork("a", "b")):
        cols = columns_from_proto(encode_ops([Append("x", [1]), op]))
        cols.num_tokens[1] = 1
        cols.num_tokens[0] = 0
        with pytest.raises(BadRequest, match="carry no tokens"):
            check_step(cols, limits)
