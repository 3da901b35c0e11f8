"""Async scheduling (the allocator call of step N+1 sent while step N
computes) never changes what a user gets: the same greedy tokens as the
synchronous engine (`--no-async-scheduling`), at every block size, with the
prefix cache on and off, with pools small enough to preempt, with parallel
samples (forks), stop strings and one-token requests (deferred frees), with
chunked prefill, embedded and through a real allocator process (memory state
and Redis journal); and every block comes back."""

from __future__ import annotations

import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.core import Append, Free, PoolConfig, Unreserve
from tests.worker.test_engine import make, prompts_mixed
from worker.engine import AllocatorFault, EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed requests: greedy, seeded parallel samples (forked blocks), a
    one-token request and early stops (frees that follow a finish)."""
    prompts = prompts_mixed(seed=3, n=10)
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    params[6] = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[5, 17, 101, 260]
    )
    params[8] = SamplingParams(max_tokens=9, temperature=0.9, seed=11, n=2, ignore_eos=True)
    return prompts, params


def outcome(engine) -> list[list[tuple[list[int], str | None]]]:
    """Every sample's tokens and finish reason; then every block is back and the pool is sound."""
    prompts, params = workload()
    try:
        outs = engine.generate_samples(prompts, params)
        while engine.has_unfinished():
            engine.step()
        engine.step()  # the frees of the last finished requests go out with a step
        engine.step()  # ... and are collected by the next one (async)
        st = engine.allocator.stats()
        assert st.used_blocks == 0, "blocks held after every request finished"
        alloc = engine.allocator
        problems = (
            alloc.pool.integrity_problems()
            if hasattr(alloc, "pool")
            else alloc.integrity_problems()
        )
        assert problems == []
        return [[(o.token_ids, o.finish_reason) for o in samples] for samples in outs]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def synchronous(tiny):
    """The synchronous engine, one request at a time with a big pool."""
    return outcome(
        make(tiny, max_num_seqs=3, num_blocks=4096, block_size=4, async_scheduling=False)
    )


@pytest.fixture(scope="module")
def tiny():
    from worker.model.loader import load_model

    return load_model("tiny-random")


# token slots small enough that every engine below
# preempts (10 requests, 17 samples, up to 84 tokens)
PREEMPTING_SLOTS = {1: 160, 4: 160, 16: 128}


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_async_equals_sync_under_preemption(tiny, synchronous, block_size, caching):
    """A pool that forces preemption: async scheduling on and off, each
    with a call every step (no lookahead slots) and with the default 8
    lookahead slots (steps that make no call), all preempt and all give the
    synchronous outputs."""
    small = {
        "num_blocks": PREEMPTING_SLOTS[block_size] // block_size,
        "block_size": block_size,
        "enable_prefix_caching": caching,
    }
    for on, lookahead in ((False, 0), (True, 0), (True, 8), (False, 8)):
        engine = make(tiny, async_scheduling=on, num_lookahead_slots=lookahead, **small)
        assert outcome(engine) == synchronous, (on, lookahead)
        assert engine.num_preemptions > 0, (on, lookahead)


@pytest.mark.parametrize("on", [True, False], ids=["async", "sync"])
def test_lookahead_slots_skip_calls_and_keep_every_block_cached(tiny, on):
    """Four greedy requests decoding together (30 tokens, blocks of 4): with
    8 lookahead slots a call holds each sequence's next 9 slots, so 7 calls
    serve the 31 steps that take a call each with none; the tokens are the
    same; and once the requests finish, every full block of what each
    computed (prompt and output but the last token) is in the prefix cache,
    as with a call per step: the values of the steps that made no call are
    sent before the Free. A call sends a sequence's Append only when it
    takes slots, or to send a finished sequence's values that fill a block:
    16-17 Appends for the 120 tokens the requests decode, against 116-117
    with a call per step."""
    prompts = [list(range(10 + i, 23 + 2 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    runs = {}
    for lookahead in (0, 8):
        engine = make(
            tiny,
            block_size=4,
            enable_prefix_caching=True,
            async_scheduling=on,
            num_lookahead_slots=lookahead,
        )
        calls: list[tuple[int, int]] = []
        step, pool = engine.allocator.step, engine.allocator.pool
        engine.allocator.step = lambda ops, step=step, calls=calls, pool=pool: (
            calls.append(_appends(pool, ops, 4)),
            step(ops),
        )[1]
        try:
            outs = engine.generate(prompts, params)
            while engine.has_unfinished():
                engine.step()
            pool = engine.allocator.pool
            assert pool.stats().used_blocks == 0
            for prompt, out in zip(prompts, outs, strict=True):
                computed = prompt + out.token_ids[:-1]
                assert pool.cached_prefix_tokens([*computed, 0]) == len(computed) // 4 * 4
            appends = [sum(c) for c in zip(*calls, strict=True)]
            runs[lookahead] = ([o.token_ids for o in outs], len(calls), *appends)
        finally:
            engine.close()
    assert runs[8][0] == runs[0][0]
    assert runs[0][1] >= 31
    assert runs[8][1] == 7
    # Appends: one a token with a call per step; with lookahead, those that
    # take slots (about one a block) and at most a flush a request
    assert (runs[0][2], runs[8][2]) == ((117, 17) if on else (116, 16))
    assert runs[8][3] <= len(prompts)


def _appends(pool, ops: list, block_size: int) -> tuple[int, int]:
    """(the Appends of a call about to go to `pool`, those that take no
    slots): each takes slots (`reserve`, or values past what the sequence
    holds, as after an Unreserve) or fills a block with its values (a
    finished sequence's last values, sent before its Free)."""
    given_back: dict[str, int] = {}
    count = values_only = 0
    for op in ops:
        if isinstance(op, Unreserve):
            given_back[op.seq] = op.slots
        elif isinstance(op, Append):
            count += 1
            seq = pool._seqs[op.seq]
            held = seq.num_tokens - given_back.get(op.seq, 0)
            start = seq.num_tokens - seq.reserved  # the slots with values
            takes = op.reserve > 0 or start + len(op.tokens) > held
            fills = (start + len(op.tokens)) // block_size > start // block_size
            assert takes or fills, (op, start, held)
            values_only += not takes
    return count, values_only


def test_slots_held_ahead_are_exported(tiny):
    """`pagedkv_worker_kv_slots_ahead` reads the slots the allocator holds
    past what the sequences computed: none with a call per step (sync); with
    8 lookahead slots none after the prefill (an admission reserves none),
    once the next call tops them up 8 per sequence and the rest of the block
    the 8th ends in, one fewer each step; the first to run out makes the
    next call, which tops them all up again; 0 once every request is done."""
    prompts = [list(range(10 + i, 23 + 2 * i)) for i in range(4)]
    # after the first decode step a sequence holds the slots to the end of
    # the block of its 8th slot past its next token (block size 4): 38 in all
    ahead = sum(-(-(len(p) + 1 + 8) // 4) * 4 - (len(p) + 1) for p in prompts)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for lookahead in (0, 8):
        engine = make(tiny, block_size=4, async_scheduling=False, num_lookahead_slots=lookahead)
        try:
            for prompt in prompts:
                engine.add_request(prompt, params)
            readings = []
            while engine.has_unfinished():
                engine.step()
                readings.append(
                    engine.metrics.registry.get_sample_value(
                        "pagedkv_worker_kv_slots_ahead", engine.metrics.labels
                    )
                )
            # each step computes one token of each; the 8th step leaves one
            # sequence none ahead, so the next step calls
            expected = (
                [0] * len(readings) if not lookahead else [0, *range(ahead, ahead - 33, -4), ahead]
            )
            assert readings[: len(expected)] == expected, (lookahead, readings)
            assert readings[-1] == 0 and max(readings) == (ahead if lookahead else 0)
        finally:
            engine.close()


def test_async_with_chunked_prefill_and_cache(tiny, synchronous):
    engine = make(tiny, enable_prefix_caching=True, num_blocks=28, max_num_batched_tokens=13)
    assert outcome(engine) == synchronous
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("redis", [False, True], ids=["memory", "redis"])
def test_async_through_a_real_allocator(tiny, synchronous, allocator_server, redis_store, redis):
    """A real allocator process, memory state or a Redis journal; the pool
    small enough to preempt: the synchronous outputs, and the same ones with
    async scheduling off."""
    import contextlib

    with redis_store() if redis else contextlib.nullcontext(("", None)) as (url, _):
        with allocator_server(*(("--state", url) if redis else ())) as server:
            for on in (True, False):
                engine = make(
                    tiny,
                    num_blocks=40,
                    block_size=4,
                    enable_prefix_caching=True,
                    allocator=server.address,
                    worker_id=f"w-{on}",
                    async_scheduling=on,
                )
                assert outcome(engine) == synchronous
                assert engine.num_preemptions > 0


def test_the_flag_and_its_variable(monkeypatch):
    """On by default; `--no-async-scheduling` or PAGEDKV_WORKER_ASYNC_SCHEDULING=false
    turns it off; a flag wins over its variable; a bad value is refused."""
    import argparse

    from worker.cli import add_arguments, engine_config

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p.parse_args(["--model", "tiny-random", *argv])

    monkeypatch.delenv("PAGEDKV_WORKER_ASYNC_SCHEDULING", raising=False)
    assert engine_config(parse()).async_scheduling is True
    assert engine_config(parse("--no-async-scheduling")).async_scheduling is False
    monkeypatch.setenv("PAGEDKV_WORKER_ASYNC_SCHEDULING", "off")
    assert engine_config(parse()).async_scheduling is False
    assert engine_config(parse("--async-scheduling")).async_scheduling is True
    monkeypatch.setenv("PAGEDKV_WORKER_ASYNC_SCHEDULING", "sometimes")
    with pytest.raises(SystemExit):
        parse()


def test_the_lookahead_flag_and_its_variable(monkeypatch):
    """8 by default; `--num-lookahead-slots N` or PAGEDKV_WORKER_NUM_LOOKAHEAD_SLOTS
    sets it, the flag winning; a value that is not an integer in [0, 1024] is refused."""
    import argparse

    from worker.cli import add_arguments, engine_config

    def config(*argv: str):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return engine_config(p.parse_args(["--model", "tiny-random", *argv]))

    monkeypatch.delenv("PAGEDKV_WORKER_NUM_LOOKAHEAD_SLOTS", raising=False)
    assert config().num_lookahead_slots == 8
    assert config("--num-lookahead-slots", "0").num_lookahead_slots == 0
    monkeypatch.setenv("PAGEDKV_WORKER_NUM_LOOKAHEAD_SLOTS", "16")
    assert config().num_lookahead_slots == 16
    assert config("--num-lookahead-slots", "2").num_lookahead_slots == 2
    for bad in ("-1", "1025"):
        with pytest.raises(ValueError, match="--num-lookahead-slots"):
            config("--num-lookahead-slots", bad)
    monkeypatch.setenv("PAGEDKV_WORKER_NUM_LOOKAHEAD_SLOTS", "many")
    with pytest.raises(SystemExit):
        config()


class RefusesAStepWithFrees(EmbeddedAllocator):
    """Refuses (nothing applied, as a server that says no) the `nth` step
    that carries a Free."""

    def __init__(self, spec: PoolSpec, nth: int) -> None:
        super().__init__(spec)
        self.nth = nth
        self.refused: list[str] = []

    def step(self, ops):
        frees = [op.seq for op in ops if isinstance(op, Free)]
        if frees and self.nth:
            self.nth -= 1
            if not self.nth:
                self.refused = frees
                raise RuntimeError("refused: the allocator said no to this step")
        return super().step(ops)


@pytest.mark.parametrize("nth", [1, 2, 4])
@pytest.mark.parametrize(
    ("on", "lookahead"), [(False, 0), (True, 0), (True, 8)], ids=["sync", "async", "async-la8"]
)
def test_a_refused_step_loses_none_of_its_frees(tiny, synchronous, nth, on, lookahead):
    """The allocator refuses a step that frees sequences (finished,
    preempted): the step's requests fail, as the server's engine loop fails
    them, and yet every sequence the step would have freed is freed by a
    later call: once the engine is idle the allocator holds no sequence and
    no block, and the engine then serves the workload as before."""
    small = {"num_blocks": PREEMPTING_SLOTS[4] // 4, "block_size": 4, "enable_prefix_caching": True}
    spec = PoolSpec(
        "w",
        PoolConfig(
            num_blocks=small["num_blocks"], block_size=4, model_fingerprint=tiny.fingerprint
        ),
    )
    allocator = RefusesAStepWithFrees(spec, nth)
    engine = LLMEngine(
        tiny,
        EngineConfig(async_scheduling=on, num_lookahead_slots=lookahead, **small),
        allocator=allocator,
    )
    prompts, params = workload()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    failed = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except AllocatorFault:
            failed += 1
            for rid in ids:  # what the server's engine loop does (worker/engine/async_engine.py)
                engine.abort(rid)
    assert failed == 1 and allocator.refused
    for _ in range(2):  # the frees of the aborted requests, sent and (async) collected
        engine.step()
    st = allocator.stats()
    assert (st.num_sequences, st.used_blocks) == (0, 0), (
        f"the refused step's frees {allocator.refused} were lost"
    )
    assert allocator.pool.integrity_problems() == []
    assert outcome(engine) == synchronous


class RefusesFromTheFirstFree(EmbeddedAllocator):
    """Refuses every step from the first one that frees on, while `refusing`
    stays set (a server that no longer accepts this worker, e.g. a rotated token)."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.calls = 0
        self.refusing = False
        self.armed = True

    def step(self, ops):
        self.calls += 1
        if self.armed and any(isinstance(op, Free) for op in ops):
            self.refusing, self.armed = True, False
        if self.refusing:
            raise RuntimeError("refused: UNAUTHENTICATED")
        return super().step(ops)


@pytest.mark.parametrize("on", [False, True], ids=["sync", "async"])
def test_an_allocator_that_keeps_refusing_leaves_the_engine_idle(tiny, synchronous, on):
    """Frees a refused step carried are not work by themselves: once every
    request has failed, the engine goes idle (no allocator call at all)
    however long the allocator keeps refusing; the Frees go out with the
    first call made for new work once it answers again."""
    spec = PoolSpec(
        "w", PoolConfig(num_blocks=64, block_size=4, model_fingerprint=tiny.fingerprint)
    )
    allocator = RefusesFromTheFirstFree(spec)
    engine = LLMEngine(
        tiny, EngineConfig(num_blocks=64, block_size=4, async_scheduling=on), allocator=allocator
    )
    ids = [
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
        engine.add_request(
            [4, 5, 6, 7], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
        ),
    ]
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 50, "the engine keeps stepping against an allocator that refuses"
        try:
            engine.step()
        except AllocatorFault:
            for rid in ids:
                engine.abort(rid)
    calls = allocator.calls
    assert allocator.refusing and not engine.has_unfinished() and calls < 10
    allocator.refusing = False  # the allocator takes the worker again
    assert outcome(engine) == synchronous
    assert allocator.calls > calls


def test_samples_whose_first_token_is_their_last_are_not_forked(tiny):
    """n = 3 and max_tokens = 1: each sample's first token is its last, so
    it is never computed, and no engine forks a sample (a fork would hold a
    copy of the prompt's last, partly filled block for nothing); the same
    tokens with async scheduling on and off."""
    runs = {}
    for on in (False, True):
        engine = make(tiny, block_size=4, async_scheduling=on)
        sent = []
        step = engine.allocator.step
        engine.allocator.step = lambda ops, step=step, sent=sent: (sent.extend(ops), step(ops))[1]
        try:
            params = SamplingParams(max_tokens=1, n=3, temperature=0.8, seed=5, ignore_eos=True)
            outs = engine.generate_samples([[1, 2, 3, 4, 5, 6]], [params])[0]
            while engine.has_unfinished():
                engine.step()
        finally:
            engine.close()
        runs[on] = [o.token_ids for o in outs]
        assert not [op for op in sent if type(op).__name__ == "Fork"], on
    assert runs[True] == runs[False]


def _late_arrivals(engine) -> tuple[dict[str, list[int]], dict[str, int], int, int]:
    """Four requests, then four more at step 5: each request's tokens, the
    step of its first token, the preemptions and the UNRESERVEs sent."""
    from allocator_service.core import Unreserve

    prompts = prompts_mixed(seed=5, n=8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    given_back, step = [], engine.allocator.step

    def counting(ops):
        given_back.extend(op for op in ops if type(op) is Unreserve)
        return step(ops)

    engine.allocator.step = counting
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    try:
        for i in range(4):
            engine.add_request(prompts[i], params, f"r{i}")
        number = 0
        while engine.has_unfinished() or number <= 5:
            if number == 5:
                for i in range(4, 8):
                    engine.add_request(prompts[i], params, f"r{i}")
            for out in engine.step():
                first.setdefault(out.request_id, number)
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            number += 1
        return tokens, first, engine.num_preemptions, len(given_back)
    finally:
        engine.close()


LATE_POOL = {"num_blocks": 70, "block_size": 4, "enable_prefix_caching": False}


@pytest.mark.parametrize("on", [True, False], ids=["async", "sync"])
def test_slots_ahead_are_given_back_to_requests_that_arrive_later(
    tiny, allocator_server, redis_store, on
):
    """Four requests decode holding 8 slots ahead when four more arrive at
    step 5 into a pool of 70 blocks of 4, through a real allocator process
    with a Redis journal: the blocks held ahead are given back (UNRESERVE)
    and every request gets its first token at the same step as with a call
    per step, with the same tokens and preemptions. (Before UNRESERVE the
    sixth request waited for the slots ahead to be used up: its first
    token came at step 24 instead of 5, 25 instead of 6 with async
    scheduling.)"""
    with redis_store() as (url, _), allocator_server("--state", url) as server:

        def run(lookahead: int):
            return _late_arrivals(
                make(
                    tiny,
                    async_scheduling=on,
                    num_lookahead_slots=lookahead,
                    allocator=server.address,
                    worker_id=f"w-{on}-{lookahead}",
                    **LATE_POOL,
                )
            )

        tokens, first, preemptions, given_back = run(8)
        assert given_back > 0
        assert (tokens, first, preemptions) == run(0)[:3]


def test_an_allocator_from_before_unreserve_is_sent_none(tiny, monkeypatch):
    """An allocator whose registration lists no op kinds (one from before
    `op_kinds`, which applies FREE, APPEND, ADMIT and FORK only, and would
    refuse a whole step holding an UNRESERVE) gets none: slots ahead wait to
    be used up as before, and the tokens are the same."""
    from allocator_service.core import UNRESERVE
    from allocator_service.rpc import servicer
    from allocator_service.rpc.server import create_server
    from allocator_service.service import AllocatorService

    register = servicer.AllocatorServicer.RegisterPool

    def older(self, request, context):
        response = register(self, request, context)
        response.ClearField("op_kinds")
        return response

    monkeypatch.setattr(servicer.AllocatorServicer, "RegisterPool", older)
    service = AllocatorService()
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    try:
        engine = make(
            tiny,
            num_lookahead_slots=8,
            allocator=f"127.0.0.1:{port}",
            worker_id="w-older",
            **LATE_POOL,
        )
        assert UNRESERVE not in engine.allocator.op_kinds and len(engine.allocator.op_kinds) == 4
        tokens, first, _, given_back = _late_arrivals(engine)
        assert given_back == 0
        reference = _late_arrivals(make(tiny, num_lookahead_slots=0, **LATE_POOL))
        assert tokens == reference[0]
        # it waited for the slots ahead, as before UNRESERVE
        assert first["r5"] > reference[1]["r5"]
    finally:
        server.stop(0).wait()
        service.close()
