from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    OP_KIND_FREE: _ClassVar[OpKind]
    OP_KIND_APPEND: _ClassVar[OpKind]
    OP_KIND_ADMIT: _ClassVar[OpKind]
    OP_KIND_FORK: _ClassVar[OpKind]
    OP_KIND_UNRESERVE: _ClassVar[OpKind]

class OpError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_ERROR_NONE: _ClassVar[OpError]
    OP_ERROR_OUT_OF_BLOCKS: _ClassVar[OpError]
    OP_ERROR_UNKNOWN_SEQUENCE: _ClassVar[OpError]
    OP_ERROR_SEQUENCE_EXISTS: _ClassVar[OpError]
    OP_ERROR_INVALID_ARGUMENT: _ClassVar[OpError]
    OP_ERROR_POOL_LIMIT: _ClassVar[OpError]

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_BLOCK_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_BLOCK_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_ALL_CLEARED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_POOL_REGISTERED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_POOL_DROPPED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_RESYNC_REQUIRED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_SNAPSHOT_END: _ClassVar[KvEventKind]
    KV_EVENT_KIND_POOL_CACHED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_BLOCKS_CHANGED: _ClassVar[KvEventKind]
OP_KIND_UNSPECIFIED: OpKind
OP_KIND_FREE: OpKind
OP_KIND_APPEND: OpKind
OP_KIND_ADMIT: OpKind
OP_KIND_FORK: OpKind
OP_KIND_UNRESERVE: OpKind
OP_ERROR_NONE: OpError
OP_ERROR_OUT_OF_BLOCKS: OpError
OP_ERROR_UNKNOWN_SEQUENCE: OpError
OP_ERROR_SEQUENCE_EXISTS: OpError
OP_ERROR_INVALID_ARGUMENT: OpError
OP_ERROR_POOL_LIMIT: OpError
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_BLOCK_STORED: KvEventKind
KV_EVENT_KIND_BLOCK_REMOVED: KvEventKind
KV_EVENT_KIND_ALL_CLEARED: KvEventKind
KV_EVENT_KIND_POOL_REGISTERED: KvEventKind
KV_EVENT_KIND_POOL_DROPPED: KvEventKind
KV_EVENT_KIND_RESYNC_REQUIRED: KvEventKind
KV_EVENT_KIND_SNAPSHOT_END: KvEventKind
KV_EVENT_KIND_POOL_CACHED: KvEventKind
KV_EVENT_KIND_BLOCKS_CHANGED: KvEventKind

class PoolRef(_message.Message):
    __slots__ = ("pool_id", "credential")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    credential: str
    def __init__(self, pool_id: _Optional[str] = ..., credential: _Optional[str] = ...) -> None: ...

class PoolShape(_message.Message):
    __slots__ = ("num_blocks", "block_size", "model_fingerprint", "enable_prefix_caching", "host_blocks", "layout", "block_bytes", "use_shared_store", "store_group", "kv_role")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    USE_SHARED_STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_GROUP_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    model_fingerprint: str
    enable_prefix_caching: bool
    host_blocks: int
    layout: str
    block_bytes: int
    use_shared_store: bool
    store_group: str
    kv_role: str
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., host_blocks: _Optional[int] = ..., layout: _Optional[str] = ..., block_bytes: _Optional[int] = ..., use_shared_store: _Optional[bool] = ..., store_group: _Optional[str] = ..., kv_role: _Optional[str] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("worker_id", "shape", "replace_credential", "advertise_url", "served_model_name", "protocol_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_URL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shape: PoolShape
    replace_credential: str
    advertise_url: str
    served_model_name: str
    protocol_version: int
    def __init__(self, worker_id: _Optional[str] = ..., shape: _Optional[_Union[PoolShape, _Mapping]] = ..., replace_credential: _Optional[str] = ..., advertise_url: _Optional[str] = ..., served_model_name: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "epoch", "credential", "lease_ttl_s", "op_kinds", "shared_store", "store_namespace")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    OP_KINDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    credential: str
    lease_ttl_s: float
    op_kinds: _containers.RepeatedScalarFieldContainer[OpKind]
    shared_store: str
    store_namespace: str
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., credential: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., op_kinds: _Optional[_Iterable[_Union[OpKind, str]]] = ..., shared_store: _Optional[str] = ..., store_namespace: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_s",)
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: float
    def __init__(self, lease_ttl_s: _Optional[float] = ...) -> None: ...

class DeregisterPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ...) -> None: ...

class DeregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdmitOptions(_message.Message):
    __slots__ = ("cache_salt", "num_new_tokens")
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache_salt: str
    num_new_tokens: int
    def __init__(self, cache_salt: _Optional[str] = ..., num_new_tokens: _Optional[int] = ...) -> None: ...

class StepOps(_message.Message):
    __slots__ = ("kinds", "seq_ids", "num_tokens", "tokens", "admit_options", "fork_children", "num_reserved", "report")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    FORK_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[OpKind]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    admit_options: _containers.RepeatedCompositeFieldContainer[AdmitOptions]
    fork_children: _containers.RepeatedScalarFieldContainer[str]
    num_reserved: _containers.RepeatedScalarFieldContainer[int]
    report: TierReport
    def __init__(self, kinds: _Optional[_Iterable[_Union[OpKind, str]]] = ..., seq_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., admit_options: _Optional[_Iterable[_Union[AdmitOptions, _Mapping]]] = ..., fork_children: _Optional[_Iterable[str]] = ..., num_reserved: _Optional[_Iterable[int]] = ..., report: _Optional[_Union[TierReport, _Mapping]] = ...) -> None: ...

class TierReport(_message.Message):
    __slots__ = ("saved", "failed", "store_saved", "store_failed", "refused")
    SAVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVED_FIELD_NUMBER: _ClassVar[int]
    STORE_FAILED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    saved: _containers.RepeatedScalarFieldContainer[int]
    failed: _containers.RepeatedScalarFieldContainer[int]
    store_saved: bytes
    store_failed: bytes
    refused: bytes
    def __init__(self, saved: _Optional[_Iterable[int]] = ..., failed: _Optional[_Iterable[int]] = ..., store_saved: _Optional[bytes] = ..., store_failed: _Optional[bytes] = ..., refused: _Optional[bytes] = ...) -> None: ...

class TierMoves(_message.Message):
    __slots__ = ("store_deletes", "store_delete_layouts", "store_saves", "store_save_from", "host_saves", "host_loads", "store_loads", "store_load_to")
    STORE_DELETES_FIELD_NUMBER: _ClassVar[int]
    STORE_DELETE_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVES_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVE_FROM_FIELD_NUMBER: _ClassVar[int]
    HOST_SAVES_FIELD_NUMBER: _ClassVar[int]
    HOST_LOADS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOADS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOAD_TO_FIELD_NUMBER: _ClassVar[int]
    store_deletes: bytes
    store_delete_layouts: _containers.RepeatedScalarFieldContainer[str]
    store_saves: bytes
    store_save_from: _containers.RepeatedScalarFieldContainer[int]
    host_saves: _containers.RepeatedScalarFieldContainer[int]
    host_loads: _containers.RepeatedScalarFieldContainer[int]
    store_loads: bytes
    store_load_to: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, store_deletes: _Optional[bytes] = ..., store_delete_layouts: _Optional[_Iterable[str]] = ..., store_saves: _Optional[bytes] = ..., store_save_from: _Optional[_Iterable[int]] = ..., host_saves: _Optional[_Iterable[int]] = ..., host_loads: _Optional[_Iterable[int]] = ..., store_loads: _Optional[bytes] = ..., store_load_to: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool", "step_id", "ops", "prev_step_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    PREV_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    step_id: int
    ops: StepOps
    prev_step_id: int
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., step_id: _Optional[int] = ..., ops: _Optional[_Union[StepOps, _Mapping]] = ..., prev_step_id: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "errors", "keep", "num_appended", "appended", "num_copies", "copies", "cached_tokens", "num_stored", "error_messages", "moves")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    NUM_APPENDED_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    errors: _containers.RepeatedScalarFieldContainer[OpError]
    keep: _containers.RepeatedScalarFieldContainer[int]
    num_appended: _containers.RepeatedScalarFieldContainer[int]
    appended: _containers.RepeatedScalarFieldContainer[int]
    num_copies: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_stored: _containers.RepeatedScalarFieldContainer[int]
    error_messages: _containers.RepeatedScalarFieldContainer[str]
    moves: TierMoves
    def __init__(self, step_id: _Optional[int] = ..., errors: _Optional[_Iterable[_Union[OpError, str]]] = ..., keep: _Optional[_Iterable[int]] = ..., num_appended: _Optional[_Iterable[int]] = ..., appended: _Optional[_Iterable[int]] = ..., num_copies: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[_Iterable[int]] = ..., num_stored: _Optional[_Iterable[int]] = ..., error_messages: _Optional[_Iterable[str]] = ..., moves: _Optional[_Union[TierMoves, _Mapping]] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("pool", "seq_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    seq_id: str
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., seq_id: _Optional[str] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("block_ids", "num_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ("pool", "check_integrity")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    check_integrity: bool
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., check_integrity: _Optional[bool] = ...) -> None: ...

class GetPoolStatsResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size", "used_blocks", "cached_blocks", "free_blocks", "num_sequences", "tokens_stored", "slots_allocated", "prefix_queried_tokens", "prefix_hit_tokens", "evictions", "copies", "out_of_blocks", "last_step_id", "integrity_problems", "integrity_checked")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_STORED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_CHECKED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    used_blocks: int
    cached_blocks: int
    free_blocks: int
    num_sequences: int
    tokens_stored: int
    slots_allocated: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    evictions: int
    copies: int
    out_of_blocks: int
    last_step_id: int
    integrity_problems: _containers.RepeatedScalarFieldContainer[str]
    integrity_checked: bool
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., tokens_stored: _Optional[int] = ..., slots_allocated: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., copies: _Optional[int] = ..., out_of_blocks: _Optional[int] = ..., last_step_id: _Optional[int] = ..., integrity_problems: _Optional[_Iterable[str]] = ..., integrity_checked: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("model_fingerprint", "tokens", "cache_salt")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefixMatch(_message.Message):
    __slots__ = ("pool_id", "worker_id", "cached_tokens", "free_blocks", "block_size", "host_tokens", "store_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    worker_id: str
    cached_tokens: int
    free_blocks: int
    block_size: int
    host_tokens: int
    store_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., host_tokens: _Optional[int] = ..., store_tokens: _Optional[int] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[PrefixMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[PrefixMatch, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_sequence", "kinds", "snapshot", "packed")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    kinds: _containers.RepeatedScalarFieldContainer[KvEventKind]
    snapshot: bool
    packed: bool
    def __init__(self, from_sequence: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[KvEventKind, str]]] = ..., snapshot: _Optional[bool] = ..., packed: _Optional[bool] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence", "kind", "pool_id", "block_id", "block_hash", "model_fingerprint", "reason", "worker_id", "advertise_url", "served_model_name", "block_ids", "block_hashes", "removed", "free_blocks")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_URL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: KvEventKind
    pool_id: str
    block_id: int
    block_hash: bytes
    model_fingerprint: str
    reason: str
    worker_id: str
    advertise_url: str
    served_model_name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    removed: _containers.RepeatedScalarFieldContainer[bool]
    free_blocks: int
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[KvEventKind, str]] = ..., pool_id: _Optional[str] = ..., block_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ..., reason: _Optional[str] = ..., worker_id: _Optional[str] = ..., advertise_url: _Optional[str] = ..., served_model_name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ..., removed: _Optional[_Iterable[bool]] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class DumpPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ...) -> None: ...

class DumpPoolResponse(_message.Message):
    __slots__ = ("state_json", "last_step_id", "integrity_problems")
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    state_json: str
    last_step_id: int
    integrity_problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state_json: _Optional[str] = ..., last_step_id: _Optional[int] = ..., integrity_problems: _Optional[_Iterable[str]] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ("model_fingerprint",)
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    def __init__(self, model_fingerprint: _Optional[str] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "worker_id", "model_fingerprint", "served_model_name", "advertise_url", "block_size", "num_blocks", "free_blocks", "used_blocks", "cached_blocks", "num_sequences", "enable_prefix_caching", "attest_key", "host_blocks", "host_used_blocks", "use_shared_store", "store_used_bytes", "host_hit_tokens", "store_hit_tokens", "kv_role", "store_namespace")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_URL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ATTEST_KEY_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USE_SHARED_STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    STORE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
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
    attest_key: bytes
    host_blocks: int
    host_used_blocks: int
    use_shared_store: bool
    store_used_bytes: int
    host_hit_tokens: int
    store_hit_tokens: int
    kv_role: str
    store_namespace: str
    def __init__(self, pool_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., served_model_name: _Optional[str] = ..., advertise_url: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., attest_key: _Optional[bytes] = ..., host_blocks: _Optional[int] = ..., host_used_blocks: _Optional[int] = ..., use_shared_store: _Optional[bool] = ..., store_used_bytes: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., store_hit_tokens: _Optional[int] = ..., kv_role: _Optional[str] = ..., store_namespace: _Optional[str] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...
