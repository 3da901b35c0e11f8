"""`StepResults`, the clients' answer to a step: the sequence of `OpResult`s
read from the result columns must be exactly the list `op_results` builds,
however it is read (index, negative index, slice, iteration, the column
accessors), for random workloads that include failures, copy-on-write
copies, forks and admissions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.core import (
    BlockPool,
    PoolConfig,
    StepResults,
    op_results,
    run_step,
    step_columns,
)
from tests.support.allocator import random_steps


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), caching=st.booleans(), block_size=st.sampled_from([1, 2, 4]))
def test_step_results_read_as_op_results(seed, caching, block_size):
    pool = BlockPool(PoolConfig(24, block_size, caching, "m"))
    for ops in random_steps(seed=seed, steps=25):
        columns = run_step(pool, step_columns(ops))
        want = op_results(columns)
        got = StepResults(columns)
        assert len(got) == len(want)
        assert got == want and list(got) == want
        assert [got[i] for i in range(len(got))] == want
        assert [got[-i] for i in range(1, len(got) + 1)] == want[::-1]
        assert got[1:] == want[1:] and got[::2] == want[::2]
        assert got.all_ok == all(r.ok for r in want)
        for i, r in enumerate(want):
            assert got.appended(i) == r.append
            assert got.copies(i) == r.copies
            assert (columns.errors[i] == 0) == r.ok
        with pytest.raises(IndexError):
            got[len(want)]
