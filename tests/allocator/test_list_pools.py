"""ListPools and what a worker advertises with its pool (its HTTP URL and
served model name), against a real server process: the router role, the
exact listing, the pool-registered event, bounds, and that a restart from
Redis (journal and snapshot) keeps it all."""

from __future__ import annotations

import grpc
import pytest

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import Admit, PoolConfig
from allocator_service.core.limits import MAX_ADVERTISE_URL_LEN, MAX_SERVED_MODEL_NAME_LEN
from allocator_service.wire.attest import verify
from allocator_service.wire.codec import PoolInfo
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import code_of, stub

TOKEN, ROUTER_TOKEN, ADMIN_TOKEN = "pools-s3cret", "router-s3cret", "admin-s3cret"
C = grpc.StatusCode


def _client(
    address: str,
    worker_id: str,
    url: str,
    name: str,
    token: str | None = None,
    fingerprint: str = "m",
    num_blocks: int = 16,
) -> GrpcAllocator:
    spec = PoolSpec(
        worker_id,
        PoolConfig(num_blocks, 4, True, fingerprint),
        advertise_url=url,
        served_model_name=name,
    )
    return GrpcAllocator(address, spec, auth_token=token, heartbeat=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, allocator_server):
    d = tmp_path_factory.mktemp("tokens")
    for name, value in (("pools", TOKEN), ("router", ROUTER_TOKEN), ("admin", ADMIN_TOKEN)):
        (d / name).write_text(value)
    with allocator_server(
        "--auth-token-file",
        str(d / "pools"),
        "--router-token-file",
        str(d / "router"),
        "--admin-token-file",
        str(d / "admin"),
        env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "60"},
    ) as s:
        yield s


def test_list_pools_is_the_router_role(server):
    s, _, channel = stub(server.address)
    request = pb.ListPoolsRequest()
    assert code_of(s.ListPools, request) == C.UNAUTHENTICATED
    assert (
        code_of(s.ListPools, request, metadata=(("authorization", f"Bearer {TOKEN}"),))
        == C.PERMISSION_DENIED
    )
    assert (
        code_of(s.ListPools, request, metadata=(("authorization", f"Bearer {ROUTER_TOKEN}"),))
        == C.OK
    )
    assert (
        code_of(s.ListPools, request, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),))
        == C.OK
    )
    channel.close()


def test_list_pools_says_where_each_worker_serves_and_its_load(server):
    router = RouterClient(server.address, router_token=ROUTER_TOKEN)
    events = router.watch_events(from_sequence=1, timeout_s=10)  # from the first: none is missed
    a = _client(server.address, "lp-a", "http://10.0.0.1:8000", "chat-model", TOKEN)
    b = _client(
        server.address,
        "lp-b",
        "https://b.example:9000/",
        "chat-model",
        TOKEN,
        fingerprint="other",
        num_blocks=8,
    )
    try:
        a.step([Admit("s1", list(range(10)))])  # 3 blocks of 4
        listed = [p for p in router.list_pools() if p.pool_id.startswith("lp-")]
        # Each pool's attestation key proves its own worker's identity answers, and no other's.
        nonce = "ab" * 16
        assert verify(
            listed[0].attest_key, nonce, "lp-a/1", "http://10.0.0.1:8000", a.identity(nonce)
        )
        assert verify(
            listed[1].attest_key, nonce, "lp-b/1", "https://b.example:9000", b.identity(nonce)
        )
        assert not verify(
            listed[0].attest_key, nonce, "lp-a/1", "http://10.0.0.1:8000", b.identity(nonce)
        )
        assert not verify(
            listed[0].attest_key, "cd" * 16, "lp-a/1", "http://10.0.0.1:8000", a.identity(nonce)
        )
        assert [p._replace(attest_key=b"") for p in listed] == [
            PoolInfo(
                "lp-a/1",
                "lp-a",
                "m",
                "chat-model",
                "http://10.0.0.1:8000",
                4,
                16,
                13,
                3,
                0,
                1,
                True,
            ),
            PoolInfo(
                "lp-b/1",
                "lp-b",
                "other",
                "chat-model",
                "https://b.example:9000/",
                4,
                8,
                8,
                0,
                0,
                0,
                True,
            ),
        ]
        assert [p.pool_id for p in router.list_pools("other")] == ["lp-b/1"]
        first = next(
            e
            for e in events
            if e.kind == pb.KV_EVENT_KIND_POOL_REGISTERED and e.pool_id == "lp-a/1"
        )
        assert (
            first.pool_id,
            first.worker_id,
            first.advertise_url,
            first.served_model_name,
            first.model_fingerprint,
        ) == ("lp-a/1", "lp-a", "http://10.0.0.1:8000", "chat-model", "m")
    finally:
        events.cancel()
        a.close()
    # A dropped pool is no longer listed.
    assert [p.pool_id for p in router.list_pools() if p.pool_id.startswith("lp-")] == ["lp-b/1"]
    b.close()
    router.close()


def test_a_watcher_of_the_pools_gets_only_the_pools_events(server):
    """WatchEvents with `kinds`: the same numbered stream, only those kinds;
    a kind that is not one is refused."""
    router = RouterClient(server.address, router_token=ROUTER_TOKEN)
    # From the first event (none missed, whenever the server starts each call).
    everything = router.watch_events(from_sequence=1, timeout_s=10)
    pools_only = router.watch_events(
        from_sequence=1,
        timeout_s=10,
        kinds=(pb.KV_EVENT_KIND_POOL_REGISTERED, pb.KV_EVENT_KIND_POOL_DROPPED),
    )
    a = _client(server.address, "kinds-a", "http://10.0.0.2:8000", "chat-model", TOKEN)
    a.step([Admit("s1", list(range(10)))])  # 2 full blocks hashed: 2 BLOCK_STORED events
    a.close()  # deregistered: POOL_DROPPED

    def until_dropped(stream) -> list[tuple[int, int]]:
        got = []
        for e in stream:
            if e.pool_id == "kinds-a/1":
                got.append((e.sequence, e.kind))
                if e.kind == pb.KV_EVENT_KIND_POOL_DROPPED:
                    return got
        raise AssertionError("the stream ended")

    try:
        seen_all = until_dropped(everything)
        assert [k for _, k in seen_all] == [
            pb.KV_EVENT_KIND_POOL_REGISTERED,
            pb.KV_EVENT_KIND_BLOCK_STORED,
            pb.KV_EVENT_KIND_BLOCK_STORED,
            pb.KV_EVENT_KIND_POOL_DROPPED,
        ]
        # the same two events, with the server's own numbers (gaps and all)
        assert until_dropped(pools_only) == [seen_all[0], seen_all[3]]
    finally:
        everything.cancel()
        pools_only.cancel()
    s, _, channel = stub(server.address)
    for bad in ((pb.KV_EVENT_KIND_UNSPECIFIED,), (99,)):
        call = s.WatchEvents(
            pb.WatchEventsRequest(kinds=bad),
            timeout=5,
            metadata=(("authorization", f"Bearer {ROUTER_TOKEN}"),),
        )
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == C.INVALID_ARGUMENT and "not event kinds" in err.value.details()
    channel.close()
    router.close()


@pytest.mark.parametrize(
    "field,value",
    [
        ("advertise_url", "ftp://host:21"),
        ("advertise_url", "http://"),
        ("advertise_url", "http://a b:80"),
        ("advertise_url", "http://h/" + "x" * MAX_ADVERTISE_URL_LEN),
        ("served_model_name", "n" * (MAX_SERVED_MODEL_NAME_LEN + 1)),
        ("served_model_name", "bad\nname"),
    ],
)
def test_what_a_worker_advertises_is_bounded(server, field, value):
    s, md, channel = stub(server.address, TOKEN)
    shape = pb.PoolShape(num_blocks=4, block_size=4, model_fingerprint="m")
    request = pb.RegisterPoolRequest(worker_id="bad-advert", shape=shape, **{field: value})
    assert code_of(s.RegisterPool, request, metadata=md) == C.INVALID_ARGUMENT
    channel.close()


def test_a_restart_from_redis_keeps_what_workers_advertised(redis_store, allocator_server):
    with redis_store() as (url, _):
        args = ("--state", url)
        env = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "2", "PAGEDKV_ALLOCATOR_LEASE_TTL": "60"}
        with allocator_server(*args, env=env) as first:
            workers = [
                _client(first.address, f"w{i}", f"http://127.0.0.1:{9100 + i}", f"model-{i}")
                for i in range(3)
            ]
            for n, w in enumerate(workers):
                for k in range(n + 1):  # some records land in the snapshot, some are replayed
                    w.step([Admit(f"s{k}", [k, 1, 2, 3, 4])])
            before = RouterClient(first.address).list_pools()
            first.kill()
        with allocator_server(*args, env=env, listen=f"127.0.0.1:{first.port}") as again:
            router = RouterClient(again.address)
            assert router.list_pools() == before
            assert [(p.advertise_url, p.served_model_name) for p in before] == [
                (f"http://127.0.0.1:{9100 + i}", f"model-{i}") for i in range(3)
            ]
            router.close()
