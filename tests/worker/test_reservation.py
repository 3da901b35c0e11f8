"""Reservation baselines (`EngineConfig.kv_reservation`): each request's
block table at admission holds exactly the slots its mode reserves (`max`,
`pow2`, `oracle`; `paged` only its prompt), through the embedded allocator
and the gRPC one; a reservation is never outgrown, and greedy outputs are
the paged engine's."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_service.core.blocks import blocks_for
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.reservation import RESERVATIONS, reserved_slots
from worker.model.loader import load_model

B = 4
MAX_LEN = 64  # the context length: what `max` reserves
# (prompt tokens, max_tokens) of three requests, admitted in this order
REQUESTS = [(5, 7), (9, 20), (3, 2)]
# The tables a fresh pool (free queue 0, 1, 2, ...) gives them at admission, by hand:
# paged holds the prompt: 5, 9, 3 tokens -> 2, 3, 1 blocks;
# oracle holds prompt + output: 12, 29, 5 slots -> 3, 8, 2 blocks;
# pow2 the next power of two of that: 16, 32, 8 slots -> 4, 8, 2 blocks;
# max the context length: 64 slots -> 16 blocks each.
TABLES = {
    "paged": [[0, 1], [2, 3, 4], [5]],
    "oracle": [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12]],
    "pow2": [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12, 13]],
    "max": [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))],
}
HELD = {"paged": [5, 9, 3], "oracle": [12, 29, 5], "pow2": [16, 32, 8], "max": [64, 64, 64]}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def make(tiny, mode: str, **kw) -> LLMEngine:
    cfg = {
        "num_blocks": 256,
        "block_size": B,
        "max_model_len": MAX_LEN,
        "enable_prefix_caching": False,
        "kv_reservation": mode,
        **kw,
    }
    return LLMEngine(tiny, EngineConfig(**cfg))


def submit(engine: LLMEngine, requests) -> list:
    for i, (prompt, out) in enumerate(requests):
        engine.add_request(
            [10 + i] * prompt,
            SamplingParams(max_tokens=out, temperature=0, ignore_eos=True),
            request_id=f"r{i}",
        )
    return list(engine.scheduler.waiting)


def finish(engine: LLMEngine, seqs) -> dict[str, list[int]]:
    """Step to the end; with a reservation, every table stays the one it
    was admitted with. The outputs."""
    tables = {s.request_id: list(s.block_table) for s in seqs if s.block_table}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        for s in engine.scheduler.running:
            table = tables.setdefault(s.request_id, list(s.block_table))
            if engine.config.kv_reservation != "paged":
                assert s.block_table == table, "a reservation was outgrown"
    assert engine.allocator.stats().used_blocks == 0
    return outputs


@pytest.mark.parametrize("mode", RESERVATIONS)
@pytest.mark.parametrize("allocator", ["embedded", "grpc"])
def test_admission_holds_the_reserved_slots_exactly(tiny, mode, allocator, allocator_server):
    server = allocator_server() if allocator == "grpc" else None
    try:
        # (no call sent ahead: the allocator's state is the admission's)
        engine = make(
            tiny, mode, allocator=server.address if server else "embedded", async_scheduling=False
        )
        try:
            seqs = submit(engine, REQUESTS)
            engine.step()  # admits all three, in order
            assert [s.block_table for s in seqs] == TABLES[mode]
            assert [s.num_held for s in seqs] == HELD[mode]
            # The allocator's own tables and slot counts are the same.
            alloc = engine.allocator
            assert [alloc.block_table(s.alloc_id) for s in seqs] == TABLES[mode]
            dumped = alloc.dump()["seqs"]
            assert [dumped[s.alloc_id]["num_tokens"] for s in seqs] == HELD[mode]
            outputs = finish(engine, seqs)
            assert [len(outputs[f"r{i}"]) for i in range(3)] == [out for _, out in REQUESTS]
        finally:
            engine.close()
    finally:
        if server is not None:
            server.terminate()


def test_a_chunked_admission_reserves_past_the_chunk(tiny):
    """A prompt longer than the step's token budget stores a chunk; the
    rest of the prompt and the output are all within the reservation."""
    engine = make(tiny, "oracle", max_num_batched_tokens=8, async_scheduling=False)
    [seq] = submit(engine, [(13, 6)])  # 19 slots -> 5 blocks
    engine.step()
    assert seq.block_table == [0, 1, 2, 3, 4]
    assert (seq.num_stored, seq.num_held, seq.num_reserved) == (8, 19, 11)
    state = engine.allocator.dump()["seqs"][seq.alloc_id]
    assert (state["table"], state["num_tokens"], state["reserved"]) == ([0, 1, 2, 3, 4], 19, 11)
    finish(engine, [seq])


def test_outputs_equal_the_paged_engine(tiny):
    requests = [(7, 9), (2, 15), (11, 4), (5, 5)]
    reference = finish(e := make(tiny, "paged"), submit(e, requests))
    for mode in ("max", "pow2", "oracle"):
        engine = make(tiny, mode)
        assert finish(engine, submit(engine, requests)) == reference


def test_a_reservation_needs_prefix_caching_off():
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(kv_reservation="oracle", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_reservation"):
        EngineConfig(kv_reservation="pow3")


@given(prompt=st.integers(1, 3000), out=st.integers(1, 3000), most=st.integers(2, 8192))
def test_every_mode_holds_what_the_request_can_compute(prompt, out, most):
    """Whatever fits the context (prompt + output <= most), each mode holds
    every slot the request computes and no more than a sequence can hold;
    pow2 holds under twice what it needs, oracle exactly it."""
    if prompt + out > most:
        return
    wanted = prompt + out
    assert reserved_slots("paged", prompt, out, most) == 0
    assert reserved_slots("max", prompt, out, most) == most
    assert reserved_slots("oracle", prompt, out, most) == wanted
    pow2 = reserved_slots("pow2", prompt, out, most)
    assert wanted <= pow2 <= most and pow2 < 2 * wanted
    assert pow2 == most or pow2 & (pow2 - 1) == 0


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=5),
    mode=st.sampled_from(RESERVATIONS[1:]),
    budget=st.sampled_from([4, 16, 2048]),
)
def test_tables_at_admission_are_the_reservation(tiny, requests, mode, budget):
    """Any requests, any token budget (chunked admissions): each admitted
    table holds the blocks of its reservation, held slots are exactly it,
    and no running sequence ever takes a block past it."""
    engine = make(tiny, mode, max_num_batched_tokens=budget)
    seqs = submit(engine, requests)
    tables: dict[str, list[int]] = {}
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            slots = reserved_slots(mode, s.num_prompt_tokens, s.max_tokens, engine.prompt_limit)
            if s.request_id not in tables:
                tables[s.request_id] = list(s.block_table)
                assert len(s.block_table) == blocks_for(slots, B)
            assert s.num_held == slots and s.block_table == tables[s.request_id]
    # (a request of one output token finishes in the step that admits it)
    assert set(tables) >= {s.request_id for s in seqs if s.max_tokens > 1}
    assert engine.allocator.stats().used_blocks == 0
