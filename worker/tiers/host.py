"""The host tier (tier 1): `num_slots` KV blocks in the worker's CPU memory.

Slot-major: slot `s` is one block's payload (worker.tiers.layout), contiguous,
so it is copied in one call and written to the store as it lies. On CUDA the
memory is pinned and every copy runs on a side stream, ordered after what the
current stream had queued when the move was issued; a step issues its saves
and loads, then calls `wait()` before anything on the compute stream writes KV
blocks (copy-on-write copies, the forward pass). On the CPU a copy is done
when `save`/`load` return and `wait()` does nothing. The allocator decides
every move; this class checks only that ids are in range and a move's
destinations are distinct.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence

import torch

from worker.kv_pool import KVPool, bytes_per_block, free_memory_bytes
from worker.tiers.blocks import check_ids, gather, read_blocks, runs, scatter, write_blocks
from worker.tiers.meter import TierMeter

__all__ = ["GIB", "HostMemory", "Transfer", "host_slots_for_size"]

GIB = 1024**3


def host_slots_for_size(
    size_gib: float, block_bytes: int, available_bytes: float | None = None
) -> int:
    """Slots `--kv-offloading-size GIB` holds (0: no host tier); ValueError (one line) when
    the size is more than the memory available (MemAvailable, or `available_bytes`) or
    holds no block."""
    if not (isinstance(size_gib, int | float) and size_gib >= 0 and math.isfinite(size_gib)):
        raise ValueError(f"--kv-offloading-size must be a number of GiB >= 0, got {size_gib!r}")
    if size_gib == 0:
        return 0
    want = int(size_gib * GIB)
    available = free_memory_bytes("cpu") if available_bytes is None else available_bytes
    if want > available:
        raise ValueError(
            f"--kv-offloading-size {size_gib:g} GiB is more than the memory available "
            f"({available / GIB:.2f} GiB)"
        )
    slots = want // block_bytes
    if slots < 1:
        raise ValueError(
            f"--kv-offloading-size {size_gib:g} GiB holds no KV block ({block_bytes} B each)"
        )
    return slots


class Transfer:
    """One batch of copies: done at once on the CPU, in flight on the side stream on CUDA (or,
    timed on a simulated device, on its stream: `end` is
    then the stream's event, worker/tiers/timed.py)."""

    __slots__ = ("kind", "blocks", "nbytes", "seconds", "_start", "_end", "_keep")

    def __init__(
        self,
        kind: str,
        blocks: int,
        nbytes: int,
        *,
        seconds: float | None = None,
        start: torch.cuda.Event | None = None,
        end: torch.cuda.Event | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.kind = kind  # "save" (KV -> host) or "load" (host -> KV)
        self.blocks = blocks
        self.nbytes = nbytes
        self.seconds = seconds  # copy time; on CUDA known once done
        self._start, self._end = start, end
        self._keep = keep  # device buffers the copies use, held until they are done

    def done(self) -> bool:
        return self._end is None or self._end.query()

    def synchronize(self) -> None:
        """Block the calling thread until the copies are done."""
        if self._end is not None:
            self._end.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copies (no-op on the CPU)."""
        if self._end is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._end)

    def _finish(self) -> None:
        if self.seconds is None and self._start is not None and self._end is not None:
            self.seconds = self._start.elapsed_time(self._end) / 1000.0
        self._keep = ()


class HostMemory:
    """Host memory for `num_slots` blocks of `pool`'s layout; see the module docstring."""

    def __init__(self, pool: KVPool, num_slots: int, *, meter: TierMeter | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least 1 slot, got {num_slots}")
        self.pool = pool
        self.num_slots = num_slots
        self.block_shape = (2, pool.num_layers, pool.block_size, pool.num_kv_heads, pool.head_dim)
        self.block_bytes = bytes_per_block(
            pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype
        )
        self._open()
        self._pending: deque[Transfer] = deque()
        self._meter = meter
        if meter is not None:
            meter.set_capacity(self.bytes_total)

    def _open(self) -> None:
        """The slots' memory, and on CUDA the side stream its copies run on."""
        self.cuda = self.pool.device.type == "cuda"
        # NOTE: not zeroed: a slot is only read after a save
        # wrote it (the allocator loads present entries only).
        self._host = torch.empty(
            (self.num_slots, *self.block_shape), dtype=self.pool.dtype, pin_memory=self.cuda
        )
        self._bytes = self._host.view(self.num_slots, -1).view(torch.uint8).numpy()
        self._stream = torch.cuda.Stream(device=self.pool.device) if self.cuda else None

    @classmethod
    def from_size(
        cls,
        pool: KVPool,
        size_gib: float,
        *,
        meter: TierMeter | None = None,
        available_bytes: float | None = None,
        **kw,
    ) -> HostMemory | None:
        """The tier `--kv-offloading-size GIB` asks for, None for 0 (see `host_slots_for_size`);
        `kw` goes to the class (a subclass's own arguments)."""
        block_bytes = bytes_per_block(
            pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype
        )
        slots = host_slots_for_size(size_gib, block_bytes, available_bytes)
        return cls(pool, slots, meter=meter, **kw) if slots else None

    @property
    def bytes_total(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def pinned(self) -> bool:
        return self._host.is_pinned()

    def describe(self) -> str:
        where = "pinned host memory, side-stream copies" if self.cuda else "CPU memory"
        gib = self.bytes_total / GIB
        return (
            f"host tier: {self.num_slots} blocks, {self.bytes_total} B ({gib:.3f} GiB) in {where}"
        )

    # -- moves ------------------------------------------------------------------

    def save(self, kv_blocks: Sequence[int], host_slots: Sequence[int]) -> Transfer:
        """Copy KV blocks `kv_blocks[i]` into host slots `host_slots[i]` (distinct)."""
        self._check(kv_blocks, host_slots, distinct_slots=True, distinct_blocks=False)
        return self._move("save", kv_blocks, host_slots)

    def load(self, host_slots: Sequence[int], kv_blocks: Sequence[int]) -> Transfer:
        """Copy host slots `host_slots[i]` into KV blocks `kv_blocks[i]` (distinct)."""
        self._check(kv_blocks, host_slots, distinct_slots=False, distinct_blocks=True)
        return self._move("load", kv_blocks, host_slots)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for every move issued so far; call it
        before the compute stream writes KV blocks. No-op on the CPU."""
        if self._pending:
            # one side stream: its last move ends after all others
            self._pending[-1].wait(stream or torch.cuda.current_stream(self.pool.device))

    def synchronize(self) -> None:
        """Block until every move issued so far is done (and count it in the meter)."""
        if self._pending:
            self._pending[-1].synchronize()
        self.poll()

    def poll(self) -> int:
        """Count the moves that are done in the meter; how many are still in flight."""
        while self._pending and self._pending[0].done():
            self._account(self._pending.popleft())
        return len(self._pending)

    def read_slots(self, host_slots: Sequence[int]) -> list[memoryview]:
        """The payload bytes in `host_slots` (for store saves), after every save issued so far
        is done. Views into the tier: valid until the slot is next written."""
        check_ids("host slot", host_slots, self.num_slots, distinct=False)
        if any(t.kind == "save" for t in self._pending):
            self.synchronize()
        return [memoryview(self._bytes[s]) for s in host_slots]

    # -- inside -----------------------------------------------------------------

    def _check(
        self,
        kv_blocks: Sequence[int],
        host_slots: Sequence[int],
        *,
        distinct_slots: bool,
        distinct_blocks: bool,
    ) -> None:
        if len(kv_blocks) != len(host_slots):
            raise ValueError(f"{len(kv_blocks)} KV blocks but {len(host_slots)} host slots")
        check_ids("KV block", kv_blocks, self.pool.num_blocks, distinct=distinct_blocks)
        check_ids("host slot", host_slots, self.num_slots, distinct=distinct_slots)

    def _move(self, kind: str, kv_blocks: Sequence[int], host_slots: Sequence[int]) -> Transfer:
        if not kv_blocks:
            return Transfer(kind, 0, 0, seconds=0.0)
        return self._issue(kind, kv_blocks, host_slots)

    def _issue(self, kind: str, kv_blocks: Sequence[int], host_slots: Sequence[int]) -> Transfer:
        """Copy the bytes (at once on the CPU, queued on the side stream on CUDA)."""
        n = len(kv_blocks)
        if self._stream is None:
            t0 = time.perf_counter()
            if kind == "save":
                read_blocks(self.pool, kv_blocks, self._host, host_slots)
            else:
                write_blocks(self.pool, kv_blocks, self._host, host_slots)
            transfer = Transfer(kind, n, n * self.block_bytes, seconds=time.perf_counter() - t0)
            self._account(transfer)
            return transfer
        return self._move_cuda(kind, kv_blocks, host_slots)

    def _move_cuda(
        self, kind: str, kv_blocks: Sequence[int], host_slots: Sequence[int]
    ) -> Transfer:
        self.poll()
        side = self._stream
        assert side is not None
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            if kind == "save":
                stage = gather(self.pool, kv_blocks)
                for i, s, r in runs(host_slots):
                    self._host[s : s + r].copy_(stage[i : i + r], non_blocking=True)
            else:
                stage = torch.empty(
                    (len(kv_blocks), *self.block_shape),
                    dtype=self.pool.dtype,
                    device=self.pool.device,
                )
                for i, s, r in runs(host_slots):
                    stage[i : i + r].copy_(self._host[s : s + r], non_blocking=True)
                scatter(self.pool, kv_blocks, stage)
            end.record(side)
        transfer = Transfer(
            kind,
            len(kv_blocks),
            len(kv_blocks) * self.block_bytes,
            start=start,
            end=end,
            keep=(stage,),
        )
        self._pending.append(transfer)
        return transfer

    def _account(self, transfer: Transfer) -> None:
        transfer._finish()
        if self._meter is None or transfer.blocks == 0:
            return
        seconds = transfer.seconds or 0.0
        if transfer.kind == "save":
            self._meter.saved(transfer.blocks, transfer.nbytes, seconds)
        else:
            self._meter.loaded(transfer.blocks, transfer.nbytes, seconds)
