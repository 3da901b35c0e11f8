"""The journal's bytes: each record framed with a chained digest
(`encode_entry`), a step's record built around its operations' bytes
(`encode_step_record`), the head marker, and the stored snapshot
(`encode_snapshot`, `decode_snapshot`). `journal.py` stores them; replaying
them is `replay.py`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, NamedTuple

from allocator_service.store.registry import CorruptState
from allocator_service.wire.v1 import journal_pb2 as jpb

# A stored record: ENTRY_MAGIC | previous chain (32) | chain (32) | record,
# chain = SHA-256(previous chain || record). A stored snapshot:
# SNAPSHOT_MAGIC | SHA-256(json) (32) | json. Older versions stored the bare
# record and the bare JSON: both still load (with a warning).
#
# With a journal key (the allocator's `journal_key_file`) the digests are
# HMAC-SHA256 under it instead, and the magics say so (KEYED_*): whoever
# can write to Redis but does not hold the key cannot edit a record and
# recompute the chain. Without a key, Redis is trusted with the state.
ENTRY_MAGIC = b"PKJ2"
SNAPSHOT_MAGIC = b"PKS2"
KEYED_ENTRY_MAGIC = b"PKJ3"
KEYED_SNAPSHOT_MAGIC = b"PKS3"
ZERO_CHAIN = bytes(32)
# Bytes before a framed record: the magic and the two chain digests.
FRAME = len(ENTRY_MAGIC) + 64


def _digest(data: bytes, key: bytes | None) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest() if key else hashlib.sha256(data).digest()


def chain_digest(prev: bytes, record: bytes, key: bytes | None = None) -> bytes:
    return _digest(prev + record, key)


def encode_entry(prev: bytes, record: bytes, key: bytes | None = None) -> tuple[bytes, bytes]:
    """(stored bytes, chain digest) of a record that follows `prev`."""
    chain = chain_digest(prev, record, key)
    return (KEYED_ENTRY_MAGIC if key else ENTRY_MAGIC) + prev + chain + record, chain


def is_framed(raw: bytes) -> bool:
    return raw.startswith((ENTRY_MAGIC, KEYED_ENTRY_MAGIC)) and len(raw) >= FRAME


def record_bytes(raw: bytes) -> bytes:
    """The JournalRecord bytes of a stored entry (framed or older bare)."""
    return raw[FRAME:] if is_framed(raw) else raw


class StepRecord(NamedTuple):
    """A step record before its place in the log is known: the operations
    as the bytes the step's digest covers (`codec.canonical_ops`)."""

    pool_id: str
    step_id: int
    digest: bytes
    ops: bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


# Field numbers of JournalRecord.step and StepApplied.ops (journal.proto).
_RECORD_STEP = jpb.JournalRecord.DESCRIPTOR.fields_by_name["step"].number
_STEP_OPS = jpb.StepApplied.DESCRIPTOR.fields_by_name["ops"].number


def encode_step_record(index: int, step: StepRecord, prev_step_id: int) -> bytes:
    """The serialized `JournalRecord` of a step, byte for byte what
    protobuf gives for `JournalRecord(index, step=StepApplied(pool_id,
    step_id, digest, ops, prev_step_id))`, built around the operations'
    bytes as they are: a 256-operation step is not parsed back into a
    message and encoded again on the hot path. (Fields in number order, as
    protobuf writes them: ops, field 4, sits between digest and
    prev_step_id.)"""
    head = jpb.StepApplied(
        pool_id=step.pool_id, step_id=step.step_id, digest=step.digest
    ).SerializeToString()
    tail = jpb.StepApplied(prev_step_id=prev_step_id).SerializeToString()
    inner = head + _length_delimited(_STEP_OPS, step.ops) + tail
    return jpb.JournalRecord(index=index).SerializeToString() + _length_delimited(
        _RECORD_STEP, inner
    )


def head_marker(index: int, chain: bytes) -> bytes:
    return f"{index}:{chain.hex()}".encode()


def encode_snapshot(
    snap: dict[str, Any], pools_json: list[str] | None = None, key: bytes | None = None
) -> bytes:
    """The stored snapshot; `pools_json`: its pools already as JSON text
    (`registry.pool_snapshot_json`), else they are in `snap["pools"]`;
    `key`: the journal key its digest is keyed with."""
    if pools_json is None:
        body = json.dumps(snap, separators=(",", ":")).encode()
    else:
        head = json.dumps({**snap, "pools": []}, separators=(",", ":"))
        assert head.endswith("[]}")
        body = (head[:-2] + ",".join(pools_json) + "]}").encode()
    return (KEYED_SNAPSHOT_MAGIC if key else SNAPSHOT_MAGIC) + _digest(body, key) + body


def decode_snapshot(raw: bytes, key: bytes | None = None) -> tuple[dict[str, Any], bool]:
    """(snapshot, legacy); CorruptState if it fails its digest or parse, or
    if it is not keyed with `key` (with a key, nothing else is trusted)."""
    keyed = raw.startswith(KEYED_SNAPSHOT_MAGIC)
    if keyed and not key:
        raise CorruptState(
            "the snapshot is keyed (written with a journal key) and no journal key is configured"
        )
    if key and not keyed:
        raise CorruptState(
            "the snapshot is not keyed with the journal key (written without it, or forged)"
        )
    legacy = not keyed and not raw.startswith(SNAPSHOT_MAGIC)
    body = raw if legacy else raw[len(SNAPSHOT_MAGIC) + 32 :]
    if not legacy and not hmac.compare_digest(
        _digest(body, key), raw[len(SNAPSHOT_MAGIC) : len(SNAPSHOT_MAGIC) + 32]
    ):
        raise CorruptState("the snapshot fails its digest")
    try:
        snap = json.loads(body)
    except ValueError as exc:
        raise CorruptState(f"the snapshot is not readable JSON ({exc})") from exc
    if not isinstance(snap, dict):
        raise CorruptState("the snapshot is not a JSON object")
    return snap, legacy
