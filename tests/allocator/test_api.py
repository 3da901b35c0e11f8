"""The allocator service through gRPC, against a real server process: the
same answers as the in-process core, credentials, idempotent steps, limits,
MatchPrefix, the KV event stream, health, reflection and metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from allocator_service.client import EmbeddedAllocator, PoolLost, PoolSpec, connect
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.client.transport import error_reason
from allocator_service.config import Limits
from allocator_service.core import Admit, Append, Free, PoolConfig, UnknownSequence
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import (
    as_json,
    code_of,
    dump,
    random_steps,
    register,
    stub,
)

TOKEN = "s3cret-token"
ADMIN_TOKEN = "admin-s3cret"
ROUTER_TOKEN = "router-s3cret"
TRACES = Path(__file__).parents[1] / "traces"
C = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory, allocator_server):
    tokens = tmp_path_factory.mktemp("auth")
    for name, value in (("token", TOKEN), ("admin", ADMIN_TOKEN), ("router", ROUTER_TOKEN)):
        (tokens / name).write_text(value + "\n")
    with allocator_server(
        "--auth-token-file",
        str(tokens / "token"),
        "--metrics-port",
        "0",
        env={
            "PAGEDKV_ALLOCATOR_LEASE_TTL": "60",
            "PAGEDKV_ALLOCATOR_ADMIN_TOKEN_FILE": str(tokens / "admin"),
            "PAGEDKV_ALLOCATOR_ROUTER_TOKEN_FILE": str(tokens / "router"),
        },
    ) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    s, md, channel = stub(server.address, TOKEN)
    yield s, md
    channel.close()


def client(
    server, worker_id: str, replace_credential: str = "", register_wait_s: float = 120.0, **spec
) -> GrpcAllocator:
    shape = {
        "num_blocks": 48,
        "block_size": 4,
        "model_fingerprint": "m",
        "enable_prefix_caching": True,
    } | spec
    return GrpcAllocator(
        server.address,
        PoolSpec(worker_id, PoolConfig(**shape)),
        auth_token=TOKEN,
        replace_credential=replace_credential,
        register_wait_s=register_wait_s,
    )


@pytest.mark.parametrize("prefix", [False, True])
def test_random_workload_matches_in_process(server, prefix):
    spec = PoolSpec(f"parity-{prefix}", PoolConfig(40, 4, prefix, "m"))
    remote = connect(server.address, spec, auth_token=TOKEN)
    local = EmbeddedAllocator(spec)
    try:
        for ops in random_steps(seed=7 + prefix, steps=120):
            assert remote.step(ops) == local.step(ops)
        assert remote.dump() == as_json(local.pool.to_state())
        assert remote.stats() == local.stats()
        assert remote.integrity_problems() == []
        for seq in list(local.pool.tables())[:5]:
            assert remote.block_table(seq) == local.block_table(seq)
        with pytest.raises(UnknownSequence):
            remote.block_table("no-such-seq")
        assert remote.reset_prefix_cache() == local.reset_prefix_cache()
        assert remote.dump() == as_json(local.pool.to_state())
    finally:
        remote.close()


@pytest.mark.parametrize(
    "trace,flags",
    [
        ("article_table.jsonl", ["--num-blocks", "8", "--block-size", "4"]),
        ("article_prefix_sharing.jsonl", ["--num-blocks", "6", "--block-size", "4"]),
        ("article_table.jsonl", ["--num-blocks", "8", "--block-size", "2", "--prefix-caching"]),
    ],
)
def test_replay_through_grpc_prints_the_same_lines(server, tmp_path, trace, flags):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cmd = [sys.executable, "-m", "pagedkv", "replay", str(TRACES / trace), *flags]
    local = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    remote = subprocess.run(
        [*cmd, "--allocator", server.address, "--allocator-token-file", str(token_file)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert remote == local
    assert len(local.splitlines()) >= 4


def test_bearer_token_is_required_except_for_health(server):
    bare, _, channel = stub(server.address)
    shape = pb.PoolShape(num_blocks=4, block_size=4)
    assert (
        code_of(bare.RegisterPool, pb.RegisterPoolRequest(worker_id="x", shape=shape))
        == C.UNAUTHENTICATED
    )
    wrong = (("authorization", "Bearer nope"),)
    assert (
        code_of(
            bare.RegisterPool, pb.RegisterPoolRequest(worker_id="x", shape=shape), metadata=wrong
        )
        == C.UNAUTHENTICATED
    )
    events = bare.WatchEvents(pb.WatchEventsRequest())
    assert code_of(lambda: next(events)) == C.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "pagedkv.v1.Allocator"):
        r = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_reflection_lists_the_service(server):
    _, md, channel = stub(server.address, TOKEN)
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=md
    )
    names = {s.name for s in next(answers).list_services_response.service}
    assert {"pagedkv.v1.Allocator", "grpc.health.v1.Health"} <= names
    channel.close()


def test_pool_credentials(api):
    s, md = api
    mine = register(s, md, "cred-a")
    theirs = register(s, md, "cred-b")
    s.Step(
        pb.StepRequest(pool=theirs, step_id=1, ops=encode_ops([Admit("x", [1, 2, 3])])), metadata=md
    )
    before = dump(s, md, theirs)
    ops = encode_ops([Free("x")])
    no_cred = pb.PoolRef(pool_id=theirs.pool_id)
    stolen = pb.PoolRef(pool_id=theirs.pool_id, credential=mine.credential)
    ghost = pb.PoolRef(pool_id="nobody/1", credential=mine.credential)
    assert (
        code_of(s.Step, pb.StepRequest(pool=no_cred, step_id=2, ops=ops), metadata=md)
        == C.UNAUTHENTICATED
    )
    assert (
        code_of(s.Step, pb.StepRequest(pool=stolen, step_id=2, ops=ops), metadata=md)
        == C.PERMISSION_DENIED
    )
    assert (
        code_of(s.Step, pb.StepRequest(pool=ghost, step_id=2, ops=ops), metadata=md) == C.NOT_FOUND
    )
    assert code_of(s.Step, pb.StepRequest(step_id=2, ops=ops), metadata=md) == C.INVALID_ARGUMENT
    for call, req in [
        (s.DeregisterPool, pb.DeregisterPoolRequest(pool=stolen)),
        (s.DumpPool, pb.DumpPoolRequest(pool=stolen)),
        (s.GetBlockTable, pb.GetBlockTableRequest(pool=stolen, seq_id="x")),
        (s.ResetPrefixCache, pb.ResetPrefixCacheRequest(pool=stolen)),
        (s.Heartbeat, pb.HeartbeatRequest(pool=stolen)),
        (s.GetPoolStats, pb.GetPoolStatsRequest(pool=stolen)),
    ]:
        assert code_of(call, req, metadata=md) == C.PERMISSION_DENIED
    assert dump(s, md, theirs) == before


def test_step_ids_are_idempotent(api):
    s, md = api
    ref = register(s, md, "idem")
    first = s.Step(
        pb.StepRequest(pool=ref, step_id=5, ops=encode_ops([Admit("a", [1, 2, 3, 4, 5])])),
        metadata=md,
    )
    grow = pb.StepRequest(pool=ref, step_id=6, ops=encode_ops([Append("a", [6, 7, 8, 9])]))
    answer = s.Step(grow, metadata=md)
    after = dump(s, md, ref)
    assert s.Step(grow, metadata=md) == answer  # the retry: same answer...
    assert dump(s, md, ref) == after  # ...applied once
    other = pb.StepRequest(pool=ref, step_id=6, ops=encode_ops([Append("a", [1])]))
    err = pytest.raises(grpc.RpcError, s.Step, other, metadata=md).value
    assert err.code() == C.FAILED_PRECONDITION
    assert ("pagedkv-error", "step_conflict") in err.trailing_metadata()
    older = pb.StepRequest(pool=ref, step_id=5, ops=encode_ops([Admit("a", [1, 2, 3, 4, 5])]))
    assert code_of(s.Step, older, metadata=md) == C.FAILED_PRECONDITION
    assert code_of(s.Step, pb.StepRequest(pool=ref, step_id=0), metadata=md) == C.INVALID_ARGUMENT
    assert dump(s, md, ref) == after
    assert first.num_stored == [5]


def test_limits(api):
    s, md = api
    ref = register(s, md, "limits")
    too_many = pb.StepOps(
        kinds=[pb.OP_KIND_FREE] * 16385, seq_ids=["x"] * 16385, num_tokens=[0] * 16385
    )
    assert (
        code_of(s.Step, pb.StepRequest(pool=ref, step_id=1, ops=too_many), metadata=md)
        == C.INVALID_ARGUMENT
    )
    huge = pb.StepOps(
        kinds=[pb.OP_KIND_APPEND], seq_ids=["x"], num_tokens=[5_000_000], tokens=[2**31] * 5_000_000
    )
    assert (
        code_of(s.Step, pb.StepRequest(pool=ref, step_id=1, ops=huge), metadata=md)
        == C.RESOURCE_EXHAUSTED
    )
    big = pb.PoolShape(num_blocks=1 << 24, block_size=16)
    assert (
        code_of(s.RegisterPool, pb.RegisterPoolRequest(worker_id="big", shape=big), metadata=md)
        == C.RESOURCE_EXHAUSTED
    )
    bad = pb.PoolShape(num_blocks=0, block_size=16)
    assert (
        code_of(s.RegisterPool, pb.RegisterPoolRequest(worker_id="bad", shape=bad), metadata=md)
        == C.INVALID_ARGUMENT
    )
    for wid in ("", "a/b", "x" * 129, "tab\there"):
        ok_shape = pb.PoolShape(num_blocks=4, block_size=4)
        assert (
            code_of(
                s.RegisterPool, pb.RegisterPoolRequest(worker_id=wid, shape=ok_shape), metadata=md
            )
            == C.INVALID_ARGUMENT
        )
    assert dump(s, md, ref)["seqs"] == {}


def test_register_again_is_a_new_epoch_and_the_old_pool_is_gone(server):
    """Replacing a live pool needs its credential; a client whose pool was
    replaced waits for the worker id to be free, then registers anew."""
    first = client(server, "epoch-worker", register_wait_s=1.0)
    first.step([Admit("a", [1, 2, 3, 4, 5])])
    assert first.epoch == 1
    second = client(server, "epoch-worker", replace_credential=first._ref.credential)
    assert second.epoch == 2 and second.pool_id == "epoch-worker/2"
    assert second.stats().num_sequences == 0
    with pytest.raises(grpc.RpcError) as refused:
        # the id is second's now: first may not take it back
        first.step([Append("a", [6])])
    assert (
        refused.value.code() == C.FAILED_PRECONDITION
        and error_reason(refused.value) == "pool_in_use"
    )
    assert second.stats().num_sequences == 0
    second.close()  # deregisters: the worker id is free
    with pytest.raises(PoolLost):
        first.step([Append("a", [6])])
    assert first.epoch == 3
    first.close()


def test_register_with_a_live_worker_id_needs_its_credential(api):
    """A hijack: RegisterPool naming another live worker's id is refused and
    changes nothing; the worker's own restart path (its credential, or a
    wait for the lease) still works."""
    s, md = api
    victim = register(s, md, "victim")
    s.Step(
        pb.StepRequest(pool=victim, step_id=1, ops=encode_ops([Admit("a", [1, 2, 3])])), metadata=md
    )
    before = dump(s, md, victim)
    shape = pb.PoolShape(num_blocks=8, block_size=4)
    with pytest.raises(grpc.RpcError) as err:
        s.RegisterPool(pb.RegisterPoolRequest(worker_id="victim", shape=shape), metadata=md)
    assert err.value.code() == C.FAILED_PRECONDITION and error_reason(err.value) == "pool_in_use"
    assert "victim/1" in err.value.details() and "replace_credential" in err.value.details()
    other = register(s, md, "thief")
    wrong = pb.RegisterPoolRequest(
        worker_id="victim", shape=shape, replace_credential=other.credential
    )
    assert code_of(s.RegisterPool, wrong, metadata=md) == C.PERMISSION_DENIED
    assert dump(s, md, victim) == before  # the victim's pool is untouched, same id and credential
    mine = pb.RegisterPoolRequest(
        worker_id="victim", shape=shape, replace_credential=victim.credential
    )
    r = s.RegisterPool(mine, metadata=md)
    assert r.pool_id == "victim/2"
    assert code_of(s.Heartbeat, pb.HeartbeatRequest(pool=victim), metadata=md) == C.NOT_FOUND


def test_event_streams_are_kept_for_routers_whatever_other_callers_hold(api):
    """Every event stream other callers may open (here the admin's) taken: one
    more of theirs is refused, and the router still follows the pools."""
    s, _ = api
    admin_md = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    router_md = (("authorization", f"Bearer {ROUTER_TOKEN}"),)
    watch = pb.WatchEventsRequest(snapshot=True)
    held = []
    try:
        for _ in range(Limits().max_watchers):
            held.append(s.WatchEvents(watch, metadata=admin_md, timeout=30))
            next(held[-1])  # open: its first event came
        with pytest.raises(grpc.RpcError) as err:
            next(iter(s.WatchEvents(watch, metadata=admin_md, timeout=5)))
        assert err.value.code() == C.RESOURCE_EXHAUSTED
        assert "callers other than routers" in err.value.details()
        for _ in range(Limits().max_router_watchers):
            held.append(s.WatchEvents(watch, metadata=router_md, timeout=30))
            events = [next(held[-1])]
            while events[-1].kind != pb.KV_EVENT_KIND_SNAPSHOT_END:
                events.append(next(held[-1]))
    finally:
        for stream in held:
            stream.cancel()


def test_roles(api, server):
    """Router calls need the router (or admin) token; the router token calls
    nothing else; the admin reads and resets any pool without its credential."""
    s, md = api
    ref = register(s, md, "roles")
    s.Step(
        pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Admit("a", [1, 2, 3, 4, 5])])),
        metadata=md,
    )
    router_md = (("authorization", f"Bearer {ROUTER_TOKEN}"),)
    admin_md = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    match = pb.MatchPrefixRequest(model_fingerprint="m", tokens=[1, 2, 3, 4, 5])
    assert code_of(s.MatchPrefix, match, metadata=md) == C.PERMISSION_DENIED  # the pools' token
    assert code_of(s.MatchPrefix, match) == C.UNAUTHENTICATED
    assert code_of(s.MatchPrefix, match, metadata=router_md) == C.OK
    assert code_of(s.MatchPrefix, match, metadata=admin_md) == C.OK
    watch = pb.WatchEventsRequest(from_sequence=1)
    for metadata, want in ((md, C.PERMISSION_DENIED), (None, C.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as err:
            next(iter(s.WatchEvents(watch, metadata=metadata, timeout=5)))
        assert err.value.code() == want
    assert next(iter(s.WatchEvents(watch, metadata=router_md, timeout=5))).sequence >= 1
    shape = pb.PoolShape(num_blocks=4, block_size=4)
    assert (
        code_of(
            s.RegisterPool, pb.RegisterPoolRequest(worker_id="r", shape=shape), metadata=router_md
        )
        == C.PERMISSION_DENIED
    )
    assert (
        code_of(s.DumpPool, pb.DumpPoolRequest(pool=ref), metadata=router_md) == C.PERMISSION_DENIED
    )
    no_credential = pb.PoolRef(pool_id=ref.pool_id)
    assert (
        code_of(s.DumpPool, pb.DumpPoolRequest(pool=no_credential), metadata=md)
        == C.UNAUTHENTICATED
    )
    assert json.loads(
        s.DumpPool(pb.DumpPoolRequest(pool=no_credential), metadata=admin_md).state_json
    ) == dump(s, md, ref)
    stats = s.GetPoolStats(
        pb.GetPoolStatsRequest(pool=no_credential, check_integrity=True), metadata=admin_md
    )
    assert stats.num_sequences == 1 and list(stats.integrity_problems) == []
    assert (
        s.ResetPrefixCache(
            pb.ResetPrefixCacheRequest(pool=no_credential), metadata=admin_md
        ).dropped
        == 1
    )
    # The admin's reach ends at reads and resets: a step still needs the pool's credential.
    step = pb.StepRequest(pool=no_credential, step_id=2, ops=encode_ops([Free("a")]))
    assert code_of(s.Step, step, metadata=admin_md) == C.UNAUTHENTICATED
    router = RouterClient(server.address, router_token=ROUTER_TOKEN)
    assert [
        m.pool_id for m in router.match_prefix("m", [1, 2, 3, 4, 5]) if m.pool_id == "roles/1"
    ] == ["roles/1"]
    router.close()


def test_match_prefix_finds_where_a_prefix_lives(server):
    system = list(range(100, 116))  # 4 full blocks of 4
    a, b, other = (
        client(server, "mp-a"),
        client(server, "mp-b"),
        client(server, "mp-c", model_fingerprint="other"),
    )
    try:
        a.step([Admit("r1", system + [1, 2])])
        b.step([Admit("r1", system[:8] + [9, 9, 9])])
        other.step([Admit("r1", system + [1, 2])])
        router = RouterClient(server.address, router_token=ROUTER_TOKEN)
        matches = [m for m in router.match_prefix("m", system + [7]) if m.pool_id.startswith("mp-")]
        assert [(m.pool_id, m.cached_tokens) for m in matches] == [("mp-a/1", 16), ("mp-b/1", 8)]
        assert matches[0].free_blocks == 48 - 5 and matches[0].block_size == 4
        assert all(
            m.cached_tokens == 0
            for m in router.match_prefix("m", system + [7], cache_salt="tenant")
        )
        assert code_of(router.match_prefix, "m", [0] * ((1 << 20) + 1)) == C.INVALID_ARGUMENT
        router.close()
    finally:
        for c in (a, b, other):
            c.close()


def test_watch_events_numbers_and_resync(server):
    router = RouterClient(server.address, router_token=ROUTER_TOKEN)
    c = client(server, "ev-worker", num_blocks=4)
    c.step([Admit("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])])  # 2 full blocks -> 2 stored
    c.step([Free("a")])
    # reuses cached blocks -> removals
    c.step([Admit("b", [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])])
    c.close()
    got: list[pb.KvEvent] = []
    stream = router.watch_events(from_sequence=1, timeout_s=20)  # everything retained
    for e in stream:
        got.append(e)
        if e.kind == pb.KV_EVENT_KIND_POOL_DROPPED and e.pool_id == "ev-worker/1":
            break
    stream.cancel()
    mine = [e for e in got if e.pool_id == "ev-worker/1"]
    kinds = [pb.KvEventKind.Name(e.kind) for e in mine]
    assert kinds[0] == "KV_EVENT_KIND_POOL_REGISTERED" and kinds[-1] == "KV_EVENT_KIND_POOL_DROPPED"
    assert (
        kinds.count("KV_EVENT_KIND_BLOCK_STORED") == 5
        and kinds.count("KV_EVENT_KIND_BLOCK_REMOVED") == 2
    )
    seqs = [e.sequence for e in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gapless
    assert all(len(e.block_hash) == 32 for e in mine if "BLOCK" in pb.KvEventKind.Name(e.kind))

    # Reconnecting with the next number gets exactly what followed; a number
    # from beyond this server's history is told to resync.
    replay = router.watch_events(from_sequence=seqs[1], timeout_s=3)
    again = [next(replay) for _ in range(len(seqs) - 1)]
    replay.cancel()
    assert [e.sequence for e in again] == seqs[1:]
    future = router.watch_events(from_sequence=seqs[-1] + 10_000, timeout_s=3)
    assert next(future).kind == pb.KV_EVENT_KIND_RESYNC_REQUIRED
    future.cancel()
    router.close()


def test_metrics_endpoint(server, api):
    s, md = api
    ref = register(s, md, "metrics-w")
    s.Step(
        pb.StepRequest(
            pool=ref, step_id=1, ops=encode_ops([Admit("a", [1] * 9), Append("zz", [1])])
        ),
        metadata=md,
    )
    with pytest.raises(grpc.RpcError):  # without its credential: refused, and counted
        s.Step(pb.StepRequest(pool=ref, step_id=2, ops=encode_ops([Append("a", [1])])))
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    labels = 'pool_id="metrics-w/1",worker_id="metrics-w"'
    for line in (
        f"pagedkv_allocator_pool_capacity_blocks{{{labels}}} 64.0",
        f"pagedkv_allocator_pool_used_blocks{{{labels}}} 3.0",
        f"pagedkv_allocator_prefix_queried_tokens_total{{{labels}}} 9.0",
        f"pagedkv_allocator_out_of_blocks_total{{{labels}}} 0.0",
        f"pagedkv_allocator_pool_slot_utilisation_ratio{{{labels}}} 0.75",
    ):
        assert line in text
    for name in (
        "pool_cached_blocks",
        "pool_free_blocks",
        "evicted_blocks_total",
        "cow_copied_blocks_total",
        "prefix_hit_tokens_total",
        "pools",
        "event_sequence",
        "snapshot_failures_total",
        "state_store_serving",
    ):
        assert f"pagedkv_allocator_{name}" in text
    assert 'pagedkv_allocator_rpc_duration_seconds_count{code="OK",method="Step"}' in text
    assert 'code="PERMISSION_DENIED"' in text or 'code="UNAUTHENTICATED"' in text


def test_env_settings_and_sigterm_shutdown(allocator_server):
    with allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "7.5"}) as s:
        c = GrpcAllocator(s.address, PoolSpec("bye", PoolConfig(8, 4)))
        assert c.lease_ttl_s == 7.5
        c.step([Admit("a", [1, 2])])
        watcher = RouterClient(s.address).watch_events(from_sequence=1)
        next(watcher)  # an open event stream must not hold the shutdown for the grace period
        t0 = time.monotonic()
        assert s.terminate() == 0
        assert time.monotonic() - t0 < 4
        assert list(watcher) == []  # a clean end, no error
        assert "shutting down" in "\n".join(s.lines)
        c.close()


def test_tls(tmp_path, allocator_server):
    if subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("needs openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    with allocator_server("--tls-cert", str(cert), "--tls-key", str(key)) as s:
        c = GrpcAllocator(
            f"localhost:{s.port}", PoolSpec("tls", PoolConfig(8, 4)), tls_ca=str(cert)
        )
        assert c.step([Admit("a", [1, 2, 3])])[0].append == [0]
        c.close()
        s2, _, ch = stub(f"localhost:{s.port}")
        assert (
            code_of(s2.RegisterPool, pb.RegisterPoolRequest(worker_id="x"), timeout=3)
            == C.UNAVAILABLE
        )
        ch.close()


def test_bad_flags_fail_fast(tmp_path):
    run = [sys.executable, "-m", "allocator_service", "--listen", "127.0.0.1:0"]
    for extra in (
        ["--state", "mysql://x"],
        ["--tls-cert", "x.pem"],
        ["--auth-token-file", str(tmp_path / "none")],
    ):
        r = subprocess.run([*run, *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (extra, r.stderr)
        assert "Traceback" not in r.stderr
    # a setting that is a variable only: a bad value is named by its variable
    for name, value in (("LEASE_TTL", "0"), ("MAX_SNAPSHOT_MB", "600"), ("SNAPSHOT_EVERY", "x")):
        r = subprocess.run(
            run,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, f"PAGEDKV_ALLOCATOR_{name}": value},
        )
        assert r.returncode == 2 and f"PAGEDKV_ALLOCATOR_{name}" in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
    r = subprocess.run(
        [*run, "--state", "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "cannot start" in r.stderr and "Traceback" not in r.stderr


def test_dump_is_json_of_to_state(api):
    s, md = api
    ref = register(s, md, "dumpy", num_blocks=8)
    s.Step(
        pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Admit("a", [1, 2, 3, 4, 5])])),
        metadata=md,
    )
    r = s.DumpPool(pb.DumpPoolRequest(pool=ref), metadata=md)
    state = json.loads(r.state_json)
    assert state["seqs"]["a"]["table"] == [0, 1] and r.last_step_id == 1
    stats = s.GetPoolStats(pb.GetPoolStatsRequest(pool=ref, check_integrity=True), metadata=md)
    assert (
        stats.integrity_checked and list(stats.integrity_problems) == [] and stats.used_blocks == 2
    )
