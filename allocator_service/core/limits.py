"""The bounds on a pool's shape and on one operation's arguments: defined
here once and imported by every check (the core, the service, the worker).

These are properties of the block contract, so the core owns them. The
service's per-call and server-wide bounds (operations per step, tokens per
call, pools, blocks) are deployment settings: `allocator_service.config.Limits`.
"""

from __future__ import annotations

# Token ids travel as uint32 (the wire format and the block hash encoding).
MAX_TOKEN_ID = 2**32 - 1

# Blocks in one pool: the metadata of one block costs ~50 bytes of Python lists.
MAX_NUM_BLOCKS = 1 << 24

# Token slots per block.
# NOTE: 1024, not more: the worker's decode kernel loads a whole block as one
# tile (`BLOCK_N` = the next power of two of the block size), and no worker
# can run a pool with larger blocks, so the allocator does not accept one.
MAX_BLOCK_SIZE = 1024

# Characters of a model fingerprint (it enters the root hash).
MAX_FINGERPRINT_LEN = 1024

# Characters of a sequence id.
MAX_SEQ_ID_LEN = 256

# Characters of a per-request `cache_salt` (it enters the first block's hash).
MAX_SALT_LEN = 1024
