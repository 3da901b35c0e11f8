"""A worker's Step stream recorded once and replayed by many workers at once.

A worker engine whose allocator client is a `recording_allocator` (the gRPC
client as the engine uses it; `pagedkv.bench.fleet` runs one) keeps each
Step it sends: the StepRequest and the StepResponse as serialized on the
wire, when it was sent on the engine's virtual clock (only device time
passes on it), and the device's time of the engine step that sent it: the
time an answer has before the device waits for it (async scheduling sends
step N+1's call while step N computes).

`replay` plays a recording from N workers in one asyncio process: each
registers a pool of the recording's shape, then sends the recorded requests
(its own pool named in them, serialized before it starts) over the
StepStream call at the recorded cadence. A Step answered later than the
device's step time stalls that worker's device by the difference, and its
later Steps go out that much later, as a worker's would. The answers of a
fresh pool to the same requests are the recording's, byte for byte: any
difference is counted as a mismatch.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STEP_STREAM = "/pagedkv.v1.Allocator/StepStream"
STEP = "/pagedkv.v1.Allocator/Step"


@dataclass(frozen=True)
class RecordedStep:
    offset_s: float  # sent this long after the recording's first Step (engine clock)
    device_s: float  # the device time of the engine step that sent it
    request: bytes  # the StepRequest as sent
    response: bytes  # the StepResponse as answered


@dataclass
class Recording:
    shape: bytes  # the pool's PoolShape, serialized
    steps: list[RecordedStep]
    timed_from: int  # the first Step past the worker's warm-up (every first request prefilled)
    lookahead: int = 0  # the recorded worker's lookahead slots


def recording_allocator(clock):
    """The `GrpcAllocator` subclass that keeps each Step it sends in `sent`: (`clock()` when sent,
    the request's bytes, the answer's bytes)."""
    from allocator_service.client.grpc_client import GrpcAllocator

    class RecordingAllocator(GrpcAllocator):
        def __init__(self, *args, **kwargs) -> None:
            self.sent: list[tuple[float, bytes, bytes]] = []
            super().__init__(*args, **kwargs)

        def _send_on_stream(self, request):
            t = clock()
            response = super()._send_on_stream(request)
            self.sent.append((t, request.SerializeToString(), response.SerializeToString()))
            return response

    return RecordingAllocator


# -- replay ---------------------------------------------------------------------------------


@dataclass
class WorkerRun:
    """One replayed worker's timed Steps (those from the recording's `timed_from` on)."""

    latencies: list[float] = field(default_factory=list)
    idle_s: float = 0.0  # sum of max(0, latency - device step time)
    wall_s: float = 0.0  # from its first timed Step sent to its last answered
    late: list[float] = field(default_factory=list)  # how late the load generator sent each Step
    calls: int = 0  # every Step sent, timed or not
    mismatches: int = 0  # answers that differ from the recording's
    errors: list[str] = field(default_factory=list)  # failed calls (the worker stops at the first)
    # its StepStream failed at the first Step (refused): unary Steps, as a worker falls back
    unary: bool = False


async def replay(
    addresses: list[str],
    recording: Recording,
    workers: int,
    *,
    seed: int = 0,
    sample: Callable[[], Any] = time.monotonic,
) -> tuple[list[WorkerRun], Any, Any]:
    """`workers` pools of the recording's shape, worker i's on `addresses[i % len(addresses)]`,
    each replaying the recording, each from a random phase of the recorded worker's call period
    (workers replaying one recording in step would send its large Steps at the same instants, as
    independent workers do not). The runs, and `sample()` taken before the first starts and as
    the last one ends."""
    from allocator_service.client.transport import open_channel
    from allocator_service.wire.codec import PROTOCOL_VERSION
    from allocator_service.wire.v1 import allocator_pb2 as pb
    from allocator_service.wire.v1.allocator_pb2_grpc import AllocatorStub

    channels = [open_channel(a, aio=True) for a in addresses]
    try:
        requests = [pb.StepRequest.FromString(s.request) for s in recording.steps]
        shape = pb.PoolShape.FromString(recording.shape)
        plans = []
        for i in range(workers):
            channel = channels[i % len(channels)]
            r = await AllocatorStub(channel).RegisterPool(
                pb.RegisterPoolRequest(
                    worker_id=f"fleet-{i}", shape=shape, protocol_version=PROTOCOL_VERSION
                )
            )
            ref = pb.PoolRef(pool_id=r.pool_id, credential=r.credential)
            mine = []
            for req in requests:  # serialized now: the load generator only sends bytes
                req.pool.CopyFrom(ref)
                mine.append(req.SerializeToString())
            plans.append((channel, mine))
        rng = random.Random(seed)
        starts = [rng.uniform(0, period(recording)) for _ in plans]
        await asyncio.sleep(0.1)
        start = asyncio.get_running_loop().time() + 0.01
        before = sample()
        runs = await asyncio.gather(
            *(
                _replay_one(channel, mine, recording, start + t)
                for (channel, mine), t in zip(plans, starts, strict=True)
            )
        )
        return runs, before, sample()
    finally:
        for channel in channels:
            await channel.close()


def period(recording: Recording) -> float:
    """The mean time between two of the recording's timed
    Steps (its last Step's device time if one)."""
    timed = recording.steps[recording.timed_from :]
    if len(timed) < 2:
        return recording.steps[-1].device_s if recording.steps else 0.0
    return (timed[-1].offset_s - timed[0].offset_s) / (len(timed) - 1)


async def _replay_one(
    channel, requests: list[bytes], recording: Recording, start: float
) -> WorkerRun:
    import grpc

    loop = asyncio.get_running_loop()
    run = WorkerRun()
    stream = channel.stream_stream(STEP_STREAM)()  # bytes in, bytes out
    unary = channel.unary_unary(STEP)
    first_timed = None
    lag = 0.0  # the device time this worker lost to late answers so far: its schedule slips by it
    for k, (req, step) in enumerate(zip(requests, recording.steps, strict=True)):
        target = start + step.offset_s + lag
        delay = target - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = loop.time()
        try:
            answer = await _send(stream, req) if stream is not None else await unary(req)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, EOFError) as err:
            code = await stream.code() if stream is not None else err.code()
            if k == 0 and stream is not None:
                # Refused (the server's stream limit), or ended as it opened: unary Steps, as a
                # worker falls back. The same step id again:
                # applied once whether or not the stream's was.
                stream, run.unary = None, True
                answer = await unary(req)
            else:
                details = await stream.details() if stream is not None else err.details()
                run.errors.append(f"step {k}: {code.name}: {details}")
                break
        t1 = loop.time()
        run.calls += 1
        latency = t1 - t0
        idle = max(0.0, latency - step.device_s)
        lag += idle
        run.mismatches += answer != step.response
        if k >= recording.timed_from:
            if first_timed is None:
                first_timed = t0
            run.latencies.append(latency)
            run.late.append(max(0.0, t0 - target))
            run.idle_s += idle
            run.wall_s = t1 - first_timed
    if stream is not None:
        stream.cancel()
    return run


async def _send(stream, request: bytes) -> bytes:
    import grpc

    await stream.write(request)
    answer = await stream.read()
    if answer is grpc.aio.EOF:
        raise EOFError("the step stream ended without an answer")
    return answer
