"""A pool's role in prefill/decode disaggregation (`PoolShape.kv_role`), against a
real allocator process: listed by ListPools with the pool's store namespace,
journaled with the pool (an allocator killed and restarted on its journal
lists the same roles, through a snapshot and the records after it), and checked
at registration."""

from __future__ import annotations

import grpc
import pytest

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import Admit, Free, PoolConfig
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import stub


def _spec(worker: str, role: str) -> PoolSpec:
    return PoolSpec(
        worker,
        PoolConfig(
            num_blocks=8,
            block_size=4,
            enable_prefix_caching=True,
            model_fingerprint="fp",
            layout="L",
            block_bytes=2048,
            use_shared_store=True,
            kv_role=role,
        ),
    )


def _roles(address: str) -> dict[str, tuple[str, str]]:
    router = RouterClient(address)
    try:
        return {p.worker_id: (p.kv_role, p.store_namespace) for p in router.list_pools()}
    finally:
        router.close()


def test_roles_are_listed_and_survive_a_restart_on_the_journal(
    redis_store, allocator_server, tmp_path
):
    with redis_store() as (url, _):
        args = ("--state", url, "--kv-shared-store", f"file://{tmp_path}")
        args += ("--kv-shared-store-size", "0.01")
        env = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "3"}
        with allocator_server(*args, env=env) as server:
            clients = [
                GrpcAllocator(server.address, _spec(w, r), heartbeat=False)
                for w, r in (("p", "prefill"), ("d", "decode"), ("b", "both"))
            ]
            for i in range(4):  # steps enough for a snapshot, and records after it
                assert clients[0].step([Admit(f"s{i}", [1, 2, 3, 4, 5])]).all_ok
                assert clients[0].step([Free(f"s{i}")]).all_ok
            listed = _roles(server.address)
            assert listed == {"p": ("prefill", "L"), "d": ("decode", "L"), "b": ("both", "L")}
            server.kill()
        with allocator_server(*args, env=env, listen=f"127.0.0.1:{server.port}") as again:
            assert "3 pools restored" in "\n".join(again.lines)
            assert _roles(again.address) == listed
            for c in clients:
                c.close()


def test_a_role_the_allocator_does_not_know_is_refused(allocator_server, tmp_path):
    with allocator_server(
        "--kv-shared-store", f"file://{tmp_path}", "--kv-shared-store-size", "0.01"
    ) as server:
        shape = pb.PoolShape(
            num_blocks=8,
            block_size=4,
            enable_prefix_caching=True,
            layout="L",
            block_bytes=2048,
            use_shared_store=True,
            kv_role="bogus",
        )
        with pytest.raises(grpc.RpcError) as err:
            s, _, channel = stub(server.address)
            try:
                s.RegisterPool(pb.RegisterPoolRequest(worker_id="w", shape=shape))
            finally:
                channel.close()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "kv_role must be one of both, prefill, decode"
