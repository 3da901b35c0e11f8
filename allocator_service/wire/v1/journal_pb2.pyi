from . import allocator_pb2 as _allocator_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JournalRecord(_message.Message):
    __slots__ = ("index", "registered", "step", "dropped", "reset", "store")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    registered: PoolRegistered
    step: StepApplied
    dropped: PoolDropped
    reset: PrefixCacheReset
    store: StoreConfigured
    def __init__(self, index: _Optional[int] = ..., registered: _Optional[_Union[PoolRegistered, _Mapping]] = ..., step: _Optional[_Union[StepApplied, _Mapping]] = ..., dropped: _Optional[_Union[PoolDropped, _Mapping]] = ..., reset: _Optional[_Union[PrefixCacheReset, _Mapping]] = ..., store: _Optional[_Union[StoreConfigured, _Mapping]] = ...) -> None: ...

class StoreConfigured(_message.Message):
    __slots__ = ("url", "capacity_bytes", "peer_secret")
    URL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_SECRET_FIELD_NUMBER: _ClassVar[int]
    url: str
    capacity_bytes: int
    peer_secret: bytes
    def __init__(self, url: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., peer_secret: _Optional[bytes] = ...) -> None: ...

class PoolRegistered(_message.Message):
    __slots__ = ("pool_id", "worker_id", "epoch", "shape", "credential_digest", "advertise_url", "served_model_name", "protocol_version")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_URL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    worker_id: str
    epoch: int
    shape: _allocator_pb2.PoolShape
    credential_digest: bytes
    advertise_url: str
    served_model_name: str
    protocol_version: int
    def __init__(self, pool_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., shape: _Optional[_Union[_allocator_pb2.PoolShape, _Mapping]] = ..., credential_digest: _Optional[bytes] = ..., advertise_url: _Optional[str] = ..., served_model_name: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class StepApplied(_message.Message):
    __slots__ = ("pool_id", "step_id", "digest", "ops", "prev_step_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    PREV_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    step_id: int
    digest: bytes
    ops: _allocator_pb2.StepOps
    prev_step_id: int
    def __init__(self, pool_id: _Optional[str] = ..., step_id: _Optional[int] = ..., digest: _Optional[bytes] = ..., ops: _Optional[_Union[_allocator_pb2.StepOps, _Mapping]] = ..., prev_step_id: _Optional[int] = ...) -> None: ...

class PoolDropped(_message.Message):
    __slots__ = ("pool_id", "reason")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    reason: str
    def __init__(self, pool_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PrefixCacheReset(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...
