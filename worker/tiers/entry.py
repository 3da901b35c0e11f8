"""A shared-store entry: a header that names what the bytes are, then one block's payload.

Header (little-endian, 96 bytes):

    magic b"PKVB" | format version u16 | flags u16 | layout key (32 bytes) |
    block hash (32 bytes) | payload length u64 | 16 bytes: see below

- plain (flags 0): the 16 bytes are the XXH3-128 of the payload, which follows;
- sealed (flags 1, `seal.StoreSeal`): the 16 bytes are the entry key's salt; then
  the key id (8 bytes) and the payload sealed with AES-256-GCM (its length + a
  16-byte tag), with the header, key id and store key as associated data.

The store key is `NAMESPACE-HASH`, so equal content has one key per group.
`decode_entry` checks every header field against what the reader asked for; a
mismatch is a `Refused` value and the payload is never handed out. Reasons:
`format` (short, wrong magic or version), `layout` (another KV layout),
`checksum` (another hash in the header, a length that disagrees, or the
payload's checksum), `seal` (a reader with a key met a plain entry, another
group's, or a forged or altered one; a reader without a key met a sealed one).
Why a checksum or a seal: docs/operations.md, "Security".
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from allocator_service.core.block_hashes import HASH_BYTES
from worker.tiers.layout import KVLayout
from worker.tiers.seal import KEY_ID_BYTES, TAG_BYTES, StoreSeal

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
_HEADER = struct.Struct(f"<4sHH32s{HASH_BYTES}sQ16s")
HEADER_BYTES = _HEADER.size
REFUSAL_REASONS = ("format", "layout", "checksum", "seal")
SEALED = 1  # the flags bit of a sealed entry


class Refused(NamedTuple):
    """An entry that is not loaded: `reason` one of REFUSAL_REASONS, `detail` for the log."""

    reason: str
    detail: str


def _check_hash(block_hash: bytes) -> None:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")


def entry_key(namespace: KVLayout | str, block_hash: bytes) -> str:
    """The store key of `block_hash`'s entry in a store namespace (a layout's, or the
    namespace the allocator gave: `GROUP.LAYOUT`): `NAMESPACE-HASH` in hex."""
    _check_hash(block_hash)
    return f"{namespace if isinstance(namespace, str) else namespace.key}-{block_hash.hex()}"


def encode_entry(
    layout: KVLayout,
    block_hash: bytes,
    payload: bytes | memoryview,
    *,
    seal: StoreSeal | None = None,
    namespace: str = "",
) -> bytes:
    """Header + payload for the store; `payload` is one block's bytes in `layout`.
    With `seal`, sealed and bound to its store key in `namespace` (the layout's when "")."""
    _check_hash(block_hash)
    view = memoryview(payload).cast("B")
    if view.nbytes != layout.block_bytes:
        raise ValueError(
            f"a block of layout {layout.key[:12]} is {layout.block_bytes} B, got {view.nbytes} B"
        )
    if seal is None:
        return (
            _HEADER.pack(
                MAGIC,
                FORMAT_VERSION,
                0,
                bytes.fromhex(layout.key),
                block_hash,
                view.nbytes,
                xxhash.xxh3_128_digest(view),
            )
            + view
        )
    salt = seal.new_salt()
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, SEALED, bytes.fromhex(layout.key), block_hash, view.nbytes, salt
    )
    return (
        header
        + seal.key_id
        + seal.seal(salt, view, _bound(header, seal.key_id, namespace or layout, block_hash))
    )


def _bound(header: bytes, key_id: bytes, namespace: KVLayout | str, block_hash: bytes) -> bytes:
    """A sealed entry's associated data: its header, key id and store key."""
    return header + key_id + entry_key(namespace, block_hash).encode()


def decode_entry(
    data: bytes | memoryview,
    layout: KVLayout,
    block_hash: bytes,
    *,
    seal: StoreSeal | None = None,
    namespace: str = "",
) -> memoryview | Refused:
    """The payload of `data` if it is `block_hash`'s entry in `layout` and intact (and, with
    `seal`, sealed under its key for its store key in `namespace`), else why not."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_BYTES:
        return Refused("format", f"{view.nbytes} B is shorter than an entry header")
    magic, version, flags, layout_raw, hash_raw, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        return Refused("format", f"magic {magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        return Refused("format", f"format version {version}, this worker reads {FORMAT_VERSION}")
    if layout_raw.hex() != layout.key:
        return Refused(
            "layout", f"layout {layout_raw.hex()[:12]}, this worker's is {layout.key[:12]}"
        )
    if hash_raw != block_hash:
        return Refused(
            "checksum", f"the header names block {hash_raw.hex()[:12]}, not {block_hash.hex()[:12]}"
        )
    if flags not in (0, SEALED):
        return Refused("format", f"flags {flags:#x}, this worker reads 0 and {SEALED:#x}")
    if (flags == SEALED) != (seal is not None):
        return Refused(
            "seal",
            "sealed, and this worker holds no store key (--kv-store-key-file)"
            if seal is None
            else "not sealed: a worker with a store key loads only entries sealed under it",
        )
    body = view[HEADER_BYTES:]
    sealed_extra = KEY_ID_BYTES + TAG_BYTES if seal is not None else 0
    if length != layout.block_bytes or body.nbytes != length + sealed_extra:
        return Refused(
            "checksum",
            f"payload of {body.nbytes - sealed_extra} B, header says {length} B, "
            f"the layout {layout.block_bytes} B",
        )
    if seal is None:
        if xxhash.xxh3_128_digest(body) != checksum:
            return Refused("checksum", "the payload's checksum does not match its header")
        return body
    key_id = bytes(body[:KEY_ID_BYTES])
    if key_id != seal.key_id:
        return Refused(
            "seal", f"sealed under store key {key_id.hex()}, this worker holds {seal.key_id.hex()}"
        )
    opened = seal.open(
        checksum,
        body[KEY_ID_BYTES:],
        _bound(bytes(view[:HEADER_BYTES]), key_id, namespace or layout, block_hash),
    )
    if opened is None:
        return Refused(
            "seal",
            "does not open under the store group's key (forged, altered, or moved from "
            "another store key)",
        )
    return memoryview(opened)
