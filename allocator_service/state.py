"""The registry of pools: the allocator as a deterministic state machine.

Every state change is one of four records (pool registered, step applied,
pool dropped, prefix cache reset; `proto/pagedkv/v1/journal.proto`). Applying the
same records in the same order to the same snapshot gives the same pools,
the same last-step answers and the same KV event numbers: that is what makes
the Redis journal a complete backup. Nothing here locks, reads a clock or
does I/O; the service (`service.py`) does that around it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from allocator_service.codec import columns_from_proto, config_from_proto, result_to_proto
from allocator_service.core import BlockPool, PoolConfig, StepColumns, run_step
from allocator_service.events import POOL_DROPPED, POOL_REGISTERED, EventLog
from allocator_service.v1 import allocator_pb2 as pb
from allocator_service.v1 import journal_pb2 as jpb

SNAPSHOT_FORMAT = "pagedkv-allocator-snapshot/1"


class CorruptState(RuntimeError):
    """The journal or snapshot does not describe a reachable state (a bug or
    a hand-edited store): the server refuses to start on it."""


@dataclass(slots=True)
class PoolEntry:
    pool_id: str
    worker_id: str
    epoch: int
    credential_digest: bytes
    pool: BlockPool
    # The last step answered, kept so a retry gets the same answer.
    last_step_id: int = 0
    last_digest: bytes = b""
    last_response: pb.StepResponse | None = None


class Registry:
    def __init__(self, events: EventLog) -> None:
        self.pools: dict[str, PoolEntry] = {}
        self.current: dict[str, str] = {}  # worker id -> its live pool id
        self.epochs: dict[str, int] = {}  # worker id -> last epoch issued
        self.index = 0  # records applied (the journal index of the last one)
        self.events = events

    def next_epoch(self, worker_id: str) -> int:
        return self.epochs.get(worker_id, 0) + 1

    def _sink(self, pool_id: str):
        """The core's event sink for one pool: its events join the log."""
        events = self.events

        def sink(kind: str, block: int, block_hash: bytes | None) -> None:
            events.append(kind, pool_id, block, block_hash)

        return sink

    # ----------------------------------------------------------- changes
    def register(self, worker_id: str, epoch: int, config: PoolConfig, credential_digest: bytes) -> PoolEntry:
        old = self.current.get(worker_id)
        if old is not None:
            self._drop(old, "replaced")
        pool_id = f"{worker_id}/{epoch}"
        pool = BlockPool(config, self._sink(pool_id))
        entry = PoolEntry(pool_id, worker_id, epoch, credential_digest, pool)
        self.pools[pool_id] = entry
        self.current[worker_id] = pool_id
        self.epochs[worker_id] = epoch
        self.events.append(POOL_REGISTERED, pool_id, model_fingerprint=config.model_fingerprint)
        self.index += 1
        return entry

    def step(self, entry: PoolEntry, step_id: int, digest: bytes, step: StepColumns) -> pb.StepResponse:
        """Apply validated operations (`service.check_step`)."""
        response = result_to_proto(step_id, run_step(entry.pool, step))
        entry.last_step_id = step_id
        entry.last_digest = digest
        entry.last_response = response
        self.index += 1
        return response

    def drop(self, pool_id: str, reason: str) -> None:
        self._drop(pool_id, reason)
        self.index += 1

    def _drop(self, pool_id: str, reason: str) -> None:
        entry = self.pools.pop(pool_id)
        if self.current.get(entry.worker_id) == pool_id:
            del self.current[entry.worker_id]
        self.events.append(POOL_DROPPED, pool_id, reason=reason)

    def reset_prefix_cache(self, entry: PoolEntry) -> int:
        dropped = entry.pool.reset_prefix_cache()
        self.index += 1
        return dropped

    # ------------------------------------------------------------ replay
    def apply(self, record: jpb.JournalRecord) -> None:
        """Apply one journal record (replay after a restart or reload)."""
        if record.index <= self.index:
            return  # written twice by a retried Redis call: already applied
        if record.index != self.index + 1:
            raise CorruptState(f"journal jumps from record {self.index} to {record.index}")
        kind = record.WhichOneof("change")
        try:
            if kind == "registered":
                r = record.registered
                self.register(r.worker_id, r.epoch, config_from_proto(r.shape), r.credential_digest)
            elif kind == "step":
                # Validated when accepted (a restart with lower limits must
                # still replay its history, so no limits here).
                s = record.step
                self.step(self.pools[s.pool_id], s.step_id, s.digest, columns_from_proto(s.ops))
            elif kind == "dropped":
                self.drop(record.dropped.pool_id, record.dropped.reason)
            elif kind == "reset":
                self.reset_prefix_cache(self.pools[record.reset.pool_id])
            else:
                raise CorruptState(f"journal record {record.index} holds no change")
        except KeyError as exc:
            raise CorruptState(f"journal record {record.index} names an unknown pool {exc}") from exc

    # --------------------------------------------------------- snapshots
    def to_snapshot(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "index": self.index,
            "next_event": self.events.next_sequence,
            "epochs": dict(self.epochs),
            "pools": [
                {
                    "pool_id": e.pool_id,
                    "worker_id": e.worker_id,
                    "epoch": e.epoch,
                    "credential_digest": e.credential_digest.hex(),
                    "last_step_id": e.last_step_id,
                    "last_digest": e.last_digest.hex(),
                    "last_response": base64.b64encode(e.last_response.SerializeToString()).decode()
                    if e.last_response is not None
                    else None,
                    "state": e.pool.to_state(),
                }
                for e in self.pools.values()
            ],
        }

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any], events: EventLog) -> Registry:
        if snap.get("format") != SNAPSHOT_FORMAT:
            raise CorruptState(f"unknown snapshot format {snap.get('format')!r}")
        events.reset(snap["next_event"])
        reg = cls(events)
        reg.index = snap["index"]
        reg.epochs = dict(snap["epochs"])
        for p in snap["pools"]:
            pool_id = p["pool_id"]
            pool = BlockPool.from_state(p["state"], reg._sink(pool_id))
            raw = p["last_response"]
            reg.pools[pool_id] = PoolEntry(
                pool_id,
                p["worker_id"],
                p["epoch"],
                bytes.fromhex(p["credential_digest"]),
                pool,
                p["last_step_id"],
                bytes.fromhex(p["last_digest"]),
                pb.StepResponse.FromString(base64.b64decode(raw)) if raw is not None else None,
            )
            reg.current[p["worker_id"]] = pool_id
        return reg
