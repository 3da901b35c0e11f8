"""Attacks on the allocator's reads: integrity checks kept in flight (`slow_read_flood`), the
largest legal snapshot (`snapshot_amplifier`), slow snapshot readers (`SnapshotWatchers`)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import grpc

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Fork, PoolConfig
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc


def slow_read_flood(
    address: str,
    stop,
    ready,
    *,
    pools: int = 12,
    in_flight: int = 24,
    blocks: int = 32768,
    tokens: int = 16384,
    token: str | None = None,
    outcome=None,
) -> None:
    """Register `pools` large pools, fill each with `tokens` tokens, then keep
    `in_flight` integrity checks of each in flight until `stop` (answers and
    refusals alike are sent again at once); `ready` once they are. `outcome`
    (a queue) gets {"registered": n, "codes": {code: n}} at the end: the
    registrations refused and the checks' answers."""
    channel = grpc.insecure_channel(address)
    s = pb_grpc.AllocatorStub(channel)
    md = (("authorization", f"Bearer {token}"),) if token else None
    codes: Counter[str] = Counter()
    lock = threading.Lock()
    refs = []
    try:
        for i in range(pools):
            shape = pb.PoolShape(
                num_blocks=blocks, block_size=16, model_fingerprint="m", enable_prefix_caching=True
            )
            r = s.RegisterPool(
                pb.RegisterPoolRequest(worker_id=f"flood-{i}", shape=shape), metadata=md, timeout=10
            )
            ref = pb.PoolRef(pool_id=r.pool_id, credential=r.credential)
            s.Step(
                pb.StepRequest(
                    pool=ref, step_id=1, ops=encode_ops([Admit("a", list(range(1, tokens + 1)))])
                ),
                metadata=md,
                timeout=60,
            )
            refs.append(ref)
    except grpc.RpcError as err:
        codes[f"RegisterPool {err.code().name}"] += 1

    def again(ref):
        def send(done=None):
            if done is not None:
                code = done.code()
                with lock:
                    codes[code.name if code is not None else "CANCELLED"] += 1
            if not stop.is_set():
                s.GetPoolStats.future(
                    pb.GetPoolStatsRequest(pool=ref, check_integrity=True), metadata=md, timeout=60
                ).add_done_callback(send)

        return send

    for ref in refs:
        for _ in range(in_flight):
            again(ref)()
    ready.set()
    stop.wait(600)
    time.sleep(0.5)  # the last answers' callbacks
    channel.close()
    if outcome is not None:
        with lock:
            outcome.put({"registered": len(refs), "codes": dict(codes)})


def snapshot_amplifier(
    address: str,
    token: str | None = None,
    *,
    blocks: int = 2048,
    block_size: int = 4,
    prompt_tokens: int = 8,
    steps: int = 8,
    forks: int = 500,
    id_chars: int = 256,
    seed: int = 4,
) -> tuple[GrpcAllocator, Counter]:
    """A legal pool of `blocks` blocks: one sequence with an id of `id_chars`
    characters and `prompt_tokens` tokens, then `steps` steps of `forks` forks
    of it, each with an id of `id_chars` characters (in steps whose answers
    fit a message). The client, and its operations' outcomes ("ok" or the
    error's name); grpc.RpcError if the pool is refused."""
    pool = GrpcAllocator(
        address,
        PoolSpec("snapshot-amplifier", PoolConfig(blocks, block_size, True, "m")),
        auth_token=token,
    )
    parent = "x" * id_chars
    outcomes: Counter[str] = Counter()
    for r in pool.step([Admit(parent, list(range(prompt_tokens)))]):
        outcomes["ok" if r.ok else str(r.error)] += 1
    names = random.Random(seed)
    for _ in range(steps):
        for r in pool.step(
            [Fork(parent, names.randbytes(id_chars // 2).hex()) for _ in range(forks)]
        ):
            outcomes["ok" if r.ok else str(r.error)] += 1
    return pool, outcomes


class SnapshotWatchers:
    """`n` WatchEvents streams, each asking for the snapshot of every pool's
    cached blocks and reading a message every `pause_s`, until `stop()`:
    then their messages read and how each ended, by code."""

    def __init__(
        self, address: str, n: int, token: str | None = None, pause_s: float = 0.05
    ) -> None:
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", -1)]
        )
        self._stub = pb_grpc.AllocatorStub(self._channel)
        self._md = (("authorization", f"Bearer {token}"),) if token else None
        self._pause_s = pause_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._streams: list = []
        self.messages = 0
        self.snapshots_ended = 0
        self.codes: Counter[str] = Counter()
        self._threads = [
            threading.Thread(target=self._watch, daemon=True, name=f"watcher-{i}") for i in range(n)
        ]

    def start(self) -> SnapshotWatchers:
        for t in self._threads:
            t.start()
        return self

    def _watch(self) -> None:
        stream = self._stub.WatchEvents(
            pb.WatchEventsRequest(snapshot=True), metadata=self._md, timeout=600
        )
        with self._lock:
            self._streams.append(stream)
        code = "OK"
        try:
            for event in stream:
                with self._lock:
                    self.messages += 1
                    self.snapshots_ended += event.kind == pb.KV_EVENT_KIND_SNAPSHOT_END
                if self._stop.wait(self._pause_s):
                    break
        except grpc.RpcError as err:
            code = err.code().name
        with self._lock:
            self.codes[code if not self._stop.is_set() or code != "CANCELLED" else "OK"] += 1

    def stop(self) -> dict:
        self._stop.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        for t in self._threads:
            t.join(30)
        self._channel.close()
        return {
            "messages": self.messages,
            "snapshots_ended": self.snapshots_ended,
            "codes": dict(self.codes),
        }
