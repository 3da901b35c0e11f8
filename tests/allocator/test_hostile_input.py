"""Malformed and hostile requests (hypothesis) against a real server: every
answer is OK or one of the documented codes (never UNKNOWN or INTERNAL),
a rejected call changes nothing, and the pool's invariants always hold."""

from __future__ import annotations

import grpc
import pytest
import redis as redis_client
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from allocator_service.client.grpc_client import error_reason
from allocator_service.codec import (
    MAX_ERROR_MESSAGE_BYTES,
    encode_ops,
    result_to_proto,
    step_answer_bound,
)
from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    Fork,
    Free,
    PoolConfig,
    UnknownSequence,
    Unreserve,
    run_step,
    step_columns,
)
from allocator_service.core.limits import MAX_BLOCK_SIZE, MAX_FINGERPRINT_LEN
from allocator_service.rpc.server import create_server
from allocator_service.service import AllocatorService
from allocator_service.store.journal import open_journal, split_prefix
from allocator_service.v1 import allocator_pb2 as pb
from tests.support.allocator import DOCUMENTED, code_of, dump, random_steps, register, stub

C = grpc.StatusCode
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def env(allocator_server):
    with allocator_server() as server:
        s, md, channel = stub(server.address)
        ref = register(s, md, "victim", num_blocks=16, block_size=4)
        # Something to corrupt: shared blocks, a cached prefix, a fork.
        ops = [Admit("a", list(range(10))), Admit("b", list(range(9))), Fork("a", "c")]
        s.Step(pb.StepRequest(pool=ref, step_id=1, ops=encode_ops(ops)))
        yield server, s, channel, ref
        channel.close()


def check_pool(s, ref) -> dict:
    stats = s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref, check_integrity=True), timeout=10)
    assert list(stats.integrity_problems) == []
    return dump(s, None, ref)


raw_methods = st.sampled_from(
    ["Heartbeat", "DeregisterPool", "Step", "GetBlockTable", "GetPoolStats", "ResetPrefixCache",
     "MatchPrefix", "DumpPool"]
)


@FUZZ
@given(method=raw_methods, body=st.binary(max_size=200))
def test_garbage_bytes(env, method, body):
    server, s, channel, ref = env
    before = check_pool(s, ref)
    call = channel.unary_unary(f"/pagedkv.v1.Allocator/{method}")
    code = code_of(call, body, timeout=10)
    assert code in DOCUMENTED
    after = check_pool(s, ref)
    assert after == before  # garbage never names the victim pool with its credential


texts = st.one_of(st.text(max_size=20), st.sampled_from(["a", "b", "c", "", "x" * 300]))
kinds = st.lists(st.integers(0, 6), max_size=12)


hostile_ops = st.lists(
    st.one_of(
        st.builds(Admit, texts, st.lists(st.integers(0, 2**32 - 1), max_size=12),
                  st.one_of(st.none(), texts), st.one_of(st.none(), st.integers(0, 9))),
        st.builds(Append, texts, st.lists(st.integers(0, 2**32 - 1), max_size=9), st.integers(0, 3)),
        st.builds(Free, texts),
        st.builds(Fork, texts, texts),
        st.builds(Unreserve, texts, st.integers(0, 3)),
    ),
    max_size=8,
)


@st.composite
def step_requests(draw):
    """Well-formed columns with odd content, or columns that do not fit
    together."""
    if draw(st.booleans()):
        return draw(st.integers(0, 2**64 - 1)), encode_ops(draw(hostile_ops))
    n = len(draw(kinds))
    ks = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    if draw(st.booleans()):
        ks += draw(kinds)
    seqs = draw(st.lists(texts, min_size=n, max_size=n + draw(st.integers(0, 1))))
    counts = draw(st.lists(st.integers(0, 5), min_size=len(ks), max_size=len(ks)))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), max_size=sum(counts) + draw(st.integers(0, 1))))
    admits = [
        pb.AdmitOptions(cache_salt=draw(st.one_of(st.none(), texts)), num_new_tokens=draw(st.one_of(st.none(), st.integers(0, 9))))
        for _ in range(draw(st.integers(0, 3)))
    ]
    children = draw(st.lists(texts, max_size=3))
    # reservations: none, one per operation, or a column that does not fit
    reserved = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(ks), max_size=len(ks))
                    | st.lists(st.integers(0, 3), max_size=len(ks) + 1))
    ops = pb.StepOps(kinds=ks, seq_ids=seqs, num_tokens=counts, tokens=tokens, admit_options=admits,
                     fork_children=children, num_reserved=reserved)
    return draw(st.integers(0, 2**64 - 1)), ops


@FUZZ
@given(req=step_requests())
def test_hostile_steps(env, req):
    server, s, channel, ref = env
    step_id, ops = req
    before = check_pool(s, ref)
    last = s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref)).last_step_id
    if step_id > last + 1000:  # keep the step ids usable for later examples
        step_id = last + 1
    code = code_of(s.Step, pb.StepRequest(pool=ref, step_id=step_id, ops=ops), timeout=10)
    event(code.name)
    assert code in DOCUMENTED
    after = check_pool(s, ref)
    if code != C.OK:
        assert after == before


refs = st.builds(
    pb.PoolRef,
    pool_id=st.one_of(st.just("victim/1"), st.just("victim/2"), texts),
    credential=st.one_of(st.just(""), texts),
)


@FUZZ
@given(r=refs, seq=texts, tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40), salt=st.one_of(st.none(), texts))
def test_hostile_refs_and_reads(env, r, seq, tokens, salt):
    server, s, channel, ref = env
    before = check_pool(s, ref)
    for call, req in [
        (s.Heartbeat, pb.HeartbeatRequest(pool=r)),
        (s.GetBlockTable, pb.GetBlockTableRequest(pool=r, seq_id=seq)),
        (s.GetPoolStats, pb.GetPoolStatsRequest(pool=r, check_integrity=True)),
        (s.ResetPrefixCache, pb.ResetPrefixCacheRequest(pool=r)),
        (s.DumpPool, pb.DumpPoolRequest(pool=r)),
        (s.DeregisterPool, pb.DeregisterPoolRequest(pool=r)),
        (s.MatchPrefix, pb.MatchPrefixRequest(model_fingerprint=seq, tokens=tokens, cache_salt=salt)),
        (s.Step, pb.StepRequest(pool=r, step_id=1, ops=pb.StepOps())),
    ]:
        assert code_of(call, req, timeout=10) in DOCUMENTED
    assert check_pool(s, ref) == before


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    worker=texts,
    num_blocks=st.integers(0, 80),
    block_size=st.integers(0, 5000),
    fingerprint=st.one_of(texts, st.just("f" * 1025)),
)
def test_hostile_registrations(env, worker, num_blocks, block_size, fingerprint):
    server, s, channel, ref = env
    shape = pb.PoolShape(num_blocks=num_blocks, block_size=block_size, model_fingerprint=fingerprint)
    if worker == "victim":
        worker = "not-the-victim"
    try:
        s.RegisterPool(pb.RegisterPoolRequest(worker_id=worker, shape=shape), timeout=10)
        code, reason = C.OK, ""
    except grpc.RpcError as err:
        code, reason = err.code(), error_reason(err)
    assert code in DOCUMENTED
    valid = 1 <= num_blocks and 1 <= block_size <= MAX_BLOCK_SIZE and len(fingerprint) <= MAX_FINGERPRINT_LEN
    valid = valid and 1 <= len(worker) <= 128 and "/" not in worker and worker.isprintable()
    # A worker id registered by an earlier example is live: refused without its credential.
    assert (code == C.OK or reason == "pool_in_use") == valid
    check_pool(s, ref)


def test_watch_from_anywhere(env):
    server, s, channel, ref = env
    for start in (1, 2, 10**12):
        stream = s.WatchEvents(pb.WatchEventsRequest(from_sequence=start), timeout=3)
        first = next(stream)
        stream.cancel()
        assert first.sequence >= 1
        if start == 10**12:
            assert first.kind == pb.KV_EVENT_KIND_RESYNC_REQUIRED


def test_a_step_whose_answer_cannot_fit_the_wire_is_refused_before_it_is_applied(redis_store):
    """FORK x 300 of a 2,000-block sequence: an answer of 600,000 block ids,
    more than the largest message (lowered here to 1 MiB; 16 MiB by
    default, as a 2^19-block pool would need). It is refused with
    RESOURCE_EXHAUSTED before anything is journaled: the pool's state, its
    last step and the journal in Redis are as before, and the step id is
    still free. Fewer forks of the same sequence are applied."""
    with redis_store() as (url, _):
        limit = 1 << 20
        service = AllocatorService(ServiceConfig(limits=Limits(max_message_bytes=limit), snapshot_every=1 << 20),
                                   open_journal(url))
        server, port = create_server("127.0.0.1:0", service)
        server.start()
        s, md, channel = stub(f"127.0.0.1:{port}")
        plain, prefix = split_prefix(url)
        r = redis_client.Redis.from_url(plain)
        try:
            ref = register(s, md, "forker", num_blocks=65536, block_size=1)
            s.Step(pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Admit("p", list(range(2000)))])), timeout=30)
            journal = r.lrange(prefix + "journal", 0, -1), r.get(prefix + "head")

            def state():  # (the pool's dump would not fit the lowered limit either)
                stats = s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref, check_integrity=True), timeout=30)
                table = s.GetBlockTable(pb.GetBlockTableRequest(pool=ref, seq_id="p"), timeout=10)
                child = code_of(s.GetBlockTable, pb.GetBlockTableRequest(pool=ref, seq_id="c0"), timeout=10)
                return stats, list(table.block_ids), child

            before = state()
            assert before[0].num_sequences == 1 and before[1] == list(range(2000)) and before[2] == C.NOT_FOUND
            with pytest.raises(grpc.RpcError) as too_big:  # refused by the allocator, in one line
                s.DumpPool(pb.DumpPoolRequest(pool=ref), metadata=md, timeout=30)
            assert too_big.value.code() == C.RESOURCE_EXHAUSTED and error_reason(too_big.value) == "answer_too_large"
            assert "dump takes" in too_big.value.details() and "GetBlockTable" in too_big.value.details()
            attack = encode_ops([Fork("p", f"c{i}") for i in range(300)])
            with pytest.raises(grpc.RpcError) as refused:
                s.Step(pb.StepRequest(pool=ref, step_id=2, ops=attack, prev_step_id=1), timeout=60)
            assert refused.value.code() == C.RESOURCE_EXHAUSTED
            assert (r.lrange(prefix + "journal", 0, -1), r.get(prefix + "head")) == journal
            assert state() == before and before[0].last_step_id == 1
            assert error_reason(refused.value) == "answer_too_large"
            # the step id is free, and a step whose answer fits is applied
            fits = encode_ops([Fork("p", f"c{i}") for i in range(100)])
            answer = s.Step(pb.StepRequest(pool=ref, step_id=2, ops=fits, prev_step_id=1), timeout=60)
            assert list(answer.num_appended) == [2000] * 100 and answer.ByteSize() <= limit
            assert s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref), timeout=10).num_sequences == 101
        finally:
            r.close()
            channel.close()
            server.stop(0).wait()
            service.close()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]), forks=st.integers(0, 40),
       long_ids=st.booleans())
def test_the_answer_bound_holds_for_every_step(seed, block_size, forks, long_ids):
    """`step_answer_bound` before a step is at least the encoded size of
    the answer it gets: mixed workloads (admits, appends with reserved
    slots, copy-on-write, unreserves, frees, failures), then a step of
    forks of forks; failing operations named by long ids (their reasons
    are cut to MAX_ERROR_MESSAGE_BYTES)."""
    pool = BlockPool(PoolConfig(256, block_size, True, "m"))

    def held(seq):
        try:
            return pool.num_tokens(seq)
        except UnknownSequence:
            return None

    def check(ops) -> pb.StepResponse:
        step = step_columns(ops)
        bound = step_answer_bound(step, pool.num_blocks, pool.block_size, held)
        answer = result_to_proto(1, run_step(pool, step))
        assert answer.ByteSize() <= bound
        assert all(len(m.encode()) <= MAX_ERROR_MESSAGE_BYTES for m in answer.error_messages)
        return answer

    steps = random_steps(seed, 12)
    for ops in steps:
        check(ops)
    live = [seq for seq in pool.tables()] or ["none"]
    chain = [Fork(live[i % len(live)] if i % 3 else f"k{i - 1}", f"k{i}") for i in range(forks)]
    check([Append(live[0], [1, 2, 3]), *chain])
    ghost = ("\u2603" * 256) if long_ids else "ghost"
    answer = check([Free(ghost), Append(ghost, [1]), Unreserve(ghost, 1), Fork(ghost, "x")])
    assert list(answer.errors) == [pb.OP_ERROR_UNKNOWN_SEQUENCE] * 4
