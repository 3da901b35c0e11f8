"""Capacity is the admin's: a worker token's quota (`WORKER_ID URL TOKEN
BLOCKS` in --worker-tokens-file) bounds its worker's pool and keeps those
blocks for it while it has none (a restart), so a hog cannot take them;
`--max-pool-blocks` bounds every other pool. A worker that finds no room
says so in one line and retries until room frees; one refused for good
exits with one line, not a traceback. A real gRPC server (in this process,
so its total can be small) and real worker processes."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from allocator_service.client.transport import error_reason
from allocator_service.config import Limits, ServiceConfig
from allocator_service.roles import parse_worker_tokens
from allocator_service.rpc.server import create_server
from allocator_service.service import AllocatorService
from allocator_service.wire.v1 import allocator_pb2 as pb
from pagedkv.stack import WorkerProcess
from tests.support.allocator import stub

SHARED, ADMIN = "shared-pools-token", "admin-token-q"
TOTAL = 256
TABLE = """\
victim http://victim:8000 tok-victim 64
"""


class Server:
    """An allocator of TOTAL blocks with the worker tokens TABLE (their quotas kept), the shared
    token and `max_pool_blocks`."""

    def __init__(self, max_pool_blocks: int | None = None, total: int = TOTAL) -> None:
        grants = parse_worker_tokens(TABLE)
        self.service = AllocatorService(
            ServiceConfig(
                limits=Limits(max_total_blocks=total),
                max_pool_blocks=max_pool_blocks,
                reserved_blocks={g.worker_id: g.blocks for g in grants.values() if g.blocks},
            )
        )
        self.server, port = create_server(
            "127.0.0.1:0", self.service, auth_token=SHARED, admin_token=ADMIN, worker_tokens=grants
        )
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def register(
        self, token: str, worker_id: str, num_blocks: int, url: str = ""
    ) -> pb.PoolRef | str:
        """The pool, or the refusal's reason."""
        s, md, channel = stub(self.address, token)
        try:
            r = s.RegisterPool(
                pb.RegisterPoolRequest(
                    worker_id=worker_id,
                    advertise_url=url,
                    shape=pb.PoolShape(num_blocks=num_blocks, block_size=4, model_fingerprint="m"),
                ),
                metadata=md,
                timeout=10,
            )
            return pb.PoolRef(pool_id=r.pool_id, credential=r.credential)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            return error_reason(err)
        finally:
            channel.close()

    def deregister(self, token: str, ref: pb.PoolRef) -> None:
        s, md, channel = stub(self.address, token)
        s.DeregisterPool(pb.DeregisterPoolRequest(pool=ref), metadata=md, timeout=10)
        channel.close()

    def close(self) -> None:
        self.server.stop(0).wait()


@pytest.fixture
def server():
    s = Server(max_pool_blocks=200)
    yield s
    s.close()


def test_a_hog_cannot_take_a_restarting_workers_blocks(server):
    victim = server.register("tok-victim", "victim", 64, "http://victim:8000")
    assert isinstance(victim, pb.PoolRef)
    # The hog takes every other block; more is refused,
    # and so is any pool while the victim restarts.
    hog = server.register(SHARED, "hog", TOTAL - 64)
    assert isinstance(hog, pb.PoolRef)
    # the victim's process restarts: its pool is gone a moment
    server.deregister("tok-victim", victim)
    assert server.register(SHARED, "hog-2", 64) == "capacity"  # its 64 blocks are kept for it
    assert server.register(SHARED, "hog-2", 1) == "capacity"
    again = server.register("tok-victim", "victim", 64, "http://victim:8000")
    assert isinstance(again, pb.PoolRef) and again.pool_id == "victim/2"
    # The quota bounds the victim itself, and --max-pool-blocks every pool without a quota.
    server.deregister(SHARED, hog)
    assert server.register("tok-victim", "victim", 65, "http://victim:8000") == "quota"
    assert server.register(SHARED, "big", 201) == "quota"
    # what is left beside the victim's
    assert isinstance(server.register(SHARED, "big", 192), pb.PoolRef)


def test_quotas_in_the_worker_tokens_file(tmp_path, allocator_server):
    table = tmp_path / "workers"
    table.write_text("a http://a:8000 tok-a 64\nb http://b:8000 tok-b\n")
    with allocator_server("--worker-tokens-file", str(table)) as s:
        ch, md, channel = stub(s.address, "tok-a")
        with pytest.raises(grpc.RpcError) as err:
            ch.RegisterPool(
                pb.RegisterPoolRequest(
                    worker_id="a",
                    advertise_url="http://a:8000",
                    shape=pb.PoolShape(num_blocks=65, block_size=4, model_fingerprint="m"),
                ),
                metadata=md,
                timeout=10,
            )
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and error_reason(err.value) == "quota"
        )
        assert "at most 64 blocks" in err.value.details()
        ch.RegisterPool(
            pb.RegisterPoolRequest(
                worker_id="a",
                advertise_url="http://a:8000",
                shape=pb.PoolShape(num_blocks=64, block_size=4, model_fingerprint="m"),
            ),
            metadata=md,
            timeout=10,
        )
        channel.close()
    for bad, why in (
        ("a http://a:8000 tok-a 0\n", "BLOCKS must be a positive whole number"),
        ("a http://a:8000 tok-a 3000000\nb http://b:8000 tok-b 3000000\n", "add up to 6000000"),
    ):
        table.write_text(bad)
        out = subprocess.run(
            [sys.executable, "-m", "allocator_service", "--worker-tokens-file", str(table)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr, (
            out.stderr
        )


def _worker(server: Server, tmp_path, name: str, num_blocks: int) -> WorkerProcess:
    token = tmp_path / "shared"
    token.write_text(SHARED)
    return WorkerProcess(
        name,
        model="tiny-random",
        allocator=server.address,
        args=[
            "--allocator-token-file",
            str(token),
            "--num-blocks",
            str(num_blocks),
            "--block-size",
            "4",
            "--log-level",
            "warning",
        ],
    )


def test_a_worker_with_no_room_says_so_in_one_line_and_retries(tmp_path):
    server = Server(total=128)
    try:
        hog = server.register(SHARED, "hog", 128 - 64)  # every block but the victim's quota
        assert isinstance(hog, pb.PoolRef)
        worker = _worker(server, tmp_path, "late", 32).start()
        try:
            deadline = time.monotonic() + 60
            while not any("cannot register yet" in line for line in worker.lines):
                assert worker.alive() and time.monotonic() < deadline, worker.lines
                time.sleep(0.1)
            server.deregister(SHARED, hog)  # room again: the worker's retry registers it
            worker.wait_healthy(60)
            said = [line for line in worker.lines if "register" in line]
            assert (
                len(said) == 1
                and "RESOURCE_EXHAUSTED" not in said[0]
                and "blocks would exceed" in said[0]
            )
            assert not any("Traceback" in line for line in worker.lines)
        finally:
            worker.terminate()
    finally:
        server.close()


def test_a_worker_over_its_quota_exits_with_one_line(tmp_path):
    server = Server(max_pool_blocks=16)
    try:
        worker = _worker(server, tmp_path, "greedy", 32).start()
        worker.proc.popen.wait(60)
        worker.proc.finish()
        assert worker.proc.popen.returncode == 2
        assert not any("Traceback" in line for line in worker.lines), worker.lines
        assert worker.lines[-1] == (
            f"pagedkv worker: error: the allocator at {server.address} did not register "
            "this worker's pool: RESOURCE_EXHAUSTED: a pool may have at most 16 blocks "
            "(--max-pool-blocks), not 32"
        )
    finally:
        server.close()
