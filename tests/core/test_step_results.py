"""`StepAnswer`, a step's answer: however it is read (index, negative
index, slice, iteration, the per-operation accessors), operation i's view
holds exactly its slices of the columns, for random workloads that include
failures, copy-on-write copies, forks and admissions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.core import BlockPool, PoolConfig, run_step, step_columns
from allocator_service.core.step import ERROR_CODE
from tests.support.allocator import random_steps


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), caching=st.booleans(), block_size=st.sampled_from([1, 2, 4]))
def test_a_step_answer_reads_its_columns(seed, caching, block_size):
    pool = BlockPool(PoolConfig(24, block_size, caching, "m"))
    for ops in random_steps(seed=seed, steps=25):
        got = run_step(pool, step_columns(ops))
        want = list(got)
        assert len(got) == len(want) == len(ops)
        assert got == want
        assert [got[i] for i in range(len(got))] == want
        assert [got[-i] for i in range(1, len(got) + 1)] == want[::-1]
        assert got[1:] == want[1:] and got[::2] == want[::2]
        assert got.all_ok == all(r.ok for r in want)
        # the views partition the flat columns, in order
        assert [b for r in want for b in r.append] == got.appended
        assert [x for r in want for c in r.copies for x in c] == got.copies
        assert [r.message for r in want if not r.ok] == got.error_messages
        for i, r in enumerate(want):
            assert got.appended_of(i) == r.append and len(r.append) == got.num_appended[i]
            assert got.copies_of(i) == r.copies and len(r.copies) == got.num_copies[i]
            assert (r.ok, r.keep, r.cached_tokens, r.num_stored) == (
                got.errors[i] == 0,
                got.keep[i],
                got.cached_tokens[i],
                got.num_stored[i],
            )
            assert r.error == (ERROR_CODE[got.errors[i]] if got.errors[i] else "")
        with pytest.raises(IndexError):
            got[len(want)]
