"""Tier moves on a simulated device (`--device sim:NAME`): timed, no bytes moved.

These movers keep everything of the real ones (`HostMemory`'s id checks, moves
in flight and meter; `StoreMover`'s checks, store deletes and outage handling)
but the copy: `time(nbytes)` (the simulated runner's) queues the move on the
device stream and answers its seconds and an event done when the stream has
done it.
- `TimedHostMemory`: a save is confirmed once the stream has done it; slots are
  counted as the real tier's (`host_slots_for_size`), no memory is taken.
- `TimedStoreMover`: a save writes no bytes and is confirmed at once; a load
  always loads; deletes are real.
Why this is safe for real workers sharing the store: docs/simulator.md,
"KV tiers".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from worker.kv_pool import KVPool
from worker.tiers.host import GIB, HostMemory, Transfer
from worker.tiers.meter import TierMeter
from worker.tiers.mover import LOADED, LoadOutcome, StoreMover
from worker.tiers.store import KVStore

__all__ = ["MoveTimer", "TimedHostMemory", "TimedStoreMover"]


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


# A move of `nbytes` between the device and host memory, queued on the device stream:
# its seconds, and an event done when the stream has done it.
MoveTimer = Callable[[int], tuple[float, Event]]


class TimedHostMemory(HostMemory):
    """A host tier of `num_slots` slots whose moves are timed by `time` (module docstring)."""

    def __init__(
        self, pool: KVPool, num_slots: int, *, time: MoveTimer, meter: TierMeter | None = None
    ) -> None:
        self._time = time
        super().__init__(pool, num_slots, meter=meter)

    def _open(self) -> None:  # no memory; the moves are ordered by the device stream itself
        self.cuda = False
        self._stream = None

    @property
    def pinned(self) -> bool:
        return False

    def describe(self) -> str:
        return (
            f"host tier: {self.num_slots} blocks, {self.bytes_total} B "
            f"({self.bytes_total / GIB:.3f} GiB), simulated: "
            "no memory, moves timed on the device stream"
        )

    def wait(self, stream=None) -> None:
        """Nothing to do: what comes after a move on the device stream starts after it."""

    def read_slots(self, host_slots: Sequence[int]) -> list[memoryview]:
        raise RuntimeError("a simulated host tier holds no bytes")

    def _issue(self, kind: str, kv_blocks: Sequence[int], host_slots: Sequence[int]) -> Transfer:
        self.poll()
        n = len(kv_blocks)
        seconds, end = self._time(n * self.block_bytes)
        transfer = Transfer(kind, n, n * self.block_bytes, seconds=seconds, end=end)  # type: ignore[arg-type]
        self._pending.append(transfer)
        return transfer


class TimedStoreMover(StoreMover):
    """A store mover whose saves and loads are timed by `time`, with no bytes (module docstring)."""

    def __init__(self, store: KVStore, layout, pool: KVPool, *, time: MoveTimer, **kw) -> None:
        super().__init__(store, layout, pool, **kw)
        self._time = time

    def _save(self, kv_blocks: Sequence[int], hashes: Sequence[bytes]) -> list[bool]:
        n = len(kv_blocks)
        # device -> host, as a real save's gather
        seconds, _ = self._time(n * self.layout.block_bytes)
        if self._meter is not None:
            self._meter.saved(n, n * self.layout.block_bytes, seconds)
        return [True] * n

    def _load(self, hashes: Sequence[bytes], kv_blocks: Sequence[int]) -> list[LoadOutcome]:
        n = len(kv_blocks)
        seconds, _ = self._time(n * self.layout.block_bytes)  # host -> device
        if self._meter is not None:
            self._meter.loaded(n, n * self.layout.block_bytes, seconds)
        return [LOADED] * n
