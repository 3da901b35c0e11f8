"""The model runner of a simulated device (`--device sim:NAME`).

It keeps the engine's contract (`launch(batch)`, then `collect(launched)`
gives the sampled tokens) and the KV pool's shape, and computes nothing: a
step's time is the roofline's (worker/sim/roofline.py) on the named GPU,
queued on a `DeviceStream`; a sampled token is a function of the sequence's
tokens (worker/sim/tokens.py). The KV pool holds no tensor and is sized from
the simulated memory as on CUDA. Tier moves and copy-on-write copies are
queued on the stream before the step's forward pass (worker/tiers/timed.py).
How and why: docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections import abc
from typing import NamedTuple

import torch

from worker.engine.busy import BusyMeter
from worker.engine.config import EngineConfig
from worker.engine.model_runner import SampledToken
from worker.engine.scheduler import StepBatch
from worker.engine.sequence import Sequence
from worker.kv_bytes import kv_cache_element
from worker.kv_pool import parse_memory
from worker.model.loaded import LoadedModel
from worker.sim import (
    SIM_PREFIX,
    DeviceStream,
    Roofline,
    StepCost,
    StreamEvent,
    TokenDigest,
    gpu,
    make_clock,
    next_token,
)
from worker.tiers import TierMeter, TimedHostMemory, TimedStoreMover

# what `--kv-cache-memory` is on a simulated GPU when
# not given: vLLM's --gpu-memory-utilization default
DEFAULT_SIM_KV_FRACTION = "0.9"
GIB = 1 << 30


class SimKVPool:
    """A KV pool's shape without its tensors (the interface `KVPool` gives the engine)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        block_bytes: int,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = (
            num_kv_heads,
            head_dim,
            dtype,
            device,
        )
        self.block_bytes = block_bytes

    @property
    def bytes_total(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.tokens_capacity} tokens, "
            f"{self.bytes_total} B ({self.bytes_total / GIB:.3f} GiB), {self.num_layers} layers x "
            f"{self.num_kv_heads} kv heads x {self.head_dim} dim, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device} (simulated: no tensors)"
        )

    def copy_blocks(self, copies: abc.Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise IndexError(
                    f"block copy {src}->{dst} outside pool of {self.num_blocks} blocks"
                )


class Launched(NamedTuple):
    batch: StepBatch
    done: float  # when its outputs are ready, on the engine's clock
    cost: StepCost


class SimRunner:
    """Launches a step's roofline time on the stream; draws its tokens when collected."""

    asynchronous = True  # launching returns at once: the engine plans the next step meanwhile

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.gpu = gpu(config.device.removeprefix(SIM_PREFIX))
        shape = loaded.config
        if config.kv_cache_dtype != "auto":
            # the pool's bytes, and the bytes a step reads, are fp8's
            shape = dataclasses.replace(
                shape, kv_dtype=kv_cache_element(config.kv_cache_dtype, shape.dtype)
            )
        self.roofline = Roofline(
            self.gpu, shape, config.sim_mfu, config.sim_mbu, config.sim_launch_ms / 1e3
        )
        self.clock = make_clock(config.clock)
        self.stream = DeviceStream(self.clock)
        self.busy: BusyMeter | None = None  # set by the engine
        self.device = torch.device("cpu")  # where sampling parameters' generators live
        self.block_size = config.block_size
        self.vocab_size = shape.vocab_size
        self.avoid = frozenset(loaded.eos_token_ids)
        self.kv_pool = self._pool(shape, config)
        self.tiers = None
        self.device_seconds = 0.0  # every step's device time, launched so far
        self._digests: dict[int, tuple[Sequence, TokenDigest]] = {}

    def _pool(self, shape, config: EngineConfig) -> SimKVPool:
        name, memory = config.device, self.gpu.memory_bytes
        free = memory - shape.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{shape.weight_bytes / GIB:.1f} GiB of weights do not fit in {name}'s "
                f"{memory / GIB:.0f} GiB"
            )
        block_bytes = shape.kv_bytes_per_token * config.block_size
        if config.num_blocks is not None:
            blocks = config.num_blocks
        else:
            budget = parse_memory(
                config.kv_cache_memory or DEFAULT_SIM_KV_FRACTION, free_bytes=lambda: free
            )
            blocks = budget // block_bytes
            if blocks < 1:
                raise ValueError(
                    f"--kv-cache-memory {config.kv_cache_memory!r} "
                    f"holds no KV block of {block_bytes} B"
                )
        if blocks * block_bytes > free:
            raise ValueError(
                f"a KV pool of {blocks} blocks ({blocks * block_bytes / GIB:.1f} GiB) does not fit "
                f"in {name}'s {memory / GIB:.0f} GiB beside {shape.weight_bytes / GIB:.1f} GiB of "
                f"weights ({free // block_bytes} blocks do)"
            )
        dtype = getattr(torch, shape.kv_element)
        return SimKVPool(
            shape.num_layers,
            blocks,
            config.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            dtype,
            name,
            block_bytes,
        )

    # ------------------------------------------------------------- tiers
    def host_tier(self, size_gib: float, meter: TierMeter) -> TimedHostMemory | None:
        """The host tier `--kv-offloading-size GIB` asks for (None for 0): its slots counted
        as on CUDA, no memory taken, so not bounded by this machine's memory."""
        return TimedHostMemory.from_size(
            self.kv_pool, size_gib, meter=meter, available_bytes=math.inf, time=self._host_move
        )

    def store_mover(self, *args, **kw) -> TimedStoreMover:
        """The mover of the allocator's shared store (`StoreMover`'s arguments), timed."""
        return TimedStoreMover(*args, time=self._host_move, **kw)

    def apply_tiers(self, batch: StepBatch) -> None:
        """Queue the step's tier moves and copy-on-write copies on the stream, in their
        order (worker/engine/tiers.py), before its forward pass."""
        self.tiers.apply(batch, self._copy)  # type: ignore[union-attr]
        batch.copies = []

    def _host_move(self, nbytes: int) -> tuple[float, StreamEvent]:
        """A move of `nbytes` between the device and host memory, queued: its seconds, its end."""
        seconds = self.roofline.host_seconds(nbytes)
        return seconds, StreamEvent(self.clock, self._queue(seconds))

    def _copy(self, copies: abc.Sequence[tuple[int, int]]) -> None:
        """Copy-on-write block copies on the device, queued."""
        self.kv_pool.copy_blocks(copies)
        self._queue(self.roofline.copy_seconds(len(copies) * self.kv_pool.block_bytes))

    # ------------------------------------------------------------- steps
    def _queue(self, seconds: float) -> float:
        """Queue `seconds` of device work on the stream; when it is done."""
        start, done = self.stream.launch(seconds)
        self.device_seconds += seconds
        if self.busy is not None:
            self.busy.record(start, done)
        return done

    def launch(self, batch: StepBatch) -> Launched:
        """Queue the step's time on the stream (after its copies); returns at once."""
        if batch.copies:  # copy-on-write (without tiers: `apply_tiers` queued them among the moves)
            self._copy(batch.copies)
        cost = self.roofline.step(
            (e.num_computed, e.num_new, 1 if e.samples else 0) for e in batch.entries
        )
        return Launched(batch, self._queue(cost.seconds), cost)

    def wait(self, launched: Launched) -> None:
        """Until the step's outputs are ready (the wall clock sleeps; the virtual one jumps)."""
        self.stream.wait(launched.done)

    def collect(self, launched: Launched) -> list[SampledToken]:
        """The tokens of a step whose outputs are ready (`wait` first)."""
        out: list[SampledToken] = []
        for e in launched.batch.entries:
            if not e.samples:
                continue
            seq = e.seq
            token = self._draw(seq)
            out.append(SampledToken(seq, token))
            # The other samples of a prompt computed just now draw from the same tokens.
            out.extend(SampledToken(c, token) for c in seq.unforked_samples())
        if len(self._digests) > 4 * max(1, len(launched.batch.entries)) + 64:
            self._digests = {k: v for k, v in self._digests.items() if not v[0].is_finished}
        return out

    def _draw(self, seq: Sequence) -> int:
        entry = self._digests.get(id(seq))
        if entry is None or entry[0] is not seq:
            entry = self._digests[id(seq)] = (seq, TokenDigest())
        return next_token(entry[1].extend(seq.token_ids), self.vocab_size, self.avoid)
