"""The log verifies itself, on real processes (a real redis-server on its
own port): a flipped byte, a removed middle record and a lost tail are each
detected (by `--check` too) and never double-book a block; a record that
cannot be pinned on one pool stops start-up with one line; older journals
without digests still load; with a journal key an edited record is caught.
(Redis itself losing data, evicting, or waiting for a replica:
tests/allocator/test_log_redis.py.)"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError

from allocator_service.client import EmbeddedAllocator, PoolLost, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, PoolConfig
from allocator_service.store.framing import (
    ENTRY_MAGIC,
    ZERO_CHAIN,
    chain_digest,
    encode_entry,
    head_marker,
)
from allocator_service.wire.codec import PROTOCOL_VERSION, encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import journal_pb2 as jpb
from tests.support.allocator import code_of, dump, random_steps, register, stub
from tests.support.state_store import keys, run_check, start_fails

C = grpc.StatusCode
STEPS = 12


def two_pools(url: str, allocator_server):
    """Two pools, STEPS steps each, interleaved, every record in the journal
    (no snapshot): (refs, their dumps, the journal entries, the server's port)."""
    with allocator_server("--state", url) as server:
        s, md, channel = stub(server.address)
        refs = [register(s, md, f"w{i}", num_blocks=24) for i in range(2)]
        workloads = [random_steps(seed=20 + i, steps=STEPS) for i in range(2)]
        for n in range(STEPS):
            for ref, steps in zip(refs, workloads, strict=True):
                s.Step(
                    pb.StepRequest(
                        pool=ref, step_id=n + 1, ops=encode_ops(steps[n]), prev_step_id=n
                    )
                )
        before = {r.pool_id: dump(s, md, r) for r in refs}
        channel.close()
        server.kill()
    client, prefix = keys(url)
    entries = client.lrange(prefix + "journal", 0, -1)
    client.close()
    assert all(e.startswith(ENTRY_MAGIC) for e in entries) and len(entries) == 2 + 2 * STEPS
    return refs, before, entries, workloads


def record_of(entry: bytes) -> jpb.JournalRecord:
    return jpb.JournalRecord.FromString(entry[68:])


def flip_an_operation_bit(entry: bytes) -> bytes:
    """`entry` with one bit flipped inside its step's operations, the last
    such bit whose record still parses with everything else unchanged."""
    good = record_of(entry).step
    for i in range(len(entry) - 1, 68, -1):
        bad = bytearray(entry)
        bad[i] ^= 0x01
        try:
            step = record_of(bytes(bad)).step
        except DecodeError:
            continue
        same = (step.pool_id, step.step_id, step.digest, step.prev_step_id)
        if (
            same == (good.pool_id, good.step_id, good.digest, good.prev_step_id)
            and step.ops != good.ops
        ):
            return bytes(bad)
    raise AssertionError("no bit of the operations can flip with the record still parsing")


def position_of_step(entries, pool_id: str, step_id: int) -> int:
    for i, e in enumerate(entries):
        r = record_of(e)
        if (
            r.WhichOneof("change") == "step"
            and r.step.pool_id == pool_id
            and r.step.step_id == step_id
        ):
            return i
    raise AssertionError((pool_id, step_id))


def assert_sound_after_restart(url, allocator_server, refs, before, lost: str):
    """The damaged pool is gone (NOT_FOUND), the other is exactly as before;
    a second start finds a sound journal (the repair was stored)."""
    with allocator_server("--state", url) as server:
        s, md, channel = stub(server.address)
        for r in refs:
            if r.pool_id == lost:
                assert code_of(s.GetPoolStats, pb.GetPoolStatsRequest(pool=r)) == C.NOT_FOUND
            else:
                assert dump(s, md, r) == before[r.pool_id]
        # Its worker registers again: a new epoch, never the dropped id.
        again = register(s, md, lost.split("/")[0], num_blocks=24)
        assert again.pool_id == lost.split("/")[0] + "/2"
        channel.close()
        log = "\n".join(server.lines)
    assert f"pool {lost} dropped" in log
    code, out = run_check(url)
    assert code == 0 and "verdict: sound" in out, out
    return log


def test_flipped_byte_drops_that_pool_only(store, allocator_server):
    url, _ = store
    refs, before, entries, _ = two_pools(url, allocator_server)
    victim = refs[0].pool_id
    pos = position_of_step(entries, victim, 5)
    bad = flip_an_operation_bit(entries[pos])  # still parses, fails its digest
    client, prefix = keys(url)
    client.lset(prefix + "journal", pos, bad)
    client.close()

    code, out = run_check(url)
    assert code == 1, out
    assert f"journal entry {pos} (record {pos + 1}): fails its digest; pool {victim} dropped" in out
    assert "verdict: NOT sound" in out and "FATAL" not in out
    log = assert_sound_after_restart(url, allocator_server, refs, before, victim)
    assert "journal check:" in log
    # Every later record of the dropped pool was skipped, loudly.
    assert f"names pool {victim}, lost with an earlier record: skipped" in log


def test_removed_middle_record_is_a_gap_and_breaks_the_step_chain(store, allocator_server):
    url, _ = store
    refs, before, entries, _ = two_pools(url, allocator_server)
    victim = refs[1].pool_id
    pos = position_of_step(entries, victim, 4)
    client, prefix = keys(url)
    client.lset(prefix + "journal", pos, b"__gone__")
    client.lrem(prefix + "journal", 1, b"__gone__")
    client.close()

    code, out = run_check(url)
    assert code == 1, out
    assert f"records {pos + 1}..{pos + 1} are missing" in out
    assert f"step 5 follows step 4 but the pool's last step is 3; pool {victim} dropped" in out
    assert_sound_after_restart(url, allocator_server, refs, before, victim)


def test_lost_tail_is_reported_and_the_worker_gets_pool_lost(store, allocator_server):
    """Redis loses the last record (here RPOP; in production a failover to a
    lagging replica or a restart without its append-only file): the
    allocator's state is one step behind the worker's. The worker's next
    step names the step it got an answer for; the allocator drops the pool
    instead of handing out a block the worker still uses."""
    url, _ = store
    spec = PoolSpec("tail", PoolConfig(16, 4, True, "m"))
    steps = random_steps(seed=9, steps=12)
    with allocator_server("--state", url) as server:
        port = server.port
        worker = GrpcAllocator(
            server.address, spec, retries=30, backoff_s=0.02, deadline_s=2, heartbeat=False
        )
        for ops in steps[:8]:
            worker.step(ops)
        server.kill()
    client, prefix = keys(url)
    last = record_of(client.rpop(prefix + "journal"))
    client.close()
    assert last.step.step_id == 8

    code, out = run_check(url)
    assert code == 1 and "the last 1 record(s) were lost" in out, out
    with allocator_server("--state", url, listen=f"127.0.0.1:{port}") as again:
        s, md, channel = stub(again.address)
        old = pb.PoolRef(pool_id=worker.pool_id, credential=worker._ref.credential)
        assert s.GetPoolStats(pb.GetPoolStatsRequest(pool=old)).last_step_id == 7
        with pytest.raises(PoolLost):
            worker.step(steps[8])
        assert worker.pool_id == "tail/2"
        assert code_of(s.GetPoolStats, pb.GetPoolStatsRequest(pool=old)) == C.NOT_FOUND
        # The fresh pool serves the recomputed work exactly as a fresh core would.
        reference = EmbeddedAllocator(spec)
        for ops in steps[:4]:
            assert worker.step(ops) == reference.step(ops)
        assert worker.integrity_problems() == []
        channel.close()
        log = "\n".join(again.lines)
    assert "its worker follows step 8 but the allocator's last step for it is 7" in log
    assert "Traceback" not in log


def test_a_client_of_this_version_cannot_omit_prev_step_id_and_double_book(store, allocator_server):
    """A pool registered with this protocol version must name prev_step_id
    in every Step: after Redis lost the journal's tail (the step that gave
    `b` its blocks), a Step without it is refused (INVALID_ARGUMENT) and
    changes nothing, so `c` is never handed `b`'s blocks; with it, the
    lost tail is caught (NOT_FOUND, the pool dropped). A pool registered
    without a version (older clients) is not held to it."""
    url, _ = store
    with allocator_server("--state", url) as server:
        port = server.port
        s, md, channel = stub(server.address)
        r = s.RegisterPool(
            pb.RegisterPoolRequest(
                worker_id="w",
                shape=pb.PoolShape(num_blocks=8, block_size=4, model_fingerprint="m"),
                protocol_version=PROTOCOL_VERSION,
            ),
            timeout=10,
        )
        ref = pb.PoolRef(pool_id=r.pool_id, credential=r.credential)
        s.Step(
            pb.StepRequest(
                pool=ref, step_id=1, ops=encode_ops([Admit("a", list(range(8)))]), prev_step_id=0
            )
        )
        b = s.Step(
            pb.StepRequest(
                pool=ref, step_id=2, ops=encode_ops([Admit("b", list(range(8)))]), prev_step_id=1
            )
        )
        held_by_b = set(b.appended)
        channel.close()
        server.kill()
    client, prefix = keys(url)
    assert record_of(client.rpop(prefix + "journal")).step.step_id == 2  # the tail is lost
    with allocator_server("--state", url, listen=f"127.0.0.1:{port}") as again:
        s, md, channel = stub(again.address)
        journal = client.lrange(prefix + "journal", 0, -1)
        admit_c = encode_ops([Admit("c", list(range(100, 108)))])
        with pytest.raises(grpc.RpcError) as refused:
            s.Step(pb.StepRequest(pool=ref, step_id=3, ops=admit_c))
        assert (
            refused.value.code() == C.INVALID_ARGUMENT and "prev_step_id" in refused.value.details()
        )
        assert client.lrange(prefix + "journal", 0, -1) == journal
        stats = s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref, check_integrity=True))
        assert (stats.last_step_id, stats.num_sequences, stats.used_blocks) == (1, 1, 2)
        assert (
            code_of(s.GetBlockTable, pb.GetBlockTableRequest(pool=ref, seq_id="c")) == C.NOT_FOUND
        )
        assert not held_by_b & set(
            s.GetBlockTable(pb.GetBlockTableRequest(pool=ref, seq_id="a")).block_ids
        )
        # named, the lost tail is caught: the pool is dropped, the worker re-registers
        assert (
            code_of(s.Step, pb.StepRequest(pool=ref, step_id=3, ops=admit_c, prev_step_id=2))
            == C.NOT_FOUND
        )
        assert code_of(s.GetPoolStats, pb.GetPoolStatsRequest(pool=ref)) == C.NOT_FOUND
        # an older client's pool: prev_step_id may be left out
        old = register(s, md, "older")
        assert code_of(s.Step, pb.StepRequest(pool=old, step_id=1, ops=admit_c)) == C.OK
        channel.close()
    client.close()


def test_prev_step_id_keeps_retries_idempotent(store, allocator_server):
    url, _ = store
    with allocator_server("--state", url) as server:
        s, md, channel = stub(server.address)
        ref = register(s, md, "r", num_blocks=24)
        ops = encode_ops(random_steps(seed=1, steps=2)[0])
        first = s.Step(pb.StepRequest(pool=ref, step_id=1, ops=ops, prev_step_id=0))
        # A retry of the last step (its answer was lost) carries the same
        # prev_step_id: the first answer, applied once.
        assert s.Step(pb.StepRequest(pool=ref, step_id=1, ops=ops, prev_step_id=0)) == first
        # An older client sends no prev_step_id: not checked.
        s.Step(pb.StepRequest(pool=ref, step_id=2, ops=encode_ops([])))
        assert s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref)).last_step_id == 2
        channel.close()


def test_unattributable_damage_stops_start_with_one_line(store, allocator_server):
    url, _ = store
    _, _, entries, _ = two_pools(url, allocator_server)
    bad = bytearray(entries[0])  # the first registration
    bad[-1] ^= 0x01
    client, prefix = keys(url)
    client.lset(prefix + "journal", 0, bytes(bad))
    client.close()
    code, out = run_check(url)
    assert (
        code == 1
        and "FATAL journal entry 0 (record 1): fails its digest and cannot be attributed" in out
    )
    code, out = start_fails(url)
    assert code == 1, out
    lines = [line for line in out.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and "--check" in lines[0] and "docs/operations.md" in lines[0], out
    # the recovery the line points at is there
    section = "A journal that cannot be replayed"
    assert section in lines[0]
    assert (
        f"### {section}"
        in (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    )


def test_older_journal_without_digests_still_loads(store, allocator_server):
    url, _ = store
    refs, before, entries, _ = two_pools(url, allocator_server)
    client, prefix = keys(url)
    client.delete(prefix + "journal", prefix + "head")
    client.rpush(prefix + "journal", *[e[68:] for e in entries])  # bare records, as before
    client.close()
    code, out = run_check(url)
    assert code == 0 and f"{len(entries)} without digests" in out, out
    with allocator_server("--state", url, env={"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "1"}) as server:
        s, md, channel = stub(server.address)
        for r in refs:
            assert dump(s, md, r) == before[r.pool_id]
        # New records are framed and chained after the old ones.
        s.Step(
            pb.StepRequest(pool=refs[0], step_id=STEPS + 1, ops=encode_ops([]), prev_step_id=STEPS)
        )
        channel.close()
        log = "\n".join(server.lines)
    assert "written by an older version" in log
    code, out = run_check(url)
    assert code == 0, out


def test_with_a_journal_key_an_edited_record_with_a_recomputed_chain_is_caught(
    store, allocator_server, tmp_path
):
    """Someone who can write to Redis but has not the journal key edits a
    step record (its operations), recomputes the SHA-256 chain over every
    later record and the head: `--check` with the key finds it, and the
    allocator drops that pool. A forged snapshot is refused too. The same
    journal read without the key is refused in one line, not trusted."""
    url, _ = store
    key_file = tmp_path / "journal-key"
    key_file.write_text("k" * 43 + "\n")
    keyed = {"PAGEDKV_ALLOCATOR_JOURNAL_KEY_FILE": str(key_file)}
    with allocator_server("--state", url, env=keyed) as server:
        s, md, channel = stub(server.address)
        refs = [register(s, md, f"w{i}", num_blocks=24) for i in range(2)]
        for n in range(4):
            for i, ref in enumerate(refs):
                s.Step(
                    pb.StepRequest(
                        pool=ref,
                        step_id=n + 1,
                        ops=encode_ops(random_steps(seed=30 + i, steps=4)[n]),
                        prev_step_id=n,
                    )
                )
        channel.close()
        server.kill()
    code, out = run_check(url, keyed)
    assert code == 0 and "verdict: sound" in out, out
    client, prefix = keys(url)
    entries = client.lrange(prefix + "journal", 0, -1)
    # the forger's edit: step 1 of w0 admits other tokens; the chain recomputed from there on
    target = next(i for i, e in enumerate(entries) if record_of(e).WhichOneof("change") == "step")
    record = record_of(entries[target])
    assert record.step.pool_id == refs[0].pool_id
    record.step.ops.tokens[0] ^= 1
    forged = list(entries)
    chain = entries[target][4:36]
    for i in range(target, len(entries)):
        body = record.SerializeToString() if i == target else entries[i][68:]
        chain_next = chain_digest(chain, body)
        forged[i] = entries[i][:4] + chain + chain_next + body  # the stored magic kept
        chain = chain_next
    client.delete(prefix + "journal")
    client.rpush(prefix + "journal", *forged)
    client.set(prefix + "head", head_marker(len(entries), chain))
    code, out = run_check(url, keyed)
    assert code == 1 and "fails its digest" in out and refs[0].pool_id in out, out
    assert "journal key: yes" in out
    # without the key: a keyed journal is not read as if Redis were trusted
    code, out = run_check(url)
    assert code == 1 and "no journal key is configured" in out, out
    # every record after the edit fails: nothing to trust, no start
    code, out = start_fails(url, keyed)
    assert code == 1 and "cannot start" in out and "fails its digest" in out, out
    # a snapshot written without the key is refused too
    client.delete(prefix + "journal", prefix + "head", prefix + "snapshot")
    with allocator_server(
        "--state", url, env={**keyed, "PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "1"}
    ) as server:
        s, md, channel = stub(server.address)
        ref = register(s, md, "w")
        deadline = time.monotonic() + 30
        n = 0
        while client.get(prefix + "snapshot") is None and time.monotonic() < deadline:
            n += 1  # written off the hot path, after later changes
            s.Step(pb.StepRequest(pool=ref, step_id=n, ops=encode_ops([]), prev_step_id=n - 1))
            time.sleep(0.05)
        channel.close()
        server.kill()
    snapshot = client.get(prefix + "snapshot")
    assert snapshot.startswith(b"PKS3") and run_check(url, keyed)[0] == 0
    body = snapshot[36:]
    client.set(prefix + "snapshot", b"PKS2" + hashlib.sha256(body).digest() + body)
    code, out = run_check(url, keyed)
    assert code == 1 and "not keyed with the journal key" in out, out
    client.close()


def test_new_record_links_to_snapshot_chain():
    """The frame: a record's chain digest covers the one before it."""
    e1, c1 = encode_entry(ZERO_CHAIN, b"a")
    e2, c2 = encode_entry(c1, b"b")
    assert e2[4:36] == c1 and e2[36:68] == c2 and c1 != c2
