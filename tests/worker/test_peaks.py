"""The worker's high-water marks (`pagedkv_worker_*_peak`): raised at every
engine step, so a run's peak is there however briefly it lasted and whenever
/metrics is read; `reset()` (POST /reset_peaks) starts them again."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.sequence import kv_in_use
from worker.model.loader import load_model

PEAKS = (
    "pagedkv_worker_kv_blocks_used_peak",
    "pagedkv_worker_kv_slots_holding_tokens_peak",
    "pagedkv_worker_running_sequences_peak",
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def _gauges(engine: LLMEngine) -> tuple[float, ...]:
    text = generate_latest(engine.metrics.registry).decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return tuple(values[name] for name in PEAKS)


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(3, 30), st.integers(1, 12), st.integers(1, 2)), min_size=1, max_size=6
    ),
    num_blocks=st.integers(12, 40),
    caching=st.booleans(),
)
def test_peaks_are_the_pools_most_at_any_step(tiny, lengths, num_blocks, caching):
    """Synchronous steps with no lookahead: after each step the allocator holds
    exactly the blocks of the sequences that step ran (the finished ones are
    freed first in the next call), so the most it held at any step is the
    peak; read after the run, when the pool is empty again, it is still there.
    The running peak lies between the most running at the end of a step and
    the most sequences the allocator held (a parent whose samples forked is
    held one call longer)."""
    engine = LLMEngine(
        tiny,
        EngineConfig(
            num_blocks=num_blocks,
            block_size=4,
            async_scheduling=False,
            num_lookahead_slots=0,
            enable_prefix_caching=caching,
        ),
    )
    system = list(range(10, 18))  # a shared prefix: blocks shared, counted once
    for i, (prompt, out, n) in enumerate(lengths):
        engine.add_request(
            system + [(7 * i + j) % 250 + 3 for j in range(prompt)],
            SamplingParams(max_tokens=out, n=n, temperature=1.0, seed=i, ignore_eos=True),
        )
    blocks = slots = held = running = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.allocator.stats()
        blocks, slots = max(blocks, s.used_blocks), max(slots, s.tokens_stored)
        held, running = max(held, s.num_sequences), max(running, engine.num_running())
    assert engine.allocator.stats().used_blocks == 0  # what a poll after the run would see
    peaks = engine.metrics.peaks.values()
    assert (peaks.kv_blocks_used, peaks.kv_slots_holding_tokens) == (blocks, slots) and blocks > 0
    assert running <= peaks.running_sequences <= held
    assert _gauges(engine) == tuple(peaks)
    assert engine.metrics.peaks.reset() == peaks
    assert _gauges(engine) == (0, 0, 0)
    engine.close()


def test_a_reset_peak_rises_with_the_next_run_only(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.generate([list(range(3, 40))], params)  # a long one
    big = engine.metrics.peaks.reset()
    engine.generate([[5, 6, 7]], params)  # a short one
    small = engine.metrics.peaks.values()
    assert 0 < small.kv_blocks_used < big.kv_blocks_used and small.running_sequences == 1
    # at least every token the sequence computed, in blocks of 4
    assert small.kv_slots_holding_tokens >= 3 + 20 - 1 and small.kv_blocks_used >= -(
        -(3 + 20 - 1) // 4
    )
    engine.close()


def test_kv_in_use_counts_a_shared_block_once():
    class S:  # the two fields it reads
        def __init__(self, table, held):
            self.block_table, self.num_held = table, held

    assert kv_in_use([S([0, 1, 2], 10), S([0, 1, 5], 11), S([], 0)], 4) == (4, 4 + 4 + 2 + 3)
    assert kv_in_use([S([7], 3), S([7], 3)], 4) == (1, 3)  # a forked, partly filled last block
