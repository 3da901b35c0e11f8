"""KV tiers below the KV pool, the worker's half: moving the bytes. The allocator
decides every move and indexes where each block lives; this package moves
bytes and says per block whether it could (docs/architecture.md, "Tiers"):

- `KVLayout` (layout.py): the layout key and a block's bytes;
- `HostMemory` (host.py): tier 1, host memory (pinned, side-stream copies on CUDA);
- `open_store` (store.py): tier 2's backends, `file://PATH` and `redis://HOST:PORT/DB`;
- `encode_entry` / `decode_entry` (entry.py): a store entry's header and checks;
- `StoreSeal` (seal.py): a store group's key, sealing entries (AES-256-GCM);
- `StoreMover` (mover.py): KV blocks to the store and back;
- `TimedHostMemory`, `TimedStoreMover` (timed.py): the same on a simulated
  device, each move timed on its stream, no bytes moved.
The order a step applies them in: `worker.engine.tiers`.
"""

from worker.tiers.entry import REFUSAL_REASONS, Refused, decode_entry, encode_entry, entry_key
from worker.tiers.host import HostMemory, Transfer, host_slots_for_size
from worker.tiers.layout import KVLayout
from worker.tiers.meter import TierMeter
from worker.tiers.mover import LoadOutcome, StoreMover
from worker.tiers.seal import StoreSeal
from worker.tiers.store import (
    FileStore,
    KVStore,
    RedisStore,
    StoreError,
    StoreOpenError,
    open_store,
)
from worker.tiers.timed import MoveTimer, TimedHostMemory, TimedStoreMover

__all__ = [
    "REFUSAL_REASONS",
    "FileStore",
    "HostMemory",
    "KVLayout",
    "KVStore",
    "LoadOutcome",
    "MoveTimer",
    "RedisStore",
    "Refused",
    "StoreError",
    "StoreMover",
    "StoreOpenError",
    "StoreSeal",
    "TierMeter",
    "TimedHostMemory",
    "TimedStoreMover",
    "Transfer",
    "decode_entry",
    "encode_entry",
    "entry_key",
    "host_slots_for_size",
    "open_store",
]
