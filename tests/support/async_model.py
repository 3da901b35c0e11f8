"""The async-scheduling property tests' world (tests/worker/test_async_properties.py,
test_async_lookahead.py): random workloads (hypothesis strategies) and `Run`, the real
`Scheduler` planning against the real allocator core while a model of the forward pass
stands in for torch, checking the block contract after every step (the rules it checks:
the docstring of tests/worker/test_async_properties.py)."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.core import PoolConfig
from allocator_service.core.hashing import chain_hashes
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence

STOP = 3  # a sampled 3 ends a request that stops on it

request_st = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, 3), min_size=1, max_size=12),
        "n": st.integers(1, 3),
        "max_tokens": st.integers(1, 8),
        "stops": st.booleans(),
        "arrive": st.integers(0, 6),  # the step it arrives at
        "abort": st.one_of(st.none(), st.integers(1, 12)),  # the step it is aborted at
    }
)

workload_st = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4]),
        "slots": st.integers(24, 64),  # token slots of the pool
        "caching": st.booleans(),
        "budget": st.sampled_from([3, 8, 256]),  # max_num_batched_tokens: 3 and 8 chunk prefills
        "requests": st.lists(request_st, min_size=1, max_size=7),
    }
)


def draw(prefix: tuple[int, ...], sample: int) -> int:
    """The model: the next token from the prefix (each sample its own)."""
    return (sum(prefix) * 7 + len(prefix) * 3 + sample * 5) % 5


class Run:
    def __init__(
        self, w: dict, async_scheduling: bool, lookahead: int = 0, overlapped: bool = False
    ) -> None:
        self.B = B = w["block_size"]
        self.caching = w["caching"]
        config = PoolConfig(w["slots"] // B, B, w["caching"], "prop")
        self.alloc = EmbeddedAllocator(PoolSpec("w", config))
        self.pool = self.alloc.pool
        self.sched = Scheduler(
            self.alloc,
            max_num_seqs=8,
            max_num_batched_tokens=w["budget"],
            async_scheduling=async_scheduling,
            lookahead=lookahead,
        )
        self.async_scheduling = async_scheduling
        self.lookahead = lookahead
        # Overlapped (the engine on a device whose launch returns at once):
        # step N+1 is scheduled and launched before step N's tokens are
        # drawn and processed; the device computes N, then N+1, in order.
        self.overlapped = overlapped
        self.launched: tuple | None = None
        # flat slot -> the prefix its K/V was computed from
        self.kv: dict[int, tuple[int, ...]] = {}
        self.requests = w["requests"]
        self.families: dict[str, list[Sequence]] = {}
        plan, step = self.sched._plan, self.alloc.step
        planned = []

        def recording_plan(batch, ahead):
            planned.append(plan(batch, ahead))
            return planned[-1]

        def checked_step(ops):
            results = step(ops)
            refused = [(op, r.error) for op, r in zip(ops, results, strict=True) if not r.ok]
            assert not refused, f"the allocator refused {refused}"
            assert self.pool.num_free_blocks >= planned[-1].free, (
                "the worker over-estimated the free blocks"
            )
            return results

        self.sched._plan = recording_plan
        self.alloc.step = checked_step

    def add(self, rid: str, r: dict) -> None:
        params = SamplingParams(
            max_tokens=r["max_tokens"],
            n=r["n"],
            temperature=1.0,
            seed=1,
            stop_token_ids=[STOP] if r["stops"] else [],
        )
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=list(r["prompt"]),
            params=params,
            max_tokens=r["max_tokens"],
            arrival_time=float(len(self.families)),
        )
        for i in range(1, r["n"]):
            seq.children.append(
                Sequence(
                    request_id=rid,
                    prompt_token_ids=list(r["prompt"]),
                    params=params.for_sample(i),
                    max_tokens=r["max_tokens"],
                    arrival_time=seq.arrival_time,
                    index=i,
                    fork_parent=seq,
                )
            )
        self.families[rid] = [seq, *seq.children]
        self.sched.add(seq)

    def slot(self, table: list[int], p: int) -> int:
        return table[p // self.B] * self.B + p % self.B

    def finish(self, seq: Sequence, reason: str) -> None:
        if not seq.is_finished:
            self.sched.finish(seq, reason)

    def step(self, number: int) -> None:
        for i, r in enumerate(self.requests):
            if r["arrive"] == number:
                self.add(f"r{i}", r)
            if r["abort"] == number and f"r{i}" in self.families:
                for s in self.families[f"r{i}"]:
                    self.finish(s, "abort")
        batch = self.sched.schedule()
        findable = {b: h for b, h in enumerate(self.pool.index.block_hash) if h is not None}
        self.check_tables()
        self.check_sharing()
        if self.overlapped:
            previous, self.launched = self.launched, (batch, findable) if batch.entries else None
            if previous is not None:
                self.compute(*previous)
            self.sched.schedule_ahead(batch)
            return
        if self.async_scheduling:
            self.sched.schedule_ahead(batch)
        self.compute(batch, findable)

    def compute(self, batch, findable: dict[int, bytes]) -> None:
        """The step's forward pass, its checks, and its tokens drawn and processed."""
        # The forward pass: copies first, then every layer writes every new
        # token's K/V before any attention reads (so a block shared in the
        # step it is computed is read after it is written).
        for src, dst in batch.copies:
            for o in range(self.B):
                if src * self.B + o in self.kv:
                    self.kv[dst * self.B + o] = self.kv[src * self.B + o]
        for e in batch.entries:
            for p in range(e.num_computed, e.num_computed + e.num_new):
                self.kv[self.slot(e.table, p)] = tuple(e.seq.token_ids[: p + 1])
        for e in batch.entries:
            for p in range(e.num_computed):
                got = self.kv.get(self.slot(e.table, p))
                assert got == tuple(e.seq.token_ids[: p + 1]), (
                    f"{e.seq.alloc_id} reads wrong K/V at {p}"
                )
        for b, h in findable.items():
            if self.pool.index.block_hash[b] != h:
                continue  # evicted and reused since: no longer findable
            prefix = self.kv.get(b * self.B + self.B - 1)
            assert prefix is not None and all(b * self.B + o in self.kv for o in range(self.B)), (
                f"findable block {b} lacks K/V"
            )
            assert chain_hashes(self.pool.root_hash, list(prefix), self.B, None)[-1] == h, (
                f"findable block {b} holds other K/V than its hash names"
            )
        # Sampling, as the model runner and the engine do it.
        sampled = []
        for e in batch.entries:
            if e.samples:
                prefix = tuple(e.seq.token_ids)
                sampled.append((e.seq, draw(prefix, e.seq.index)))
                sampled += [(c, draw(prefix, c.index)) for c in e.seq.unforked_samples()]
        for seq, _ in sampled:
            if seq.fork_parent is not None:
                self.sched.add_fork(seq)
        for seq, tok in sampled:
            if seq.is_finished:
                # aborted while in flight (overlapped: or stopped a step before): the token is
                # dropped
                continue
            seq.token_ids.append(tok)
            if tok in seq.params.stop_token_ids:
                self.finish(seq, "stop")
            elif seq.num_output_tokens >= seq.max_tokens:
                self.finish(seq, "length")

    def check_tables(self) -> None:
        sched = self.sched
        known = [*sched.running, *sched.releases.held()]
        for s in known:
            assert self.pool.block_table(s.alloc_id) == s.block_table
            # the allocator waits for the values of the same slots (so it
            # hashes every block that fills); slots ahead end a block
            held = self.pool._seqs[s.alloc_id]
            rounding = self.pool.block_size - 1 if self.lookahead else 0
            bound = self.async_scheduling + self.lookahead + rounding
            assert held.reserved == s.num_reserved <= bound
            assert held.num_tokens == s.num_held >= s.num_stored >= s.num_valued
        pending = {
            *(s.alloc_id for s in known),
            *sched.releases.to_free,
            *sched.releases.free_later,
        }
        assert set(self.pool.tables()) <= pending, (
            "the allocator holds a sequence the worker forgot"
        )

    def check_sharing(self) -> None:
        holders: dict[int, set[str]] = {}
        for sid, table in self.pool.tables().items():
            for b in table:
                holders.setdefault(b, set()).add(sid.split("/")[0].split("#")[0])
        for b, requests in holders.items():
            if self.pool.ref_cnt[b] > 1 and self.pool.index.block_hash[b] is None:
                assert len(requests) == 1, f"block {b} held by {requests} without a hash"

    def run(self) -> dict[str, list[list[int]]]:
        for number in itertools.count():
            if number > 6 and not self.sched.has_work() and self.launched is None:
                break
            assert number < 3000, "the workload does not finish"
            self.step(number)
        self.sched.schedule()  # the last frees go out ...
        self.sched.schedule()  # ... and are answered
        assert self.pool.stats().used_blocks == 0
        assert self.pool.integrity_problems() == []
        return {rid: [s.output_token_ids for s in fam] for rid, fam in self.families.items()}


def fits(w: dict) -> bool:
    """Every request fits the pool alone (the engine refuses one that cannot)."""
    return all(
        len(r["prompt"]) + r["max_tokens"] <= w["slots"] // w["block_size"] * w["block_size"]
        for r in w["requests"]
    )
