"""How large an answer can be: every bound of an answer's size, in one place.

A refused call changes nothing, including one refused for the size of its
answer, so each bound is known before the work: a Step's answer
(`step_answer_bound`, checked before the step is journaled), a pool's dump
(`dump_floor`, checked before it is built, and `DUMP_FRAME_BYTES` around the
built text) and a pool's packed snapshot (`packed_bound`). tests/allocator/
test_bounds.py holds each against real encoded answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from allocator_service.core import BlockPool, StepColumns
from allocator_service.core import step as core_step
from allocator_service.core.block_hashes import HASH_BYTES
from allocator_service.core.blocks import blocks_for
from allocator_service.core.limits import (
    MAX_ADVERTISE_URL_LEN,
    MAX_STORE_NAMESPACE_LEN,
    max_table_entries,
)
from allocator_service.core.tiers import OWED_DELETES_PER_STEP

# Bytes of one operation's readable reason in a StepResponse, at most (a
# longer one is cut): what lets `step_answer_bound` bound a step's answer.
MAX_ERROR_MESSAGE_BYTES = 320


# Bytes of a DumpPool answer besides its JSON text: its other fields and framing.
DUMP_FRAME_BYTES = 4096


class TierBound(NamedTuple):
    """What bounds a tiered pool's moves in one answer (`step_answer_bound`)."""

    store_entries: int  # entries the shared store holds now (0: the pool uses none)
    deletes_per_save: int  # store entries one save may delete to make room, at most
    load_source_bytes: int = 0  # a peer store: what names one load's writer (its URL), at most
    owed_deletes: int = 0  # a peer store: deletes other pools' steps left the pool, at most


def step_answer_bound(
    step: StepColumns,
    num_blocks: int,
    block_size: int,
    num_tokens: Callable[[str], int | None],
    tiers: TierBound | None = None,
) -> int:
    """An upper bound of the encoded size of the StepResponse that `step`
    can get from a pool of this shape, before it is applied (what the
    service refuses a step for: the answer must fit the wire).
    `num_tokens(seq)`: the tokens (reserved slots included) a live sequence
    of the pool holds now, None for no such sequence.

    Block ids: an ADMIT or APPEND appends at most its tokens and reserved
    slots in blocks, one more for a partial block, and one more for a
    copy-on-write (G over the step). A FORK appends its parent's whole
    table: the parent's now (or its own parent's bound, for a child forked
    in this step), grown by at most G.

    Tier moves (`tiers`, a tiered pool): every block the step takes (at most
    G) is evicted at most once, which saves it one tier down (a host save, and
    the host entry it displaces saved to the store) and is loaded into at
    most once; with a store, a FREE writes the cached blocks it releases
    through (at most its table: the sequence's full blocks now, or its fork
    bound; G once over all frees; and no more than the pool's blocks and G,
    a save per hash a block holds in the step); each store save deletes at
    most `deletes_per_save` entries, and every store confirmation that
    fails or a refused load one more, never more than the store holds. A
    delete names its entry's store namespace, any pool's: at most
    MAX_STORE_NAMESPACE_LEN ASCII characters. A load from a peer store
    names its writer's URL (`load_source_bytes`), and its answer carries the
    deletes of the pool's entries other pools dropped since its last step
    (`owed_deletes`: OWED_DELETES_PER_STEP at most, and each entry it wrote
    once at most, so never more than the store holds)."""
    kinds, reserved = step.kinds, step.num_reserved
    n = len(kinds)
    id_bytes = max(1, ((num_blocks - 1).bit_length() + 6) // 7)
    # only an ADMIT or APPEND takes blocks: a partial one and a copy each, at most
    writers = kinds.count(core_step.APPEND) + kinds.count(core_step.ADMIT)
    growth = (len(step.tokens) + (sum(reserved) if reserved else 0)) // block_size + 2 * writers
    ids = growth
    # the blocks FREEs release, each a store save (write-through), at most
    stores = tiers is not None and tiers.store_entries > 0
    freed = frees = 0
    if step.children or stores:
        lengths: dict[str, int] = {}  # children forked in this step -> their bound
        forks = 0
        for i, kind in enumerate(kinds):
            if kind == core_step.FREE and stores:
                frees += 1
                bound = lengths.get(step.seq_ids[i])
                if bound is None:  # its cached blocks now: full ones
                    bound = (num_tokens(step.seq_ids[i]) or 0) // block_size
                freed += bound
            if kind != core_step.FORK or forks >= len(step.children):
                continue
            parent = step.seq_ids[i]
            bound = lengths.get(parent)
            if bound is None:
                held = num_tokens(parent)
                bound = blocks_for(held or 0, block_size) + growth
            lengths[step.children[forks]] = bound
            forks += 1
            ids += bound
        if frees:  # what the step's writers add to the tables freed, G at most in all
            freed = min(freed + growth, num_blocks + growth)
    # Appended ids become table entries (a copy-on-write replaces one, at most
    # one per writer): past the pool's bound on entries an operation fails
    # whole (`pool_limit`) and appends nothing.
    ids = min(ids, max_table_entries(num_blocks) + writers)
    # Per operation: an error (1 byte), five uint32 columns (5 each), one
    # copy's two ids, a reason; the ids; the fields' tags and lengths.
    bound = 128 + n * (26 + 2 * id_bytes + MAX_ERROR_MESSAGE_BYTES + 3) + ids * id_bytes
    if tiers is not None:
        # per block taken: a host save (2 ids), a store save (a hash, 1 id), a load (a hash, 1 id)
        bound += 64 + growth * (2 * HASH_BYTES + 4 * id_bytes + tiers.load_source_bytes)
        if tiers.store_entries:
            bound += freed * (HASH_BYTES + id_bytes)  # a write-through: a hash, 1 id
            report = step.report
            reported = len(report.store_failed) + len(report.refused) if report is not None else 0
            deletes = min(tiers.store_entries, (growth + freed) * tiers.deletes_per_save + reported)
            deletes += tiers.owed_deletes
            # a hash and a namespace with its tag
            bound += deletes * (HASH_BYTES + MAX_STORE_NAMESPACE_LEN + 3)
    return bound


def tier_bound(
    store_capacity_bytes: int, smallest_entry_bytes: int, block_bytes: int, peer: bool = False
) -> TierBound:
    """A tiered pool's `TierBound` in a store of this capacity whose smallest
    entry takes `smallest_entry_bytes` (0: no pool uses the store yet);
    `peer`: a peer store, whose loads name their writer's URL."""
    most = store_capacity_bytes // smallest_entry_bytes if smallest_entry_bytes else 0
    return TierBound(
        most,
        blocks_for(block_bytes, smallest_entry_bytes) if most else 0,
        MAX_ADVERTISE_URL_LEN + 4 if peer else 0,  # the URL, its tag and length
        min(most, OWED_DELETES_PER_STEP) if peer else 0,
    )


def dump_floor(pool: BlockPool) -> int:
    """The fewest bytes the full dump of `pool` (`to_state`, as
    `dumps_chunked` writes it) can take, counted without building it: per
    block its ref count, fill and stamp (a digit and a comma each) and its
    hash (`null,` or 64 hex digits in quotes and a comma); per table entry a
    digit and a comma; per hash a sequence holds 67 bytes. Less a comma per
    list for the last items, so never more than the dump (the tests check
    it): a dump whose floor is over the answer limit is refused unbuilt."""
    p = pool.parts()
    hashed = p.block_hash.num_held()
    seq_hashes = sum(q.num_hashed for q in p.seqs.values())
    lists = 8 + 3 * len(p.seqs)
    return max(
        0, 11 * pool.num_blocks + 62 * hashed + 2 * pool.table_entries + 67 * seq_hashes - lists
    )


# What `packed_bound` charges: per block of the pool (its five packed
# columns before compression, worst case: ref_cnt, fill, stamp, one free
# queue entry, a hash id, in base64; and its hash), per sequence (its fields
# and brackets), per character of a name (JSON escapes a character outside
# ASCII as up to 12 bytes), and per table or hash segment (two integers).
PACKED_BYTES_PER_BLOCK = (4 + 4 + 8 + 4 + 4) * 4 // 3 + 8 + (HASH_BYTES * 4 // 3 + 4)
PACKED_BYTES_PER_SEQUENCE = 96
PACKED_BYTES_PER_NAME_CHAR = 12
PACKED_BYTES_PER_SEGMENT = 2 * 21
PACKED_BYTES_FIXED = 4096


def packed_bound(
    num_blocks: int, sequences: int, name_chars: int, segments: int, tail_tokens: int
) -> int:
    """The most bytes `to_packed` of a pool of this shape can take (a formula
    in its blocks, sequences, name characters, segments and the tokens of
    its sequences' partly filled blocks, 11 bytes each)."""
    return (
        PACKED_BYTES_FIXED
        + PACKED_BYTES_PER_BLOCK * num_blocks
        + PACKED_BYTES_PER_SEQUENCE * sequences
        + PACKED_BYTES_PER_NAME_CHAR * name_chars
        + PACKED_BYTES_PER_SEGMENT * segments
        + 11 * tail_tokens
    )
