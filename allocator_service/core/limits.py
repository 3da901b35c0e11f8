"""The bounds on a pool's shape and on one operation's arguments: defined
here once and imported by every check (the core, the service, the worker).

These are properties of the block contract, so the core owns them. The
service's per-call and server-wide bounds (operations per step, tokens per
call, pools, blocks) are deployment settings: `allocator_service.config.Limits`.
"""

from __future__ import annotations

# Token ids travel as uint32 (the wire format and the block hash encoding).
MAX_TOKEN_ID = 2**32 - 1

# Blocks in one pool: the metadata of one block costs ~80 bytes of Python objects,
# ~185 once it holds a cached hash, ~265 once that block is free (the RSS of one
# pool of 2^20 blocks; less where pools share their block ids: docs/performance.md).
MAX_NUM_BLOCKS = 1 << 24

# Token slots per block.
# NOTE: 1024, not more: the worker's decode kernel loads a whole block as one
# tile (`BLOCK_N` = the next power of two of the block size), and no worker
# can run a pool with larger blocks, so the allocator does not accept one.
MAX_BLOCK_SIZE = 1024

# Slots one APPEND may reserve for tokens not known yet (async scheduling
# reserves one per sampled token; the service also counts them against its
# tokens-per-call bound).
MAX_RESERVE = 1 << 20

# Characters of a model fingerprint (it enters the root hash).
MAX_FINGERPRINT_LEN = 1024

# A pool's KV tiers: slots of its host tier (blocks, as the KV pool), the
# characters of its KV layout key (a digest the worker computes: 64 hex
# digits) and of its store group (a name the operator gives), and the bytes
# of one block's K and V (what a store entry takes). Both names are of
# STORE_NAME_CHARS, so a store namespace `GROUP.LAYOUT` is unambiguous and
# every store key (namespace, '-', 64 hex digits) is one short ASCII word.
MAX_HOST_BLOCKS = 1 << 24
MAX_LAYOUT_LEN = 64
MAX_STORE_GROUP_LEN = 64
MAX_STORE_NAMESPACE_LEN = MAX_STORE_GROUP_LEN + 1 + MAX_LAYOUT_LEN
STORE_NAME_CHARS = "A-Za-z0-9_-"
MAX_BLOCK_BYTES = 1 << 40

# Characters of what a worker advertises with its pool for routers: its HTTP
# URL and its served model name (kept per pool and in every snapshot).
MAX_ADVERTISE_URL_LEN = 2048
MAX_SERVED_MODEL_NAME_LEN = 256

# Characters of a sequence id.
MAX_SEQ_ID_LEN = 256

# Characters of a per-request `cache_salt` (it enters the first block's hash).
MAX_SALT_LEN = 1024

# What one pool's sequences may hold, whatever legal operations arrive: the
# bound that keeps the allocator's memory proportional to the blocks it serves
# (docs/architecture.md, "Bounded cost"). Derived from the pool's shape only,
# never from a deployment setting, so replaying a journal always refuses
# exactly what was refused when the record was accepted.
#
# Table entries summed over the pool's sequences (a fork of an L-block
# sequence adds L, shared blocks count once per table naming them): at most
# this many per block of the pool, and never fewer than the floor.
TABLE_ENTRIES_PER_BLOCK = 16
MIN_TABLE_ENTRIES = 1024
# Live sequences of a pool (empty ones and forks included).
SEQUENCES_PER_BLOCK = 2
MIN_SEQUENCES = 64
# Characters of the names a pool holds: each sequence's id plus its salt (a
# fork is charged its parent's salt too). A Python string takes up to 4 bytes
# a character, so this bounds the bytes of ids and salts.
NAME_CHARS_PER_BLOCK = 512
MIN_NAME_CHARS = MIN_SEQUENCES * (MAX_SEQ_ID_LEN + MAX_SALT_LEN)


def max_table_entries(num_blocks: int) -> int:
    """Table entries one pool of `num_blocks` blocks may hold in total."""
    return max(TABLE_ENTRIES_PER_BLOCK * num_blocks, MIN_TABLE_ENTRIES)


def max_sequences(num_blocks: int) -> int:
    """Sequences one pool of `num_blocks` blocks may hold at once."""
    return max(SEQUENCES_PER_BLOCK * num_blocks, MIN_SEQUENCES)


def max_name_chars(num_blocks: int) -> int:
    """Characters of sequence ids and salts one pool may hold in total."""
    return max(NAME_CHARS_PER_BLOCK * num_blocks, MIN_NAME_CHARS)
