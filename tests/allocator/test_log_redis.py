"""Redis under the log, on real processes (a real redis-server on its own
port): Redis that loses its data while serving is detected (health NOT_SERVING,
pools dropped loudly, workers recover with PoolLost, SERVING again); an evicting
Redis is refused; `PAGEDKV_ALLOCATOR_REDIS_WAIT_REPLICAS` waits for a real replica.
(Damage to the journal itself: tests/allocator/test_log_integrity.py.)"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time

import grpc
import pytest
import redis as redis_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from allocator_service.client import EmbeddedAllocator, PoolLost, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import PoolConfig
from allocator_service.store.journal import split_prefix
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from pagedkv.stack.probes import free_port
from tests.support.allocator import as_json, code_of, random_steps, register, stub
from tests.support.drills import report
from tests.support.state_store import keys, start_fails

C = grpc.StatusCode


def _health_watch(address: str):
    channel = grpc.insecure_channel(address)
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=60
    )
    seen: list[int] = []

    def read():
        try:
            for r in stream:
                seen.append(r.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    return seen, stream, channel


def test_flushall_while_serving(store, allocator_server):
    url, _ = store
    spec = PoolSpec("flushed", PoolConfig(16, 4, True, "m"))
    steps = random_steps(seed=4, steps=10)
    with allocator_server("--state", url) as server:
        worker = GrpcAllocator(server.address, spec, retries=30, backoff_s=0.02, deadline_s=2)
        for ops in steps[:5]:
            worker.step(ops)
        seen, stream, channel = _health_watch(server.address)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [health_pb2.HealthCheckResponse.SERVING]
        client, prefix = keys(url)
        t0 = time.monotonic()
        client.flushall()
        deadline = time.monotonic() + 10
        while (
            health_pb2.HealthCheckResponse.NOT_SERVING not in seen
            or seen[-1] != health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.monotonic() < deadline, seen
            time.sleep(0.01)
        recovered_s = time.monotonic() - t0
        # The pool was dropped loudly: the worker's next step is PoolLost and
        # it recomputes on a fresh pool (a new epoch: no id is reissued).
        with pytest.raises(PoolLost):
            worker.step(steps[5])
        assert worker.pool_id == "flushed/2"
        reference = EmbeddedAllocator(spec)
        for ops in steps[:6]:
            assert worker.step(ops) == reference.step(ops)
        assert worker.dump() == as_json(reference.pool.to_state())
        assert client.get(prefix + "owner") is not None and client.get(prefix + "head") is not None
        client.close()
        stream.cancel()
        channel.close()
        worker.close()
        log = "\n".join(server.lines)
    assert (
        "the state store lost the allocator's state" in log
        and "dropping all 1 pools: flushed/1" in log
    )
    assert "Traceback" not in log
    report(
        "redis_flushall",
        {"flush_to_serving_again_s": round(recovered_s, 2), "health": [int(x) for x in seen]},
    )


def test_evicting_redis_is_refused(store):
    url, r = store
    client, _ = keys(url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        code, out = start_fails(url)
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.close()
    assert code == 1 and "maxmemory-policy 'allkeys-lru'" in out and "noeviction" in out, out


def _replica(primary_port: int):
    exe = shutil.which("redis-server")
    port = free_port("127.0.0.1")
    directory = tempfile.mkdtemp(prefix="pagedkv-replica-")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            directory,
            "--save",
            "",
            "--appendonly",
            "no",
            "--replicaof",
            "127.0.0.1",
            str(primary_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, port, directory


def test_wait_for_a_replica(store, allocator_server):
    url, r = store
    replica, port, directory = _replica(r.port)
    try:
        rc = redis_lib.Redis(port=port)
        deadline = time.monotonic() + 15
        while True:
            try:
                if rc.info("replication").get("master_link_status") == "up":
                    break
            except redis_lib.exceptions.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the replica did not sync"
            time.sleep(0.05)
        wait = {
            "PAGEDKV_ALLOCATOR_REDIS_WAIT_REPLICAS": "1",
            "PAGEDKV_ALLOCATOR_REDIS_WAIT_TIMEOUT": "0.5",
        }
        with allocator_server("--state", url, env=wait) as server:
            s, md, channel = stub(server.address)
            ref = register(s, md, "waited", num_blocks=24)
            s.Step(
                pb.StepRequest(
                    pool=ref, step_id=1, ops=encode_ops(random_steps(1, 1)[0]), prev_step_id=0
                )
            )
            _, prefix = split_prefix(url)
            # Acknowledged means on the replica already.
            assert rc.llen(prefix + "journal") == 2
            replica.kill()
            replica.wait()
            t0 = time.monotonic()
            late = pb.StepRequest(pool=ref, step_id=2, ops=encode_ops([]), prev_step_id=1)
            assert code_of(s.Step, late, timeout=10) == C.UNAVAILABLE
            waited = time.monotonic() - t0
            assert server.proc.poll() is None
            channel.close()
            log = "\n".join(server.lines)
        assert waited >= 0.5
        report("redis_wait_replica_lost", {"unavailable_after_s": round(waited, 2)})
        assert "Traceback" not in log
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait()
        shutil.rmtree(directory, ignore_errors=True)
