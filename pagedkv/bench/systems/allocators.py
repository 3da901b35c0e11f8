"""The allocators a benchmark compares, each started the one way:

- `embedded`: the pool in the benchmark's own process (`EmbeddedAllocator`);
- `grpc`: a real allocator process (`python -m allocator_service`), memory state;
- `grpc+redis`: one journaling to a private `redis-server` with append-only
  persistence.

`deploy` starts what a kind needs on an `ExitStack` (stopped when it closes,
an allocator before its Redis) and gives the address a client or an engine
connects to ("embedded" for the in-process pool); `connect` opens a client on
it. `EventFollower` is another process following every KV event of an
allocator, as a router's cache view does.
"""

from __future__ import annotations

import contextlib
import time

KINDS = ("embedded", "grpc", "grpc+redis")
EMBEDDED = "embedded"


def deploy(stack: contextlib.ExitStack, kind: str) -> str:
    """Start the allocator of `kind` (one of KINDS) on `stack`; its address."""
    from pagedkv.stack import start_allocator, start_redis
    from pagedkv_base.settings import CliError

    if kind == EMBEDDED:
        return EMBEDDED
    args: list[str] = []
    if kind == "grpc+redis":
        try:
            redis = start_redis()
        except FileNotFoundError:
            raise CliError("grpc+redis needs redis-server on PATH") from None
        stack.callback(redis.stop)  # registered first: stopped after its allocator
        args = ["--state", redis.url]
    elif kind != "grpc":
        raise ValueError(f"unknown allocator kind {kind!r}")
    server = start_allocator(args)
    stack.callback(server.terminate)
    return server.address


def connect(address: str, spec, *, step_stream: bool = True):
    """A client of the pool `spec` on the allocator at `address` (or embedded)."""
    if address == EMBEDDED:
        from allocator_service.client import EmbeddedAllocator

        return EmbeddedAllocator(spec)
    from allocator_service.client.grpc_client import GrpcAllocator

    return GrpcAllocator(address, spec, step_stream=step_stream)


WATCHERS = ("none", "plain", "packed")


class EventFollower:
    """Another process following every KV event of the allocator at
    `address` (packed or not) while a case runs; `stop()` says how many
    messages and events it received."""

    def __init__(self, address: str, packed: bool) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with grpc threads
        # No lock: one writer, read after it is stopped (a
        # child killed holding a lock would hang the reader).
        self._counts = ctx.Array("q", 2, lock=False)
        self._ready = ctx.Event()
        self._proc = ctx.Process(
            target=_follow_events, args=(address, packed, self._counts, self._ready), daemon=True
        )
        self._proc.start()
        self._result: dict | None = None
        deadline = time.monotonic() + 60
        while not self._ready.wait(0.1):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the event follower did not start (exit code {self._proc.exitcode})"
                )

    def stop(self) -> dict:
        if self._result is None:
            self._proc.terminate()
            self._proc.join(10)
            self._result = {"watcher_messages": self._counts[0], "watcher_events": self._counts[1]}
        return self._result


def _follow_events(
    address: str, packed: bool, counts, ready
) -> None:  # pragma: no cover - a child process
    from allocator_service.client.router_client import RouterClient
    from allocator_service.wire.v1 import allocator_pb2 as pb

    # As a router's view follows: a snapshot (whose end says the stream is live), then every event.
    for event in RouterClient(address).watch_events(packed=packed, snapshot=True):
        if event.kind == pb.KV_EVENT_KIND_SNAPSHOT_END:
            ready.set()
            continue
        if ready.is_set():  # counted in place: the parent reads them when it stops this process
            counts[0] += 1
            counts[1] += (
                max(1, len(event.block_ids)) if event.kind == pb.KV_EVENT_KIND_BLOCKS_CHANGED else 1
            )
