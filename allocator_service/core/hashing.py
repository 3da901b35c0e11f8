"""Hash-chained block hashes for prefix caching.

`h_i = SHA-256(h_{i-1} || canonical(tokens of block i) || canonical(extra keys))`.

The root `h_{-1}` comes from a fixed, versioned constant plus the model
fingerprint and the block size, so two processes (or two restarts, or the
allocator and a router) compute the same hashes for the same tokens. Python's
`hash()` is never used: it is salted per process.

Canonical encoding: every field is length-prefixed (u32 little endian), token
ids are u32 little endian. A `cache_salt` is an extra key of the FIRST block
only, which is enough to separate tenants since every later hash chains from it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Sequence

from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import MAX_TOKEN_ID
from allocator_service.core.pause_points import pace

HASH_SCHEME = b"pagedkv/prefix-cache/v1"

_U32 = struct.Struct("<I")
_NO_KEYS = _U32.pack(0)
# Blocks hashed between two pause points (~0.2 ms).
_PACE_BLOCKS = 64
# The packer of each count of tokens met (a block's, a run of blocks'),
# built once: formatting and parsing "<16I" cost three times the packing.
_PACKERS: dict[int, struct.Struct] = {}
_PACKERS_KEPT = 4096


def root_hash(model_fingerprint: str, block_size: int) -> bytes:
    """The parent hash of every sequence's first block."""
    h = hashlib.sha256()
    for part in (HASH_SCHEME, model_fingerprint.encode(), str(block_size).encode()):
        h.update(_U32.pack(len(part)))
        h.update(part)
    return h.digest()


def block_hash(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    """Hash of one full block chained from its parent's hash."""
    return _digest(parent, _pack(token_ids), len(token_ids), extra_keys)


def _pack(token_ids: Sequence[int]) -> bytes:
    """The canonical encoding of token ids (u32 little endian each)."""
    n = len(token_ids)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = struct.Struct(f"<{n}I")
        if len(_PACKERS) < _PACKERS_KEPT:
            _PACKERS[n] = packer
    try:
        return packer.pack(*token_ids)
    except struct.error as exc:  # negative, too large or not an int
        raise InvalidArgument(f"token ids must be integers in [0, {MAX_TOKEN_ID}]") from exc


def _digest(
    parent: bytes, packed: bytes | memoryview, count: int, extra_keys: Sequence[str]
) -> bytes:
    """The hash of a block whose `count` tokens `_pack` encoded as `packed`."""
    h = hashlib.sha256(parent)
    h.update(_U32.pack(count))
    h.update(packed)
    if not extra_keys:
        h.update(_NO_KEYS)
        return h.digest()
    h.update(_U32.pack(len(extra_keys)))
    for key in extra_keys:
        raw = key.encode()
        h.update(_U32.pack(len(raw)))
        h.update(raw)
    return h.digest()


def salt_keys(cache_salt: str | None) -> tuple[str, ...]:
    """Extra keys of a sequence's first block."""
    return ("salt:" + cache_salt,) if cache_salt else ()


def chain_hashes(
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    limit_blocks: int | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (at most `limit_blocks`),
    the first chained from `root` with the salt's extra keys; a pause point
    before every `_PACE_BLOCKS` blocks."""
    n = len(token_ids) // block_size
    if limit_blocks is not None:
        n = min(n, limit_blocks)
    out: list[bytes] = []
    for first in range(0, n, _PACE_BLOCKS):
        pace()
        last = min(n, first + _PACE_BLOCKS)
        blocks = token_ids[first * block_size : last * block_size]
        out += extend_chain(
            out[-1] if out else root, blocks, block_size, cache_salt if first == 0 else None
        )
    return out


def extend_chain(
    parent: bytes, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` chained from `parent`, the
    first with the salt's extra keys (a sequence's first block): the blocks a
    decode fills, or a chunk of `chain_hashes`. No pause point."""
    n = len(token_ids) // block_size
    if not n:
        return []
    width = 4 * block_size  # bytes of one block's packed tokens
    # Packed at once (one struct call, not one per block).
    packed = _pack(token_ids[: n * block_size])
    out: list[bytes] = []
    if keys := salt_keys(cache_salt):  # the first block's extra keys
        parent = _digest(parent, packed[:width], block_size, keys)
        out.append(parent)
    count, sha256 = _U32.pack(block_size), hashlib.sha256
    # NOTE: `_digest` of a block with no extra keys, inlined: one hash of the
    # joined fields (one call a block, not five; a decode fills one block)
    for at in range(width if out else 0, n * width, width):
        parent = sha256(b"".join((parent, count, packed[at : at + width], _NO_KEYS))).digest()
        out.append(parent)
    return out


def prompt_chain(
    model_fingerprint: str, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """The hashes a prefix-cache lookup of a prompt compares: its full blocks
    before its last token (that token is always computed, so its block is
    never taken from the cache). What MatchPrefix hashes, and a router
    matching in its copy of the pools' indexes."""
    return chain_hashes(
        root_hash(model_fingerprint, block_size),
        token_ids,
        block_size,
        cache_salt,
        limit_blocks=(len(token_ids) - 1) // block_size,
    )


def leading_hits(hashes: Sequence[bytes], cached: Container[bytes]) -> int:
    """How many of `hashes` (a prompt's chain), from the first, are in
    `cached`: the prefix a cache holds, since a block is reusable only
    after every block before it (the rule of `BlockPool.cached_blocks`, and
    of a router matching in its copy of a pool's index)."""
    hits = 0
    for h in hashes:
        if h not in cached:
            break
        hits += 1
    return hits
