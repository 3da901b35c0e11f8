"""Each bound of `wire/bounds.py` against real encoded answers: a Step's
answer, a DumpPool answer, a pool's packed snapshot."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.core import (
    Append,
    BlockPool,
    Fork,
    Free,
    PoolConfig,
    UnknownSequence,
    Unreserve,
    run_step,
    snapshot,
    step_columns,
)
from allocator_service.wire.bounds import (
    DUMP_FRAME_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    dump_floor,
    packed_bound,
    step_answer_bound,
)
from allocator_service.wire.codec import result_to_proto
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import random_steps


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4]),
    forks=st.integers(0, 40),
    long_ids=st.booleans(),
)
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


def forked_pool(num_blocks: int = 512, block_size: int = 4, forks: int = 7) -> BlockPool:
    """One admit of every block, then forks of it, then a free: shared blocks,
    long tables and hashes, cached free blocks."""
    pool = BlockPool(PoolConfig(num_blocks, block_size, True, "m"))
    pool.admit("a", list(range(num_blocks * block_size - 3)))
    for i in range(forks):
        pool.fork("a", f"f{i}")
    pool.free("f0")
    return pool


def test_a_dump_answer_is_within_its_floor_and_frame():
    """`dump_floor` is at most the dump's text, and the DumpPool answer that
    carries it at most the text and `DUMP_FRAME_BYTES`."""
    pool = forked_pool()
    text = snapshot.dumps_chunked(pool.to_state())
    answer = pb.DumpPoolResponse(
        state_json=text, last_step_id=2**63 - 1, integrity_problems=pool.integrity_problems()
    )
    assert dump_floor(pool) <= len(text) < answer.ByteSize() <= len(text) + DUMP_FRAME_BYTES
    assert dump_floor(pool) > len(text) // 2


def test_a_packed_snapshot_is_within_its_bound():
    pool = forked_pool()
    parts = pool.parts()
    tails = sum(len(q.tail) for q in parts.seqs.values())
    text = snapshot.dumps_chunked(snapshot.to_packed(pool))
    assert len(text) <= packed_bound(
        pool.num_blocks, len(parts.seqs), pool.name_chars, 2 * pool.table_entries, tails
    )
