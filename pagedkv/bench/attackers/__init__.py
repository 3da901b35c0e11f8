"""The attacks of the trust-boundary drills, each written once: the tests
(tests/router/test_trust.py, tests/router/test_failover.py, tests/router/test_api_key_salts.py,
tests/web/test_http_port_bounds.py, tests/allocator/test_slow_read_flood.py,
tests/drills/test_time_isolation.py) and `pagedkv bench attacks` run them.

- `Attacker`: an HTTP server that answers completions with its own text and
  records every request (and Authorization header) it is sent; its identity
  route relays a real worker's answer or forges one. `rogue_pool` registers
  a pool advertising an address under a model's name.
- `connect`, `idle_connections`, `read_to_close`, `slow_clients`: raw
  connections that send nothing, or a request's head or body that never ends.
- `big_text`: a text of about N bytes for /tokenize and prompts.
- `slow_read_flood`: many large pools keeping far more integrity checks in
  flight than their slots allow (run it in a process of its own).
- `snapshot_amplifier`: a legal pool whose snapshot is as large as its shape
  allows (forks with the longest ids).
- `SnapshotWatchers`: `WatchEvents` streams that each ask for the snapshot
  of every pool's cached blocks and read it slowly.
- `PublicModel`, `plant_entries`, `overwrite_entries`, `refuse_entries`,
  `read_entries`: the shared store against a worker of another group and
  whoever reads or writes its files: forged K/V under a valid header and
  checksum, planted through the protocol or written over existing entries,
  every entry a pool can name reported refused, and entries read back into
  prompt tokens (layer 0's V of a token depends on the token alone, so the
  public weights map each V row back to its token).
- `BadWorker`: a loopback server speaking just enough HTTP/1.1 to fail a
  router in one chosen way (refuse, drop, stay silent, answer without end,
  trickle), and, given a pool's proof, to pass for that pool's worker.
"""

from pagedkv.bench.attackers.allocator import (
    SnapshotWatchers,
    slow_read_flood,
    snapshot_amplifier,
)
from pagedkv.bench.attackers.evil_worker import (
    BAD_MODES,
    HUGE_BYTES,
    BadWorker,
)
from pagedkv.bench.attackers.network import (
    FILES_BESIDE,
    PWNED,
    SLOW_BODY,
    SLOW_HEAD,
    Attacker,
    TooFewFiles,
    big_text,
    closed_by_peer,
    connect,
    idle_connections,
    read_to_close,
    rogue_pool,
    slow_clients,
)
from pagedkv.bench.attackers.store import (
    PublicModel,
    overwrite_entries,
    plant_entries,
    read_entries,
    refuse_entries,
    store_entries,
    text_read_back,
)

__all__ = [
    "Attacker",
    "FILES_BESIDE",
    "PWNED",
    "SLOW_BODY",
    "SLOW_HEAD",
    "TooFewFiles",
    "big_text",
    "closed_by_peer",
    "connect",
    "idle_connections",
    "read_to_close",
    "rogue_pool",
    "slow_clients",
    "SnapshotWatchers",
    "slow_read_flood",
    "snapshot_amplifier",
    "PublicModel",
    "overwrite_entries",
    "plant_entries",
    "read_entries",
    "refuse_entries",
    "store_entries",
    "text_read_back",
    "BAD_MODES",
    "BadWorker",
    "HUGE_BYTES",
]
