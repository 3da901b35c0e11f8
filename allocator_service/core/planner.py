"""The planning view of a pool: what an operation would take or free.

A worker's scheduler plans a step before it sends it, so it asks `PoolPlan`,
built from the block tables the allocator's answers gave. The functions below
are the one statement of each rule; `BlockPool` calls them too. A plan knows
which blocks each table names and their refcounts (so which blocks a release
frees and which appends copy on write), not which free block comes next;
free counts include cached free blocks (evictable).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, MutableSequence, Sequence
from itertools import chain
from typing import NamedTuple

from allocator_service.core.blocks import blocks_for


# ------------------------------------------------------------------ the rules
def append_slots(num_tokens: int, reserved: int, reserve: int) -> tuple[int, int]:
    """An Append of `num_tokens` values that reserves `reserve` slots after
    them, on a sequence holding `reserved` slots without values: (the
    reserved slots its values fill, first; the slots it adds)."""
    fill = min(num_tokens, reserved)
    return fill, num_tokens - fill + reserve


def append_blocks(held: int, new_slots: int, last_refs: int, block_size: int) -> tuple[int, bool]:
    """Blocks an append of `new_slots` slots to a sequence holding `held`
    takes from the free queue, and whether it first copies its last block
    (named by `last_refs` tables): a write into a partly filled block that
    others share copies it (the copy is one of the blocks taken)."""
    offset = held % block_size
    cow = new_slots > 0 and offset != 0 and last_refs > 1
    room = block_size - offset if offset else 0
    return (blocks_for(new_slots - room, block_size) if new_slots > room else 0) + cow, cow


def admit_blocks(
    num_tokens: int, hits: int, num_new_tokens: int | None, block_size: int, reserve: int = 0
) -> tuple[int, int]:
    """An Admit of `num_tokens` whose first `hits` blocks are found cached,
    holding `reserve` slots after the tokens it stores: (tokens stored,
    blocks taken from the free queue for the rest)."""
    stored = (
        num_tokens
        if num_new_tokens is None
        else min(num_tokens, hits * block_size + num_new_tokens)
    )
    return stored, blocks_for(stored + reserve, block_size) - hits


def unreserve_keep(held: int, slots: int, block_size: int) -> int:
    """The table entries a sequence holding `held` slots keeps when it gives
    back `slots`: the blocks past them hold nothing and are freed."""
    return blocks_for(held - slots, block_size)


def after_unreserve(held: int, reserved: int, slots: int) -> tuple[int, int]:
    """(slots held, slots reserved) once `slots` reserved slots are given back."""
    return held - slots, reserved - slots


def reserve_for(held: int, reserved: int, num_tokens: int, target: int) -> int:
    """The slots an Append of `num_tokens` values reserves so that the
    sequence (holding `held`, `reserved` of them without values) holds
    `target` slots after it."""
    return target - held - append_slots(num_tokens, reserved, 0)[1]


def after_append(held: int, reserved: int, num_tokens: int, reserve: int) -> tuple[int, int]:
    """(slots held, slots reserved) once that Append is applied."""
    fill, new = append_slots(num_tokens, reserved, reserve)
    return held + new, reserved + reserve - fill


def release(ref_cnt: MutableSequence[int] | Counter, table: Iterable[int]) -> list[int]:
    """Drop one holder of each block of `table` (a Free): the blocks no
    table names any more, in table order."""
    freed = []
    for b in table:
        ref_cnt[b] -= 1
        if ref_cnt[b] == 0:
            freed.append(b)
    return freed


# ------------------------------------------------------------------ the view
class AppendCost(NamedTuple):
    """What an Append of a sequence takes (`PoolPlan.append`)."""

    need: int  # blocks from the free queue, a copy on write included
    cow: int  # the shared block it copies on write, or -1
    blocks: int  # the blocks its table holds after it


class PoolPlan:
    """A step in the making, against one pool: the free blocks and the
    refcounts as they will be once the operations planned so far are
    applied, in the allocator's order. Built from the tables of every
    sequence the pool holds after the step's frees.

    Questions (nothing changes): `append`, `admit`, `admit_reserve`, `unreserve`,
    `blocks_for`, `fit`, `short_of`, `completes_block`. Planned operations (the
    counts change as the allocator's will): `take` and `give_back` (an
    Append), `take_blocks` (an admission), `release` (a Free, an
    Unreserve) and `hold` (a Fork). Blocks an operation will take have no
    id until the answer names them: `hold` them then to keep planning.

    A plan is exact, not an estimate: the property test
    (tests/core/test_planner.py) checks every answer against `BlockPool`."""

    __slots__ = ("block_size", "refs", "free")

    def __init__(
        self, num_blocks: int, block_size: int, tables: Iterable[Sequence[int]] = ()
    ) -> None:
        self.block_size = block_size
        # NOTE: one C-speed update over every held block (30 -> 20 us for ~1,000).
        self.refs: Counter = Counter(chain.from_iterable(tables))
        self.free = num_blocks - len(self.refs)

    # ------------------------------------------------------------ questions
    def blocks_for(self, slots: int) -> int:
        """Blocks that hold `slots` slots (a table's length)."""
        return blocks_for(slots, self.block_size)

    def fit(self, blocks: int, slots: int) -> int:
        """The most of `slots` slots that `blocks` blocks hold."""
        return min(slots, blocks * self.block_size)

    def short_of(self, blocks: int, slots: int) -> int:
        """Blocks a table of `blocks` lacks to hold `slots` slots (0 when it has them)."""
        return max(0, blocks_for(slots, self.block_size) - blocks)

    def append(self, table: Sequence[int], held: int, slots: int) -> AppendCost:
        """An Append that makes a sequence holding `held` slots in `table`
        hold `slots` (no fewer than it holds)."""
        new = slots - held if slots > held else 0
        need, cow = append_blocks(held, new, self.refs[table[-1]] if table else 0, self.block_size)
        return AppendCost(need, table[-1] if cow else -1, len(table) + need - cow)

    def admit(
        self,
        num_tokens: int,
        num_new_tokens: int | None = None,
        hits: Sequence[int] = (),
        reserve: int = 0,
    ) -> int:
        """Blocks an Admit of `num_tokens` (holding `reserve` slots after the
        tokens it stores) takes from the free queue when it shares `hits`
        (the blocks it finds cached): new blocks for the rest, and each hit
        that was free (it leaves the evictable queue; a block loaded from a
        KV tier is one: a fresh block). With neither hits nor a bound, the
        most any admission of them takes."""
        need = admit_blocks(num_tokens, len(hits), num_new_tokens, self.block_size, reserve)[1]
        return need + sum(1 for b in hits if self.refs[b] == 0)

    def admit_reserve(self, num_tokens: int, num_new_tokens: int | None, slots: int) -> int:
        """The slots an Admit of `num_tokens` (bounded by `num_new_tokens`)
        that finds nothing cached reserves after the tokens it stores, so
        that the sequence holds `slots` (no fewer than `num_tokens`)."""
        return slots - admit_blocks(num_tokens, 0, num_new_tokens, self.block_size)[0]

    def unreserve(self, table: Sequence[int], held: int, end: int) -> tuple[int, int]:
        """Giving back a sequence's slots past the block that holds slot
        `end` (reserved slots: past anything computed): (slots, blocks that
        frees). It keeps the room left in that block."""
        slots = max(0, held - blocks_for(end, self.block_size) * self.block_size)
        return slots, len(table) - unreserve_keep(held, slots, self.block_size)

    def completes_block(self, start: int, end: int) -> bool:
        """Whether values for slots `start:end` fill a block (it gets a hash)."""
        return end // self.block_size > start // self.block_size

    # ----------------------------------------------------- planned operations
    def take(self, cost: AppendCost) -> None:
        """An Append is planned (`append`'s answer)."""
        self.free -= cost.need
        if cost.cow >= 0:
            self.refs[cost.cow] -= 1  # the shared block loses this holder

    def give_back(self, cost: AppendCost) -> None:
        """Undo `take`: that Append is not sent after all."""
        self.free += cost.need
        if cost.cow >= 0:
            self.refs[cost.cow] += 1

    def take_blocks(self, blocks: int) -> None:
        """Blocks planned out of the free queue (an admission, slots ahead)."""
        self.free -= blocks

    def release(self, blocks: Iterable[int]) -> int:
        """A table names `blocks` no more (a Free: its whole table; an
        Unreserve: the blocks past what it keeps): the blocks that frees."""
        freed = len(release(self.refs, blocks))
        self.free += freed
        return freed

    def hold(self, blocks: Iterable[int]) -> None:
        """A table names `blocks` once more (a Fork's child: its parent's
        table; an answer: the blocks an operation took or shares)."""
        self.refs.update(blocks)
