"""A shared-store entry: a header that names what the bytes are, then one block's payload.

Header (little-endian, 96 bytes):

    magic b"PKVB" | format version u16 | flags u16 (0) | layout key (32 bytes) |
    block hash (32 bytes) | payload length u64 | XXH3-128 of the payload (16 bytes)

The entry's key is derived from (layout key, block hash) alone, so equal content
has one key whoever writes it. `decode_entry` checks every header field against
what the reader asked for; a mismatch is a `Refused` value with its reason, and
the payload is then never handed out:
- `format`: not an entry of this format and version (short, wrong magic or version);
- `layout`: written by a worker of another KV layout;
- `checksum`: the bytes are not what was written (another hash in the header, a
  length that disagrees, or the payload's checksum).

XXH3-128 (the xxhash package) is a checksum against corruption at ~20 GB/s a core,
not a signature: who may write into the store is the store's access control.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from worker.tiers.layout import KVLayout

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "REFUSAL_REASONS",
    "Refused",
    "decode_entry",
    "encode_entry",
    "entry_key",
]

MAGIC = b"PKVB"
FORMAT_VERSION = 1
HASH_BYTES = 32  # a block hash (allocator_service.core.hashing: SHA-256)
_HEADER = struct.Struct(f"<4sHH32s{HASH_BYTES}sQ16s")
HEADER_BYTES = _HEADER.size
REFUSAL_REASONS = ("format", "layout", "checksum")


class Refused(NamedTuple):
    """An entry that is not loaded: `reason` one of REFUSAL_REASONS, `detail` for the log."""

    reason: str
    detail: str


def _check_hash(block_hash: bytes) -> None:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")


def entry_key(layout: KVLayout | str, block_hash: bytes) -> str:
    """The store key of `block_hash`'s entry in `layout` (or the layout key): `LAYOUT-HASH` in hex."""
    _check_hash(block_hash)
    return f"{layout if isinstance(layout, str) else layout.key}-{block_hash.hex()}"


def encode_entry(layout: KVLayout, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """Header + payload for the store; `payload` is one block's bytes in `layout`."""
    _check_hash(block_hash)
    view = memoryview(payload).cast("B")
    if view.nbytes != layout.block_bytes:
        raise ValueError(f"a block of layout {layout.key[:12]} is {layout.block_bytes} B, got {view.nbytes} B")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, bytes.fromhex(layout.key), block_hash, view.nbytes,
                          xxhash.xxh3_128_digest(view))
    return header + view


def decode_entry(data: bytes | memoryview, layout: KVLayout, block_hash: bytes) -> memoryview | Refused:
    """The payload of `data` if it is `block_hash`'s entry in `layout` and intact, else why not."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_BYTES:
        return Refused("format", f"{view.nbytes} B is shorter than an entry header")
    magic, version, _flags, layout_raw, hash_raw, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        return Refused("format", f"magic {magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        return Refused("format", f"format version {version}, this worker reads {FORMAT_VERSION}")
    if layout_raw.hex() != layout.key:
        return Refused("layout", f"layout {layout_raw.hex()[:12]}, this worker's is {layout.key[:12]}")
    if hash_raw != block_hash:
        return Refused("checksum", f"the header names block {hash_raw.hex()[:12]}, not {block_hash.hex()[:12]}")
    payload = view[HEADER_BYTES:]
    if length != layout.block_bytes or payload.nbytes != length:
        return Refused("checksum", f"payload of {payload.nbytes} B, header says {length} B, "
                                   f"the layout {layout.block_bytes} B")
    if xxhash.xxh3_128_digest(payload) != checksum:
        return Refused("checksum", "the payload's checksum does not match its header")
    return payload
