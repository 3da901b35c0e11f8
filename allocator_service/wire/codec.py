"""The Step wire format: the core's step columns <-> `StepOps` /
`StepResponse`, shared by the server and the gRPC client.

Columns instead of one message per operation: a 256-sequence decode step is
then a few packed arrays, and both ends convert them with list operations
rather than 256 message objects (docs/benchmarks.md times the Step). The
core's `StepColumns` and `StepAnswer` have the wire's shape, so converting is
copying lists; the one step semantics is the core's `run_step`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

from allocator_service.core import (
    Op,
    PoolConfig,
    PoolStats,
    StepAnswer,
    StepColumns,
    step_columns,
)
from allocator_service.core import step as core_step
from allocator_service.core.block_hashes import HASH_BYTES
from allocator_service.core.limits import MAX_TOKEN_ID
from allocator_service.core.tiers import NO_MOVES, Moves, TierReport
from allocator_service.wire.bounds import MAX_ERROR_MESSAGE_BYTES
from allocator_service.wire.errors import (
    INVALID_ARGUMENT,
    OUT_OF_BLOCKS,
    POOL_LIMIT,
    SEQUENCE_EXISTS,
    UNKNOWN_SEQUENCE,
)
from allocator_service.wire.v1 import allocator_pb2 as pb

# NOTE: the core numbers kinds and per-operation errors as the wire enums do,
# so those columns cross the edge unmapped; this holds them equal.
assert (core_step.FREE, core_step.APPEND, core_step.ADMIT, core_step.FORK, core_step.UNRESERVE) == (
    pb.OP_KIND_FREE,
    pb.OP_KIND_APPEND,
    pb.OP_KIND_ADMIT,
    pb.OP_KIND_FORK,
    pb.OP_KIND_UNRESERVE,
)
assert core_step.ERROR_NUMBER == {
    OUT_OF_BLOCKS: pb.OP_ERROR_OUT_OF_BLOCKS,
    UNKNOWN_SEQUENCE: pb.OP_ERROR_UNKNOWN_SEQUENCE,
    SEQUENCE_EXISTS: pb.OP_ERROR_SEQUENCE_EXISTS,
    INVALID_ARGUMENT: pb.OP_ERROR_INVALID_ARGUMENT,
    POOL_LIMIT: pb.OP_ERROR_POOL_LIMIT,
}

STATS_FIELDS = tuple(f.name for f in dataclasses.fields(PoolStats))

# Every value of a uint32 field is a token id while MAX_TOKEN_ID is 2^32 - 1:
# a decoded step's tokens need no check (`StepColumns.tokens_valid`).
# (Checking them read every token of the field three times: type, min, max.)
_WIRE_TOKENS_VALID = MAX_TOKEN_ID >= 2**32 - 1

# RegisterPoolRequest.protocol_version: what this version's gRPC client
# sends, and from which version on the server refuses a Step of the pool
# without prev_step_id (so a lost journal tail is always caught).
PROTOCOL_VERSION = 2
PREV_STEP_ID_REQUIRED = 2


# ---------------------------------------------------------------- requests
def columns_to_proto(step: StepColumns) -> pb.StepOps:
    """Raises ValueError/TypeError for a token that is not an integer in
    [0, 2^32) (protobuf refuses it)."""
    msg = pb.StepOps()
    fill_ops(msg, step)
    return msg


def fill_ops(msg: pb.StepOps, step: StepColumns) -> None:
    """Write the columns into an empty `StepOps` in place: the client fills
    its `StepRequest.ops` this way, so the message is never copied. Raises
    as `columns_to_proto`."""
    msg.kinds.extend(step.kinds)
    msg.seq_ids.extend(step.seq_ids)
    msg.num_tokens.extend(step.num_tokens)
    msg.tokens.extend(step.tokens)
    if step.salts:
        add = msg.admit_options.add
        for salt, budget in zip(step.salts, step.num_new_tokens, strict=True):
            add(cache_salt=salt, num_new_tokens=budget)
    if step.children:
        msg.fork_children.extend(step.children)
    if step.num_reserved:
        msg.num_reserved.extend(step.num_reserved)
    report = step.report
    if report is not None and any(report):
        r = msg.report
        r.saved.extend(report.saved)
        r.failed.extend(report.failed)
        r.store_saved = b"".join(report.store_saved)
        r.store_failed = b"".join(report.store_failed)
        r.refused = b"".join(report.refused)


def columns_from_proto(msg: pb.StepOps) -> StepColumns:
    """The columns of `msg`. NOTE: `tokens` is the message's own repeated
    field, not a copy: `run_step` reads one token per decode and a slice per
    admit, and copying every prompt token of a step cost more than that
    (~30 us for 1,500 tokens). The per-operation columns, each read once per
    operation, are copied (indexing a list is cheaper)."""
    salts: list[str | None] = []
    budgets: list[int | None] = []
    for o in msg.admit_options:
        salts.append(o.cache_salt if o.HasField("cache_salt") else None)
        budgets.append(o.num_new_tokens if o.HasField("num_new_tokens") else None)
    report = None
    if msg.HasField("report"):
        r = msg.report
        report = TierReport(
            list(r.saved),
            list(r.failed),
            split_hashes(r.store_saved),
            split_hashes(r.store_failed),
            split_hashes(r.refused),
        )
    return StepColumns(
        list(msg.kinds),
        list(msg.seq_ids),
        list(msg.num_tokens),
        msg.tokens,
        salts,
        budgets,
        list(msg.fork_children),
        list(msg.num_reserved),
        report,
        _WIRE_TOKENS_VALID,
    )


def split_hashes(packed: bytes) -> list[bytes]:
    """The hashes of a packed field (HASH_BYTES bytes each, concatenated); a
    short last one is kept short, for the core to refuse."""
    return [packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def encode_ops(ops: Sequence[Op]) -> pb.StepOps:
    """The `StepOps` of operation objects (the gRPC client's request)."""
    return columns_to_proto(step_columns(ops))


def ops_digest(msg: pb.StepOps) -> bytes:
    """What a retried step id must match: SHA-256 of the canonical encoding."""
    return digest_of(canonical_ops(msg))


def digest_of(ops: bytes) -> bytes:
    """`ops_digest` of operations already encoded by `canonical_ops`."""
    return hashlib.sha256(ops).digest()


def canonical_ops(msg: pb.StepOps) -> bytes:
    """The canonical encoding of a step's operations: what its digest covers
    and what the journal stores (encoded once, `journal_step_record`)."""
    return msg.SerializeToString(deterministic=True)


def step_from_proto(msg: pb.StepOps) -> tuple[StepColumns, bytes]:
    """A request's operations as the service takes them: their columns and
    their canonical encoding."""
    return columns_from_proto(msg), canonical_ops(msg)


# --------------------------------------------------------------- responses
# The answer's columns ride StepResponse fields of their names; its tier
# moves ride the `moves` sub-message (`TierMoves`, the same fields), hashes packed.
assert set(StepAnswer.COLUMNS) <= set(pb.StepResponse.DESCRIPTOR.fields_by_name)
assert tuple(pb.TierMoves.DESCRIPTOR.fields_by_name) == Moves._fields
_HASH_MOVES = frozenset(("store_deletes", "store_saves", "store_loads"))  # packed bytes on the wire


def result_to_proto(
    step_id: int, answer: StepAnswer, writer_url: Callable[[str], str] | None = None
) -> pb.StepResponse:
    """`writer_url`: a peer store's writer (pool id) -> its URL, what a load
    names on the wire (`TierMoves.store_load_from`)."""
    columns = {f: getattr(answer, f) for f in StepAnswer.COLUMNS}
    messages = answer.error_messages
    if messages and max(map(len, messages)) > MAX_ERROR_MESSAGE_BYTES // 4:
        columns["error_messages"] = [_clip(m) for m in messages]
    msg = pb.StepResponse(step_id=step_id, **columns)
    moves = answer.moves
    if moves.store_load_from and writer_url is not None:
        moves = moves._replace(store_load_from=[writer_url(w) for w in moves.store_load_from])
    if any(moves):
        msg.moves.CopyFrom(
            pb.TierMoves(
                **{
                    f: b"".join(v) if f in _HASH_MOVES else v
                    for f, v in zip(Moves._fields, moves, strict=True)
                    if v
                }
            )
        )
    return msg


def _moves_from_proto(m: pb.TierMoves) -> Moves:
    return Moves(
        *(
            split_hashes(getattr(m, f)) if f in _HASH_MOVES else list(getattr(m, f))
            for f in Moves._fields
        )
    )


def _clip(message: str) -> str:
    raw = message.encode()
    if len(raw) <= MAX_ERROR_MESSAGE_BYTES:
        return message
    return raw[: MAX_ERROR_MESSAGE_BYTES - 3].decode(errors="ignore") + "\u2026"


def decode_results(resp: pb.StepResponse, num_ops: int) -> StepAnswer:
    """The answer of a response to `num_ops` operations: no object per
    operation. NOTE: the columns are the message's own repeated fields, read
    in place (indexing, slicing, iterating), not copied: a consumer reads a
    few entries of a decode step's columns, and copying all nine cost more
    than that (~60 us at 256 operations)."""
    if len(resp.errors) != num_ops:
        raise ValueError(f"the server answered {len(resp.errors)} results for {num_ops} operations")
    moves = _moves_from_proto(resp.moves) if resp.HasField("moves") else NO_MOVES
    return StepAnswer(*[getattr(resp, f) for f in StepAnswer.COLUMNS], moves)


# ------------------------------------------------------------ pool shape
def shape_to_proto(config: PoolConfig) -> pb.PoolShape:
    return pb.PoolShape(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        model_fingerprint=config.model_fingerprint,
        enable_prefix_caching=config.enable_prefix_caching,
        host_blocks=config.host_blocks,
        layout=config.layout,
        block_bytes=config.block_bytes,
        use_shared_store=config.use_shared_store,
        store_group=config.store_group,
        kv_role=config.kv_role,
    )


def config_from_proto(shape: pb.PoolShape) -> PoolConfig:
    """PoolConfig validates (raises the core's InvalidArgument)."""
    return PoolConfig(
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        enable_prefix_caching=shape.enable_prefix_caching,
        model_fingerprint=shape.model_fingerprint,
        host_blocks=shape.host_blocks,
        layout=shape.layout,
        block_bytes=shape.block_bytes,
        use_shared_store=shape.use_shared_store,
        store_group=shape.store_group,
        kv_role=shape.kv_role or "both",  # (unset: a worker or journal older than roles)
    )


# ------------------------------------------------------------ the listing
class PoolInfo(NamedTuple):
    """One live pool as ListPools lists it: the service's answer, the wire's
    `PoolInfo` (same fields) and what `RouterClient.list_pools` returns."""

    pool_id: str
    worker_id: str
    model_fingerprint: str
    served_model_name: str
    advertise_url: str
    block_size: int
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    num_sequences: int
    enable_prefix_caching: bool
    attest_key: bytes = b""  # proves the worker's identity answers (`attest.py`)
    # KV tiers (0 / False: none)
    host_blocks: int = 0  # host tier slots
    host_used_blocks: int = 0  # of those, holding an entry (pending or present)
    use_shared_store: bool = False
    store_used_bytes: int = 0  # the shared store's bytes in use (every pool's)
    host_hit_tokens: int = 0  # prompt tokens whose loads from the host tier admissions issued
    store_hit_tokens: int = 0  # ... from the shared store
    kv_role: str = "both"  # its part in prefill/decode disaggregation
    store_namespace: str = ""  # where its blocks live in the shared store ("" without it)


class PrefixMatch(NamedTuple):
    """How much of a prompt one pool holds, as MatchPrefix answers it: the
    service's answer, the wire's `PrefixMatch` (same fields) and what
    `RouterClient.match_prefix` returns."""

    pool_id: str
    worker_id: str
    cached_tokens: int  # in the KV pool
    free_blocks: int
    block_size: int
    host_tokens: int = 0  # past those, in the pool's host tier ...
    store_tokens: int = 0  # ... and in the shared store


def match_to_proto(match: PrefixMatch) -> pb.PrefixMatch:
    return pb.PrefixMatch(**match._asdict())


def match_from_proto(msg: pb.PrefixMatch) -> PrefixMatch:
    return PrefixMatch(*(getattr(msg, f) for f in PrefixMatch._fields))


def pool_info_to_proto(info: PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(**info._asdict())


def pool_info_from_proto(msg: pb.PoolInfo) -> PoolInfo:
    return PoolInfo(*(getattr(msg, f) for f in PoolInfo._fields))


# ------------------------------------------------------------------- stats
def stats_to_proto(stats: PoolStats, **extra) -> pb.GetPoolStatsResponse:
    return pb.GetPoolStatsResponse(**{f: getattr(stats, f) for f in STATS_FIELDS}, **extra)


def stats_from_proto(msg: pb.GetPoolStatsResponse) -> PoolStats:
    return PoolStats(**{f: getattr(msg, f) for f in STATS_FIELDS})
