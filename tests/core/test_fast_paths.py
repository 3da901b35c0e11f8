"""The core's fast paths against its plain rules.

`BlockPool.append_run` (a run of appends that copy no block: slots in
their sequences' private last blocks, or blocks taken past their ends), a
step whose tokens are known valid (`StepColumns.tokens_valid`), the packed
hash chain and the prefix index's open-addressing table are shortcuts. A
pool whose `append_run` always declines applies every append by the
general rule; the same random steps
(admits with and without reserved slots, decode appends of one and several
tokens filling reserved slots and reserving more, unreserves, forks, frees,
bad input) through both give identical answers, identical state (tables,
refcounts, free queues, hashes) and identical events after every step.
The prefix index is checked against a dict of hash -> holders (the plain
rules of `DictIndex`), and the free queue's front of ids never handed out
and its runs against a queue of every id taken one block at a time
(`PlainQueuePool`): the same answers, state, events and holders. A
sequence's hash chain, read from its blocks' hashes in the pool's column
(`BlockHashes`) but where a cache reset or a dump keeps it apart, is checked
against the chain hashes of the tokens it holds, and the packed chain
(`hashing.chain_hashes`) against each block hashed alone.
"""

from __future__ import annotations

import json
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_service.core import AllocatorError, BlockPool, PoolConfig, hashing, snapshot
from allocator_service.core.prefix_index import (
    ALL_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    PrefixIndex,
)
from allocator_service.core.run import run_step, step_columns
from allocator_service.core.step import Admit, Append, Fork, Free, Unreserve


class PlainPool(BlockPool):
    """Every append by the general rule."""

    def append_run(
        self, seq_ids, counts, tokens, reserved, keep, num_appended, appended, i, stop, at
    ):
        return i, at


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
    events: dict[str, list] = {"fast": [], "plain": []}
    fast = BlockPool(config, _recorder(events["fast"]))
    plain = PlainPool(config, _recorder(events["plain"]))
    live: list[str] = []
    serial = [0]
    for _ in range(40):
        step = step_columns(_ops(rng, live, serial))
        known = step
        if all(type(t) is int and t >= 0 for t in step.tokens) and rng.random() < 0.5:
            known = step._replace(tokens_valid=True)  # as the wire's columns come: not checked
        assert run_step(fast, known) == run_step(plain, step)
        assert fast.to_state() == plain.to_state()
        assert events["fast"] == events["plain"]
    assert fast.check_integrity()


def _recorder(out: list):
    """An event sink that keeps each event of a run as (kind, block, hash)."""
    return lambda kind, blocks, hashes: out.extend(
        (kind, b, h) for b, h in zip(blocks, hashes, strict=True)
    )


class DictIndex(PrefixIndex):
    """The prefix index's plain rules: a dict of hash -> its holders, in
    registration order (what `PrefixIndex`'s table must answer)."""

    def __init__(self, block_hash, event_sink=None) -> None:
        self.block_hash = block_hash  # the pool's column (`BlockHashes`)
        self.holders_of: dict[bytes, dict[int, None]] = {}
        for b, h in enumerate(block_hash):
            if h is not None:
                self.holders_of.setdefault(h, {})[b] = None
        self.event_sink = event_sink

    def __contains__(self, h) -> bool:
        return h in self.holders_of

    def entries(self):
        for h, holders in self.holders_of.items():
            yield h, list(holders)

    def pick(self, h, ref_cnt, stamp):
        holders = self.holders_of.get(h)
        if holders is None:
            return None
        in_use = [b for b in holders if ref_cnt[b] > 0]
        if in_use:
            return min(in_use)
        return max(holders, key=stamp.__getitem__)

    def register(self, b, h) -> None:
        self.block_hash.set(b, h)
        self.holders_of.setdefault(h, {})[b] = None
        if self.event_sink is not None:
            self.event_sink(BLOCK_STORED, (b,), (h,))

    def register_run(self, blocks, hashes) -> None:
        for b, h in zip(blocks, hashes, strict=True):
            self.register(b, h)

    def evict(self, b) -> bytes:
        h = self.block_hash[b]
        del self.holders_of[h][b]
        if not self.holders_of[h]:
            del self.holders_of[h]
        self.block_hash.drop(b)
        if self.event_sink is not None:
            self.event_sink(BLOCK_REMOVED, (b,), (h,))
        return h

    def evict_run(self, blocks) -> list[bytes]:
        return [self.evict(b) for b in blocks]

    def clear(self) -> int:
        dropped = sum(len(holders) for holders in self.holders_of.values())
        for holders in self.holders_of.values():
            for b in holders:
                self.block_hash.drop(b)
        self.holders_of.clear()
        if self.event_sink is not None:
            self.event_sink(ALL_CLEARED, (0,), (b"",))
        return dropped


class PlainQueuePool(BlockPool):
    """A free queue that starts as the deque of every id, 0 first, whose
    blocks are taken one at a time (`_take`, never a run), and a prefix
    index that is a dict (`DictIndex`)."""

    def __init__(self, config, event_sink=None) -> None:
        super().__init__(config)
        self._fresh = self.num_blocks
        self._uncached_free = deque(range(self.num_blocks))
        self.index = DictIndex(self.index.block_hash, event_sink)

    def _take_run(self, n):
        return [self._take() for _ in range(n)]


def _holders(pool) -> dict[bytes, list[int]]:
    return {h: sorted(holders) for h, holders in pool.index.entries()}


def _caching_pools(test):
    """Runs `test` on random seeds and small pools with prefix caching (and
    now and then a host tier)."""
    return settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(
            seed=st.integers(0, 2**32 - 1),
            num_blocks=st.integers(2, 40),
            block_size=st.sampled_from([1, 2, 4]),
            host_blocks=st.sampled_from([0, 0, 3]),
        )(test)
    )


@_caching_pools
def test_the_index_table_and_the_fresh_ids_are_the_plain_rules(
    seed, num_blocks, block_size, host_blocks
):
    """Tiny token alphabets, so blocks share hashes, admissions hit and cached
    blocks are evicted (the table's deletions); now and then a lookup, a
    cache reset and a pool restored from its dump, whose index is rebuilt."""
    import random

    rng = random.Random(seed)
    config = PoolConfig(num_blocks, block_size, True, "m", host_blocks=host_blocks)
    events: dict[str, list] = {"table": [], "dict": []}
    table = BlockPool(config, _recorder(events["table"]))
    plain = PlainQueuePool(config, _recorder(events["dict"]))
    live: list[str] = []
    serial = [0]
    for _ in range(40):
        step = step_columns(_ops(rng, live, serial))
        assert run_step(table, step) == run_step(plain, step)
        assert table.to_state() == plain.to_state()
        assert table.free_order() == plain.free_order()
        assert table.num_free_blocks == plain.num_free_blocks
        assert events["table"] == events["dict"]
        assert _holders(table) == _holders(plain)
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        assert table.cached_prefix_tokens(tokens) == plain.cached_prefix_tokens(tokens)
        r = rng.random()
        if r < 0.05:
            assert table.reset_prefix_cache() == plain.reset_prefix_cache()
        elif r < 0.15:
            table = BlockPool.from_state(table.to_state(), _recorder(events["table"]))
            assert _holders(table) == _holders(plain)
        assert table.check_integrity()


def _check_chains(pool: BlockPool, known: dict[str, list[int]], salts: dict[str, str | None]):
    """Every sequence's chain, read from its blocks' hashes, is the plain
    rule's (the chain hashes of the tokens it holds values for), and it keeps
    apart only the leading hashes its blocks do not hold."""
    block_hash = pool.index.block_hash
    for seq_id, tokens in known.items():
        seq = pool._seqs[seq_id]
        assert seq.chain(block_hash) == hashing.chain_hashes(
            pool.root_hash, tokens, pool.block_size, salts[seq_id]
        )
        if seq.apart:
            last = len(seq.apart) - 1
            assert not block_hash.holds_hash(seq.table[last], seq.apart[last])
    assert list(block_hash) == [block_hash[b] for b in range(pool.num_blocks)]
    assert block_hash.num_held() == sum(h is not None for h in block_hash)


@_caching_pools
def test_chains_read_from_the_blocks_hashes_are_the_plain_rule(
    seed, num_blocks, block_size, host_blocks
):
    """Random admits (salted, chunked, reserving, loading from the host
    tier), appends, unreserves, forks and frees, cache resets (which clear
    the hashes of blocks in use: their sequences keep their chains apart)
    and pools restored from their full and packed dumps (exact, keeping
    apart only what no block holds)."""
    import random

    rng = random.Random(seed)
    config = PoolConfig(num_blocks, block_size, True, "m", host_blocks=host_blocks)
    pool = BlockPool(config)
    known: dict[str, list[int]] = {}  # per sequence, the tokens whose values it holds
    salts: dict[str, str | None] = {}
    serial = 0
    for _ in range(60):
        r = rng.random()
        live = list(known)
        try:
            if r < 0.25 or not live:
                serial += 1
                seq, salt = f"s{serial}", rng.choice([None, None, "t"])
                tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
                got = pool.admit(
                    seq,
                    tokens,
                    salt,
                    num_new_tokens=rng.choice([None, None, 1, 3]),
                    reserve=rng.choice([0, 0, 2]),
                )
                known[seq], salts[seq] = tokens[: got.num_stored], salt
            elif r < 0.6:
                seq = rng.choice(live)
                tokens = [rng.randrange(3) for _ in range(rng.choice([0, 1, 1, 2, 5]))]
                pool.append(seq, tokens, reserve=rng.choice([0, 0, 1, 3]))
                known[seq] += tokens
            elif r < 0.67:
                pool.unreserve(rng.choice(live), rng.choice([1, 2]))
            elif r < 0.77:
                serial += 1
                parent, child = rng.choice(live), f"s{serial}"
                pool.fork(parent, child)
                known[child], salts[child] = list(known[parent]), salts[parent]
            elif r < 0.9:
                seq = rng.choice(live)
                pool.free(seq)
                del known[seq]
            elif r < 0.95:
                before = pool.to_state()
                dropped = pool.reset_prefix_cache()
                assert dropped == sum(h is not None for h in before["hash"])
                assert pool.to_state()["seqs"] == before["seqs"]
            else:
                dump = rng.choice([pool.to_state(), snapshot.to_packed(pool)])
                restored = BlockPool.from_state(json.loads(json.dumps(dump)))
                assert restored.to_state() == pool.to_state()
                pool = restored
        except AllocatorError:
            pass
        pool.confirm(saved=pool.take_moves().host_saves[1::2])  # tier hits load into blocks
        _check_chains(pool, known, salts)
        assert pool.check_integrity()


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=2_200),
    block_size=st.sampled_from([1, 3, 16, 32]),
    salt=st.sampled_from([None, "", "tenant-a"]),
    limit=st.none() | st.integers(0, 150),
)
def test_the_packed_hash_chain_is_the_plain_rule(tokens, block_size, salt, limit):
    """`chain_hashes` (packed 64 blocks at a time, every block but a salted
    first hashed inline) against each full block hashed from its parent by
    `block_hash`, the first with its salt: the same hashes, over chunk
    boundaries, salted or not, bounded or not."""
    root = hashing.root_hash("m", block_size)
    n = len(tokens) // block_size if limit is None else min(len(tokens) // block_size, limit)
    plain, parent = [], root
    for i in range(n):
        keys = hashing.salt_keys(salt) if i == 0 else ()
        parent = hashing.block_hash(parent, tokens[i * block_size : (i + 1) * block_size], keys)
        plain.append(parent)
    assert hashing.chain_hashes(root, tokens, block_size, salt, limit) == plain
