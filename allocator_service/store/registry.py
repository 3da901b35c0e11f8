"""The registry of pools: the allocator as a deterministic state machine.

Every state change is one of five records (pool registered, step applied,
pool dropped, prefix cache reset, shared store configured;
`proto/pagedkv/v1/journal.proto`). Applying the
same records in the same order to the same snapshot gives the same pools,
the same last-step answers and the same KV event numbers: that is what makes
the Redis journal a complete backup. How stored records and snapshots are
framed and verified, and `replay`, live in `replay.py`.

A record is applied in two parts, so that the service can keep one global
order without making every pool wait for every other: `advance` gives it
its place (the next index and an event batch; the service calls it under its
mutation lock, right after the journal write), and the pool's own work
(`apply_step`, `apply_reset`) may then run under that pool's lock only,
while another pool's record is applied. Registrations and drops touch no
pool's blocks and are applied whole in the first part. The shared KV store's
index (`store`, one `SharedStore` the pools that use it share) is changed
by their steps and drops: the service applies those whole under its mutation
lock, so the journal's order is the order they changed it. Nothing here reads a
clock or does I/O; each `PoolEntry` carries the lock the service takes for
its pool.
"""

from __future__ import annotations

import base64
import hmac
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from allocator_service.core import BlockPool, PoolConfig, StepColumns, run_step
from allocator_service.core.snapshot import dumps_chunked, to_packed
from allocator_service.core.tier_index import SharedStore
from allocator_service.store.events import POOL_DROPPED, POOL_REGISTERED, EventLog, RecordEvents
from allocator_service.wire.codec import columns_from_proto, config_from_proto, result_to_proto
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import journal_pb2 as jpb
from pagedkv_base.store_url import is_peer

# /2: each pool's "state" is the packed dump (`core.snapshot.to_packed`); a
# /1 snapshot (every pool's full `to_state` dump) is still read.
SNAPSHOT_FORMAT = "pagedkv-allocator-snapshot/2"
SNAPSHOT_FORMATS_READ = ("pagedkv-allocator-snapshot/1", SNAPSHOT_FORMAT)


class _Sink:
    """The core's event sink for one pool: its events join the batch of the
    record being applied to it."""

    __slots__ = ("pool_id", "batch")

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.batch: RecordEvents | None = None

    def __call__(self, kind: str, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        self.batch.add_blocks(kind, self.pool_id, blocks, hashes)


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
    sink: _Sink | None = None
    # Readers of this pool and the application of its records take it (the
    # service: this lock first, then its mutation lock).
    lock: threading.Lock = field(default_factory=threading.Lock)
    # A snapshot cut this pool belongs to and that has not serialised it
    # yet: whoever next takes the lock to change the pool serialises it first.
    snapshot_due: Any = None
    # What the worker advertised for routers (RegisterPoolRequest): journaled
    # with the registration and kept in snapshots, so a restart keeps them.
    advertise_url: str = ""
    served_model_name: str = ""
    # RegisterPoolRequest.protocol_version: from `PREV_STEP_ID_REQUIRED` on,
    # every Step of the pool must carry prev_step_id (journaled, snapshotted).
    protocol_version: int = 0


# Worker ids without a live pool whose last epoch is remembered; past this many the one
# idle longest is forgotten (its epoch goes into `Registry.epoch_floor`).
IDLE_EPOCHS_KEPT = 4096


class Registry:
    """The pools, by id and by worker id, and the epochs issued.

    NOTE: a pool id (`WORKER_ID/EPOCH`) is never issued twice, so a worker
    id's next epoch is above every one it had. That takes no memory per
    worker id that ever registered: the last epoch of every worker id with
    a live pool is kept, and of at most IDLE_EPOCHS_KEPT without one (those
    idle longest forgotten first); a forgotten id's epochs are all at most
    `epoch_floor`, so an id not remembered gets `epoch_floor + 1`."""

    def __init__(self, events: EventLog) -> None:
        self.pools: dict[str, PoolEntry] = {}
        self.current: dict[str, str] = {}  # worker id -> its live pool id
        self.epochs: dict[str, int] = {}  # worker id -> last epoch issued (remembered ones)
        # remembered worker ids without a live pool, idle longest first
        self.idle: dict[str, None] = {}
        self.epoch_floor = 0  # at least every forgotten worker id's last epoch
        self.index = 0  # records applied (the journal index of the last one)
        self.events = events
        # The shared KV store (the last StoreConfigured record): its URL and index, and for a
        # peer store the secret its groups' peer keys derive from (`peer_key`).
        self.store_url = ""
        self.store: SharedStore | None = None
        self.peer_secret = b""
        # The smallest block_bytes of a pool that used the store: at most any
        # entry's size (what bounds the deletes one save causes).
        self.store_min_bytes = 0

    def uses_store(self, entry: PoolEntry) -> bool:
        tiers = entry.pool.tiers
        return tiers is not None and tiers.store is not None

    def configure_store(self, url: str, capacity_bytes: int, peer_secret: bytes = b"") -> None:
        """From here on the shared store is `url` (empty: none), a fresh
        index of `capacity_bytes` (every pool that used the old one is
        dropped before: `StoreConfigured`); `peer_secret` for a peer store."""
        if any(self.uses_store(e) for e in self.pools.values()):
            raise CorruptState("the shared store is configured again while pools use it")
        self.store_url = url
        self.store = SharedStore(capacity_bytes, peer=is_peer(url)) if url else None
        self.peer_secret = peer_secret
        self.store_min_bytes = 0

    def peer_key(self, group: str) -> str:
        """The key the workers of store group `group` present to each
        other's peer route (a peer store; "" otherwise): only they hold it."""
        if not self.peer_secret:
            return ""
        return hmac.new(
            self.peer_secret, b"pagedkv peer route\n" + group.encode(), "sha256"
        ).hexdigest()

    def writer_url(self, pool_id: str) -> str:
        """Where a peer store's entries of pool `pool_id` are pulled from."""
        entry = self.pools.get(pool_id)
        return entry.advertise_url if entry is not None else ""

    def store_state(self) -> dict[str, Any] | None:
        """The shared store's part of a snapshot (None: no store)."""
        if self.store is None:
            return None
        state = {
            "url": self.store_url,
            "min_bytes": self.store_min_bytes,
            "index": self.store.to_state(),
        }
        if self.peer_secret:
            state["peer_secret"] = self.peer_secret.hex()
        return state

    def next_epoch(self, worker_id: str) -> int:
        return self.epochs.get(worker_id, self.epoch_floor) + 1

    def remember_epoch(self, worker_id: str, epoch: int) -> None:
        """Issued `epoch` to `worker_id` (if above what it had): never again."""
        if epoch <= self.next_epoch(worker_id) - 1:
            return
        self.epochs[worker_id] = epoch
        if worker_id not in self.current:
            self._idle(worker_id)

    def _idle(self, worker_id: str) -> None:
        self.idle.pop(worker_id, None)
        self.idle[worker_id] = None
        while len(self.idle) > IDLE_EPOCHS_KEPT:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            self.epoch_floor = max(self.epoch_floor, self.epochs.pop(oldest))

    # ----------------------------------------------------------- changes
    def advance(self) -> RecordEvents:
        """The next record's place in the global order: its index and the
        batch its events go to (finish it with `events.finish`)."""
        self.index += 1
        return self.events.begin()

    def register(
        self,
        worker_id: str,
        epoch: int,
        config: PoolConfig,
        credential_digest: bytes,
        batch: RecordEvents,
        pool: tuple[BlockPool, _Sink] | None = None,
        *,
        advertise_url: str = "",
        served_model_name: str = "",
        protocol_version: int = 0,
    ) -> PoolEntry:
        """`pool`: built beforehand by `new_pool` (it may be large), else here."""
        old = self.current.get(worker_id)
        if old is not None:
            self._drop(old, "replaced", batch)
        pool_id = f"{worker_id}/{epoch}"
        block_pool, sink = pool if pool is not None else new_pool(config, self.store)
        if block_pool.tiers is not None and block_pool.tiers.store is not None:
            block_pool.tiers.store.users += 1  # its share of pending saves
        if config.use_shared_store:
            b = config.block_bytes
            self.store_min_bytes = min(self.store_min_bytes, b) if self.store_min_bytes else b
        sink.pool_id = pool_id
        if block_pool.tiers is not None:
            block_pool.tiers.writer = pool_id
        entry = PoolEntry(
            pool_id,
            worker_id,
            epoch,
            credential_digest,
            block_pool,
            sink=sink,
            advertise_url=advertise_url,
            served_model_name=served_model_name,
            protocol_version=protocol_version,
        )
        self.pools[pool_id] = entry
        self.current[worker_id] = pool_id
        self.epochs[worker_id] = epoch
        self.idle.pop(worker_id, None)
        batch.add(
            POOL_REGISTERED,
            pool_id,
            model_fingerprint=config.model_fingerprint,
            worker_id=worker_id,
            advertise_url=advertise_url,
            served_model_name=served_model_name,
        )
        return entry

    def apply_step(
        self, entry: PoolEntry, batch: RecordEvents, step_id: int, digest: bytes, step: StepColumns
    ) -> pb.StepResponse:
        """Apply validated operations (`service.steps.check_step`) to the pool."""
        entry.sink.batch = batch
        try:
            response = result_to_proto(step_id, run_step(entry.pool, step), self.writer_url)
        finally:
            entry.sink.batch = None
        entry.last_step_id = step_id
        entry.last_digest = digest
        entry.last_response = response
        return response

    def drop(self, pool_id: str, reason: str, batch: RecordEvents) -> None:
        self._drop(pool_id, reason, batch)

    def drop_record(self, pool_id: str, reason: str) -> None:
        """A whole drop in one go (its own index and events): replay's and
        the service's when no record can be in flight."""
        batch = self.advance()
        try:
            self._drop(pool_id, reason, batch)
        finally:
            self.events.finish(batch)

    def _drop(self, pool_id: str, reason: str, batch: RecordEvents) -> None:
        entry = self.pools.pop(pool_id)
        entry.pool.drop_store_pending()  # its worker will never confirm them
        if self.uses_store(entry):
            entry.pool.tiers.store.users -= 1
        if self.current.get(entry.worker_id) == pool_id:
            del self.current[entry.worker_id]
            self._idle(entry.worker_id)
        batch.add(POOL_DROPPED, pool_id, reason=reason)

    def apply_reset(self, entry: PoolEntry, batch: RecordEvents) -> int:
        entry.sink.batch = batch
        try:
            return entry.pool.reset_prefix_cache()
        finally:
            entry.sink.batch = None

    # ------------------------------------------------------------ replay
    def apply(self, record: jpb.JournalRecord) -> None:
        """Apply one journal record (replay after a restart or reload)."""
        if record.index <= self.index:
            return  # written twice by a retried Redis call: already applied
        if record.index != self.index + 1:
            raise CorruptState(f"journal jumps from record {self.index} to {record.index}")
        kind = record.WhichOneof("change")
        batch = None
        try:
            if kind == "step":
                # Validated when accepted (a restart with lower limits must
                # still replay its history, so no limits here).
                s = record.step
                entry = self.pools[s.pool_id]
                batch = self.advance()
                self.apply_step(entry, batch, s.step_id, s.digest, columns_from_proto(s.ops))
            elif kind == "reset":
                entry = self.pools[record.reset.pool_id]
                batch = self.advance()
                self.apply_reset(entry, batch)
            elif kind == "registered":
                r = record.registered
                config = config_from_proto(r.shape)
                batch = self.advance()
                self.register(
                    r.worker_id,
                    r.epoch,
                    config,
                    r.credential_digest,
                    batch,
                    advertise_url=r.advertise_url,
                    served_model_name=r.served_model_name,
                    protocol_version=r.protocol_version,
                )
            elif kind == "dropped":
                if record.dropped.pool_id not in self.pools:
                    raise KeyError(record.dropped.pool_id)
                batch = self.advance()
                self.drop(record.dropped.pool_id, record.dropped.reason, batch)
            elif kind == "store":
                batch = self.advance()
                st = record.store
                self.configure_store(st.url, st.capacity_bytes, st.peer_secret)
            else:
                raise CorruptState(f"journal record {record.index} holds no change")
        except KeyError as exc:
            raise CorruptState(
                f"journal record {record.index} names an unknown pool {exc}"
            ) from exc
        except CorruptState:
            raise
        except Exception as exc:  # a record that cannot be re-applied: name it, never a traceback
            pool = getattr(getattr(record, kind), "pool_id", "") if kind else ""
            raise CorruptState(
                f"journal record {record.index} ({kind} of pool {pool!r}) cannot be re-applied: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if batch is not None:
                self.events.finish(batch)

    # --------------------------------------------------------- snapshots
    def snapshot_header(self, chain: bytes, next_event: int) -> dict[str, Any]:
        """Everything of a snapshot but its pools and the shared store's
        index (O(workers), not O(blocks): `store_state` adds the store)."""
        return {
            "format": SNAPSHOT_FORMAT,
            "index": self.index,
            # the chain digest of the last record it includes: the first
            # record after it must follow this (absent in older snapshots)
            "chain": chain.hex(),
            "next_event": next_event,
            "epochs": dict(self.epochs),
            "idle": list(self.idle),
            "epoch_floor": self.epoch_floor,
        }

    def to_snapshot(self, chain: bytes, next_event: int | None = None) -> dict[str, Any]:
        """The whole registry at once (no record may be in flight)."""
        snap = self.snapshot_header(
            chain, self.events.next_sequence if next_event is None else next_event
        )
        snap["store"] = self.store_state()
        snap["pools"] = [pool_snapshot(e) for e in self.pools.values()]
        return snap

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any], events: EventLog) -> Registry:
        if snap.get("format") not in SNAPSHOT_FORMATS_READ:
            raise CorruptState(f"unknown snapshot format {snap.get('format')!r}")
        events.reset(snap["next_event"])
        reg = cls(events)
        reg.index = snap["index"]
        reg.epochs = dict(snap["epochs"])
        store = snap.get("store")  # absent in snapshots of older versions: no store
        if store is not None:
            reg.store_url, reg.store_min_bytes = store["url"], store["min_bytes"]
            reg.store = SharedStore.from_state(store["index"])
            reg.peer_secret = bytes.fromhex(store.get("peer_secret", ""))  # (peer stores only)
        for p in snap["pools"]:
            pool_id = p["pool_id"]
            sink = _Sink(pool_id)
            pool = BlockPool.from_state(p["state"], sink, reg.store)
            if pool.tiers is not None:
                pool.tiers.writer = pool_id
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
                sink,
                # absent in snapshots of older versions
                advertise_url=p.get("advertise_url", ""),
                served_model_name=p.get("served_model_name", ""),
                protocol_version=p.get("protocol_version", 0),
            )
            reg.current[p["worker_id"]] = pool_id
            if reg.uses_store(reg.pools[pool_id]):
                reg.store.users += 1
        # absent in snapshots of older versions: every remembered id without a pool, in its order
        reg.epoch_floor = snap.get("epoch_floor", 0)
        for worker_id in snap.get("idle", [w for w in reg.epochs if w not in reg.current]):
            reg._idle(worker_id)
        return reg


def new_pool(config: PoolConfig, store: SharedStore | None = None) -> tuple[BlockPool, _Sink]:
    """A fresh pool and its event sink (named by `Registry.register`);
    `store`: the shared store's index, for a pool that uses it."""
    sink = _Sink("")
    return BlockPool(config, sink, store if config.use_shared_store else None), sink


def pool_snapshot(entry: PoolEntry) -> dict[str, Any]:
    """One pool's part of a snapshot (the caller holds its lock or knows no
    record is applied to it meanwhile)."""
    e = entry
    return {
        "pool_id": e.pool_id,
        "worker_id": e.worker_id,
        "epoch": e.epoch,
        "credential_digest": e.credential_digest.hex(),
        "advertise_url": e.advertise_url,
        "served_model_name": e.served_model_name,
        "protocol_version": e.protocol_version,
        "last_step_id": e.last_step_id,
        "last_digest": e.last_digest.hex(),
        "last_response": base64.b64encode(e.last_response.SerializeToString()).decode()
        if e.last_response is not None
        else None,
        "state": to_packed(e.pool),
    }


def pool_snapshot_json(entry: PoolEntry) -> str:
    """`pool_snapshot` as JSON text: taken under the pool's lock, it shares
    nothing with the live pool afterwards."""
    return dumps_chunked(pool_snapshot(entry))
