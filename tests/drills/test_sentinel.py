"""The journal behind Redis Sentinel (`--state redis+sentinel://HOST:PORT/MASTER/DB`):
real processes, a primary, a replica and a Sentinel; the primary killed under load.

The allocator follows the primary the Sentinel promotes. Replication is
asynchronous, so the last steps acknowledged before the kill may be missing on
the promoted replica: then the pool is dropped loudly (the worker's client
gets PoolLost and registers afresh, docs/reliability.md), never silently served
from a shorter journal. Either way every table the worker was answered after
the failover is the allocator's, and the allocator's state is sound.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis as redis_lib

from allocator_service.client import PoolLost, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Append, Free, PoolConfig
from pagedkv.stack.probes import free_port
from tests.support.drills import report, wait_for

MASTER = "pagedkv"
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class Redises:
    """A primary, its replica and one Sentinel (quorum 1) on loopback ports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.primary, self.replica, self.sentinel = (free_port("127.0.0.1") for _ in range(3))

    def _start(self, name: str, *args: str) -> None:
        d = self.root / name
        d.mkdir()
        self.procs[name] = subprocess.Popen(
            [shutil.which("redis-server"), *args, "--dir", str(d)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def __enter__(self) -> Redises:
        common = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "yes")
        self._start("primary", "--port", str(self.primary), *common)
        self._start(
            "replica",
            "--port",
            str(self.replica),
            *common,
            "--replicaof",
            "127.0.0.1",
            str(self.primary),
        )
        conf = self.root / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel}\nbind 127.0.0.1\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 500\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        self._start("sentinel", str(conf), "--sentinel")
        replica = redis_lib.Redis(port=self.replica)
        wait_for(lambda: self._up(replica), 30, "the replica to sync")
        sentinel = redis_lib.Redis(port=self.sentinel)
        wait_for(lambda: self._up(sentinel, sentinel=True), 30, "the Sentinel to watch the primary")
        return self

    @staticmethod
    def _up(client: redis_lib.Redis, sentinel: bool = False) -> bool:
        try:
            if sentinel:
                return client.execute_command("SENTINEL", "replicas", MASTER) != []
            return client.info("replication").get("master_link_status") == "up"
        except redis_lib.exceptions.ConnectionError:
            return False

    def master_port(self) -> int:
        addr = redis_lib.Redis(port=self.sentinel).execute_command(
            "SENTINEL", "get-master-addr-by-name", MASTER
        )
        return int(addr[1])

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_journal_follows_the_primary_sentinel_promotes(allocator_server, tmp_path):
    with (
        Redises(tmp_path) as r,
        allocator_server(
            "--state",
            f"redis+sentinel://127.0.0.1:{r.sentinel}/{MASTER}/0",
            env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "60"},
        ) as server,
    ):
        spec = PoolSpec("w", PoolConfig(num_blocks=256, block_size=4))
        client = GrpcAllocator(server.address, spec, retries=60, backoff_s=0.2)
        tables: dict[str, list[int]] = {}

        def step(i: int) -> None:
            ops = [Admit(f"s{i}", [i % 7 + 1] * 5)] + [Append(s, [1]) for s in list(tables)[-3:]]
            if len(tables) > 8:
                ops.append(Free(next(iter(tables))))
            result = client.step(ops)
            assert result.all_ok
            if len(tables) > 8:
                tables.pop(next(iter(tables)))
            for seq in [f"s{i}", *list(tables)[-3:]]:
                tables[seq] = client.block_table(seq)

        for i in range(20):
            step(i)
        r.procs["primary"].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        lost = False
        for i in range(20, 60):
            # under load through the failover: each step retried until it is answered
            try:
                step(i)
            except PoolLost:
                # a step acknowledged before the kill was not on the replica: dropped loudly
                lost = True
                tables.clear()
        served_again_s = time.monotonic() - t0
        # the Sentinel promoted the replica, and the allocator followed it
        assert r.master_port() == r.replica
        assert {
            seq: client.block_table(seq) for seq in tables
        } == tables  # what the worker was told is the state
        assert client.integrity_problems() == []
        log = "\n".join(server.lines)
        assert "Traceback" not in log
        if lost:
            assert "dropping" in log or "dropped" in log, log[-2000:]
        client.close()
    report(
        "redis_sentinel_failover",
        {
            "steps_through_failover": 40,
            "pool_lost": lost,
            "served_again_s": round(served_again_s, 2),
        },
    )
