"""Helpers for the allocator service tests: raw stubs, and the workload both
sides replay (the server and Redis processes are fixtures: tests/conftest.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import grpc

from allocator_service.core import Admit, Append, Fork, Free, Op, StepColumns, Unreserve
from allocator_service.core.tiers import TierReport
from allocator_service.wire.codec import encode_ops, step_from_proto
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc

_C = grpc.StatusCode
# The status codes the allocator documents; never UNKNOWN or INTERNAL.
DOCUMENTED = {
    _C.OK,
    _C.INVALID_ARGUMENT,
    _C.NOT_FOUND,
    _C.FAILED_PRECONDITION,
    _C.RESOURCE_EXHAUSTED,
    _C.UNAUTHENTICATED,
    _C.PERMISSION_DENIED,
}


def stub(
    address: str, token: str | None = None
) -> tuple[pb_grpc.AllocatorStub, tuple | None, grpc.Channel]:
    channel = grpc.insecure_channel(address)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    return pb_grpc.AllocatorStub(channel), metadata, channel


def code_of(fn, *args, **kwargs) -> grpc.StatusCode:
    """The status code a call ends with (OK when it returns)."""
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def register(
    s: pb_grpc.AllocatorStub,
    metadata,
    worker_id: str,
    num_blocks: int = 64,
    block_size: int = 4,
    prefix: bool = True,
    fingerprint: str = "m",
    replace_credential: str = "",
) -> pb.PoolRef:
    r = s.RegisterPool(
        pb.RegisterPoolRequest(
            worker_id=worker_id,
            replace_credential=replace_credential,
            shape=pb.PoolShape(
                num_blocks=num_blocks,
                block_size=block_size,
                model_fingerprint=fingerprint,
                enable_prefix_caching=prefix,
            ),
        ),
        metadata=metadata,
        timeout=10,
    )
    return pb.PoolRef(pool_id=r.pool_id, credential=r.credential)


def dump(s: pb_grpc.AllocatorStub, metadata, ref: pb.PoolRef) -> dict:
    r = s.DumpPool(pb.DumpPoolRequest(pool=ref), metadata=metadata, timeout=10)
    assert list(r.integrity_problems) == []
    return json.loads(r.state_json)


def as_json(state: dict) -> dict:
    """`to_state()` as it looks after a JSON round trip (what DumpPool sends)."""
    return json.loads(json.dumps(state))


def step_call(ops: list[Op]) -> tuple[StepColumns, bytes]:
    """`ops` as the service's Step takes them (what the servicer decodes)."""
    return step_from_proto(encode_ops(ops))


def tier_report(**lists) -> TierReport | None:
    """A `TierReport` of the lists named (the others empty); None for none."""
    return TierReport([], [], [], [], [])._replace(**lists) if lists else None


def random_steps(seed: int, steps: int, max_ops: int = 6, vocab: int = 6) -> list[list[Op]]:
    """A mixed workload that exercises admits with shared prefixes and salts
    (some reserving slots), appends (copy-on-write after forks; reserved slots filled later or given
    back), forks, frees, failures (unknown sequences, out of blocks, a fork
    of a sequence with reserved slots, giving back more slots than reserved)
    and eviction, for a small pool."""
    rng = random.Random(seed)
    live: list[str] = []
    reserved: dict[str, int] = {}  # a guess: what each sequence holds if its operations succeed
    out: list[list[Op]] = []
    n = 0
    for _ in range(steps):
        ops: list[Op] = []
        for _ in range(rng.randint(1, max_ops)):
            n += 1
            k = rng.random()
            if k < 0.3 or not live:
                seq = f"s{n}"
                # Every fifth holds slots reserved from its admission (a reservation).
                reserve = 3 if n % 5 == 0 else 0
                ops.append(
                    Admit(
                        seq,
                        [rng.randrange(vocab) for _ in range(rng.randint(1, 14))],
                        rng.choice([None, None, "tenant"]),
                        None,
                        reserve,
                    )
                )
                live.append(seq)
                reserved[seq] = reserve
            elif k < 0.65:
                # Some reserve slots for tokens not known yet (async scheduling): the
                # next Append of that sequence fills them first; a Fork of it is refused.
                seq, toks = (
                    rng.choice(live),
                    [rng.randrange(vocab) for _ in range(rng.randint(0, 6))],
                )
                ops.append(Append(seq, toks, rng.choice((0, 0, 0, 1, 2, 5))))
                # if it succeeds
                reserved[seq] = max(0, reserved.get(seq, 0) - len(toks)) + ops[-1].reserve
            elif k < 0.7:
                # Reserved slots given back (refused for more than the sequence holds).
                seq = rng.choice([s for s in live if reserved.get(s)] or live)
                ops.append(Unreserve(seq, rng.randint(1, reserved.get(seq, 0) + 1)))
                reserved[seq] = max(0, reserved.get(seq, 0) - ops[-1].slots)
            elif k < 0.85:
                seq = rng.choice(live)
                live.remove(seq)
                ops.append(Free(seq))
            elif k < 0.95:
                child = f"f{n}"
                ops.append(Fork(rng.choice(live), child))
                live.append(child)
            else:
                ops.append(Append(f"ghost{n}", [1]))
        out.append(ops)
    return out


def freeze(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped (the
    signal takes effect asynchronously: a request sent right after kill()
    could otherwise still be answered)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop (thread states {states})")
        time.sleep(0.005)
