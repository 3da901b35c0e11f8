"""GrpcAllocator's failure handling against a real server: deadlines and
retries that reuse the step id, the pending step after AllocatorUnavailable,
PoolLost after the server lost its state."""

from __future__ import annotations

import os
import signal

import pytest

from allocator_service.client import (
    AllocatorUnavailable,
    EmbeddedAllocator,
    PoolLost,
    PoolSpec,
    connect,
)
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Append, InvalidArgument, PoolConfig
from tests.support.allocator import as_json, freeze, random_steps

SPEC = PoolSpec("client-test", PoolConfig(32, 4, True, "m"))


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_stalled_server_retried_steps_apply_once(allocator_server, step_stream):
    """SIGSTOP the server: attempts time out and queue up at the socket; on
    SIGCONT it sees the same step id several times and applies it once. On
    the step stream the deadline is the watchdog's: it cuts the stream and
    each retry goes on a new one."""
    steps = random_steps(seed=21, steps=12)
    reference = EmbeddedAllocator(SPEC)
    with allocator_server() as server:
        worker = GrpcAllocator(
            server.address, SPEC, deadline_s=0.3, retries=2, backoff_s=0.01, step_stream=step_stream
        )
        for ops in steps[:6]:
            assert worker.step(ops) == reference.step(ops)
        freeze(server.proc.pid)
        try:
            with pytest.raises(AllocatorUnavailable):
                worker.step(steps[6])
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        worker._call.deadline_s = 5
        # The same operations again: the pending step id, answered once.
        assert worker.step(steps[6]) == reference.step(steps[6])
        for ops in steps[7:]:
            assert worker.step(ops) == reference.step(ops)
        assert worker.stats().num_sequences == reference.stats().num_sequences
        assert worker.dump() == as_json(reference.pool.to_state())
        worker.close()


def test_restart_without_durable_state_is_pool_lost(allocator_server):
    with allocator_server() as server:
        worker = connect(server.address, SPEC, retries=40, backoff_s=0.02)
        worker.step([Admit("a", [1, 2, 3])])
        server.kill()
        with allocator_server(listen=f"127.0.0.1:{server.port}"):
            with pytest.raises(PoolLost):
                worker.step([Append("a", [4])])
            assert worker.pool_id == "client-test/1"  # a new server: epochs start over
            assert worker.step([Admit("a", [1, 2, 3])])[0].append == [0]
            worker.close()


def test_unencodable_tokens_are_invalid_argument(allocator_server):
    with allocator_server() as server:
        worker = GrpcAllocator(server.address, SPEC)
        with pytest.raises(InvalidArgument):
            worker.step([Admit("a", [-1])])
        with pytest.raises(InvalidArgument):
            worker.step([Append("a", [2**32])])
        assert worker.step([Admit("a", [1])])[0].ok  # nothing was sent, ids still in order
        worker.close()


def test_unreachable_allocator():
    with pytest.raises(AllocatorUnavailable):
        GrpcAllocator("127.0.0.1:1", SPEC, retries=1, backoff_s=0.01, deadline_s=1)
