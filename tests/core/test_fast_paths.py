"""The core's fast paths against its plain rules.

`BlockPool.try_append` (an append whose slots fit in the sequence's private
last block) and the packed hash chain are shortcuts. A pool whose
`try_append` always declines applies every append by the general rule; the
same random steps (admits with and without reserved slots, decode appends
of one and several tokens filling reserved slots and reserving more,
unreserves, forks, frees, bad input) through both give identical answers
and identical state (tables, refcounts, free queues, hashes) after every
step.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_service.core import BlockPool, PoolConfig
from allocator_service.core.step import Admit, Append, Fork, Free, Unreserve, run_step, step_columns


class PlainPool(BlockPool):
    """Every append by the general rule."""

    def try_append(self, seq_id, tokens, reserve=0, checked=False) -> int:
        return -1


def _ops(rng, live: list[str], serial: list[int]) -> list:
    ops = []
    for _ in range(rng.randrange(1, 7)):
        r = rng.random()
        if r < 0.2 or not live:
            serial[0] += 1
            seq = f"s{serial[0]}"
            live.append(seq)
            ops.append(
                Admit(
                    seq,
                    [rng.randrange(3) for _ in range(rng.randrange(0, 12))],
                    reserve=rng.choice([0, 0, 1, 3]),
                )
            )
        elif r < 0.7:
            tokens = [rng.randrange(3) for _ in range(rng.choice([1, 1, 1, 2, 3, 8]))]
            if rng.random() < 0.03:
                tokens = [-1] if rng.random() < 0.5 else [True]
            ops.append(Append(rng.choice(live), tokens, reserve=rng.choice([0, 0, 1, 1, 2, 8])))
        elif r < 0.78:
            ops.append(Unreserve(rng.choice(live), rng.choice([1, 2])))
        elif r < 0.85:
            serial[0] += 1
            child = f"s{serial[0]}"
            live.append(child)
            ops.append(Fork(rng.choice(live[:-1]) if len(live) > 1 else "ghost", child))
        else:
            seq = rng.choice(live)
            live.remove(seq)
            ops.append(Free(seq))
    return ops


@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(2, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    caching=st.booleans(),
)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_append_answers_and_state_are_the_plain_rules(seed, num_blocks, block_size, caching):
    import random

    rng = random.Random(seed)
    config = PoolConfig(num_blocks, block_size, caching, "m")
    fast, plain = BlockPool(config), PlainPool(config)
    live: list[str] = []
    serial = [0]
    for _ in range(40):
        step = step_columns(_ops(rng, live, serial))
        assert run_step(fast, step) == run_step(plain, step)
        assert fast.to_state() == plain.to_state()
    assert fast.check_integrity()
