"""Isolation drill on real processes: an allocator serving TLS with a bearer
token and its journal in Redis, a worker that reaches it with the token and
the CA certificate.

- TLS works when configured: the worker registers and serves through it; a
  plaintext client, or one that trusts another CA, gets nowhere.
- Calls without the token (or with a wrong one) are refused
  (UNAUTHENTICATED); health checks are exempt.
- Another pool's credential is refused (PERMISSION_DENIED) on every call
  that names the worker's pool, and changes nothing.
- Requests with different `cache_salt` never share a block: checked on the
  HTTP side (cached_tokens) and on the allocator's side by replaying its
  whole journal, record by record, and looking at every block table.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from allocator_service.core import Free
from allocator_service.store.events import EventLog
from allocator_service.store.registry import Registry
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc
from tests.support.drills import MODEL, Stack, complete, journal_state, report, self_signed_cert
from tests.support.drills import reference_texts as offline

C = grpc.StatusCode
TOKEN = "drill-token-7f3a"
WORKER_ARGS = [
    "--num-blocks",
    "32",
    "--block-size",
    "4",
    "--enable-prefix-caching",
    "--max-model-len",
    "64",
]
# No snapshot during the drill: the journal keeps the whole history to replay.
ALLOCATOR_ENV = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "1000000", "PAGEDKV_ALLOCATOR_LEASE_TTL": "30"}
PROMPT = "a shared system prompt, then a question"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    other = tmp_path_factory.mktemp("other-ca")
    return self_signed_cert(d), self_signed_cert(other)


@pytest.fixture(scope="module")
def stack(certs):
    with Stack(
        1, worker_args=WORKER_ARGS, env=ALLOCATOR_ENV, redis=True, token=TOKEN, tls=certs[0]
    ) as s:
        yield s


def tls_channel(stack: Stack, ca) -> grpc.Channel:
    return grpc.secure_channel(
        stack.allocator_address, grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    )


def code(fn, request, metadata=None) -> grpc.StatusCode:
    try:
        fn(request, timeout=10, metadata=metadata)
    except grpc.RpcError as err:
        return err.code()
    return C.OK


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def test_tls_and_the_bearer_token(stack, certs):
    (cert, _), (other_cert, _) = certs
    # The worker registered over TLS with the token, and serves.
    ref = offline([PROMPT], MAX_TOKENS)[0]
    assert complete(stack.workers[0].url, PROMPT, MAX_TOKENS).text == ref
    shape = pb.PoolShape(num_blocks=4, block_size=4)
    register = pb.RegisterPoolRequest(worker_id="probe", shape=shape)
    with grpc.insecure_channel(stack.allocator_address) as plain:
        assert (
            code(pb_grpc.AllocatorStub(plain).RegisterPool, register, bearer(TOKEN))
            == C.UNAVAILABLE
        )
    with tls_channel(stack, other_cert) as wrong_ca:
        assert (
            code(pb_grpc.AllocatorStub(wrong_ca).RegisterPool, register, bearer(TOKEN))
            == C.UNAVAILABLE
        )
    with tls_channel(stack, cert) as ch:
        s = pb_grpc.AllocatorStub(ch)
        refused = {
            "RegisterPool": code(s.RegisterPool, register),
            "Step": code(s.Step, pb.StepRequest(pool=pb.PoolRef(pool_id="worker-1/1"), step_id=1)),
            "MatchPrefix": code(
                s.MatchPrefix, pb.MatchPrefixRequest(model_fingerprint="m", tokens=[1])
            ),
            "wrong token": code(s.RegisterPool, register, bearer("not-" + TOKEN)),
            "WatchEvents": code(
                lambda r, **kw: next(s.WatchEvents(r, **kw)), pb.WatchEventsRequest(from_sequence=1)
            ),
        }
        assert set(refused.values()) == {C.UNAUTHENTICATED}, refused
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


def test_another_pools_credential_is_refused(stack, certs):
    cert = certs[0][0]
    _, records_before = journal_state(stack.redis.url)
    with tls_channel(stack, cert) as ch:
        s = pb_grpc.AllocatorStub(ch)
        md = bearer(TOKEN)
        mine = s.RegisterPool(
            pb.RegisterPoolRequest(
                worker_id="intruder", shape=pb.PoolShape(num_blocks=4, block_size=4)
            ),
            metadata=md,
            timeout=10,
        )
        stolen = pb.PoolRef(pool_id="worker-1/1", credential=mine.credential)
        calls = {
            "Step": (
                s.Step,
                pb.StepRequest(pool=stolen, step_id=10**9, ops=encode_ops([Free("x")])),
            ),
            "GetBlockTable": (s.GetBlockTable, pb.GetBlockTableRequest(pool=stolen, seq_id="x")),
            "GetPoolStats": (
                s.GetPoolStats,
                pb.GetPoolStatsRequest(pool=stolen, check_integrity=True),
            ),
            "DumpPool": (s.DumpPool, pb.DumpPoolRequest(pool=stolen)),
            "ResetPrefixCache": (s.ResetPrefixCache, pb.ResetPrefixCacheRequest(pool=stolen)),
            "Heartbeat": (s.Heartbeat, pb.HeartbeatRequest(pool=stolen)),
            "DeregisterPool": (s.DeregisterPool, pb.DeregisterPoolRequest(pool=stolen)),
        }
        codes = {name: code(fn, req, md) for name, (fn, req) in calls.items()}
        assert set(codes.values()) == {C.PERMISSION_DENIED}, codes
        s.DeregisterPool(
            pb.DeregisterPoolRequest(
                pool=pb.PoolRef(pool_id=mine.pool_id, credential=mine.credential)
            ),
            metadata=md,
            timeout=10,
        )
    _, records_after = journal_state(stack.redis.url)
    # Only the intruder's own registration and deregistration were journaled.
    added = [r.WhichOneof("change") for r in records_after[len(records_before) :]]
    assert (
        added == ["registered", "dropped"]
        and records_after[: len(records_before)] == records_before
    )
    ref = offline([PROMPT], MAX_TOKENS)[0]
    # the worker's pool is untouched
    assert complete(stack.workers[0].url, PROMPT, MAX_TOKENS).text == ref


def test_different_cache_salts_never_share_a_block(stack):
    url = stack.workers[0].url
    # One after another: a salt only ever finds its own prefix.
    first = {
        salt: complete(url, PROMPT, MAX_TOKENS, salt=salt)
        for salt in ("tenant-a", "tenant-b", None)
    }
    again = {
        salt: complete(url, PROMPT, MAX_TOKENS, salt=salt) for salt in ("tenant-a", "tenant-b")
    }
    # (the unsalted request ran in the earlier tests: its prefix was cached)
    assert first["tenant-a"].cached_tokens == 0 and first["tenant-b"].cached_tokens == 0
    assert again["tenant-a"].cached_tokens > 0 and again["tenant-b"].cached_tokens > 0
    texts = {r.text for r in [*first.values(), *again.values()]}
    assert len(texts) == 1  # the salt changes the cache, never the answer

    # All at once, streaming, several of each salt.
    salts = ["tenant-a", "tenant-b", "tenant-c", None] * 3
    results: list = [None] * len(salts)

    def one(i: int) -> None:
        results[i] = complete(url, PROMPT, MAX_TOKENS, salt=salts[i], stream=bool(i % 2))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(salts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.status for r in results] == [200] * len(salts)
    assert {r.text for r in results} == texts
    # Within one salt, sharing is certain whatever the timing above: n=2
    # forks the prompt's blocks (the concurrent requests share only when
    # they happen to overlap).
    for salt in ("tenant-a", "tenant-b"):
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "n": 2,
                "cache_salt": salt,
            },
        )
        assert r.status_code == 200 and {c["text"] for c in r.json()["choices"]} == texts
    stack.wait_idle()

    # The allocator's side: replay the whole journal; after every record no
    # block is in the tables of two salts, and a cached block (block id and
    # hash) only ever serves the salt that filled it.
    _, records = journal_state(stack.redis.url)
    assert records and records[0].index == 1, "the journal must hold the whole history"
    registry = Registry(EventLog(1 << 16))
    owner: dict[tuple[int, str], str | None] = {}
    shared_within_a_salt = 0
    for rec in records:
        registry.apply(rec)
        entry = registry.pools.get("worker-1/1")
        if entry is None or rec.WhichOneof("change") != "step":
            continue
        state = entry.pool.to_state()
        holders: dict[int, list] = defaultdict(list)
        for seq in state["seqs"].values():
            for b in seq["table"]:
                holders[b].append(seq["salt"])
                h = state["hash"][b]
                if h is not None:
                    assert owner.setdefault((b, h), seq["salt"]) == seq["salt"], (rec.index, b)
        assert all(len(set(s)) == 1 for s in holders.values()), rec.index
        shared_within_a_salt += sum(len(s) > 1 for s in holders.values())
    assert shared_within_a_salt > 0  # sharing did happen, within each salt
    report(
        "isolation",
        {
            "journal_records_replayed": len(records),
            "cached_blocks_checked": len(owner),
            "shared_block_observations_within_a_salt": shared_within_a_salt,
            "cached_tokens_second_time": {k: v.cached_tokens for k, v in again.items()},
        },
    )


def test_a_live_workers_id_cannot_be_taken_and_router_calls_need_a_router_token(stack, certs):
    """Hijacks on the real stack: RegisterPool naming the live worker's id
    (no credential, or another pool's) is refused and journals nothing; with
    the pools' token alone (no router token configured) MatchPrefix and
    WatchEvents are refused, so no tenant can probe another's prompts."""
    cert = certs[0][0]
    _, records_before = journal_state(stack.redis.url)
    shape = pb.PoolShape(num_blocks=4, block_size=4)
    with tls_channel(stack, cert) as ch:
        s = pb_grpc.AllocatorStub(ch)
        md = bearer(TOKEN)
        codes = {
            "no credential": code(
                s.RegisterPool, pb.RegisterPoolRequest(worker_id="worker-1", shape=shape), md
            ),
            "a made-up credential": code(
                s.RegisterPool,
                pb.RegisterPoolRequest(worker_id="worker-1", shape=shape, replace_credential="x"),
                md,
            ),
            "MatchPrefix": code(
                s.MatchPrefix, pb.MatchPrefixRequest(model_fingerprint="m", tokens=[1, 2]), md
            ),
            "WatchEvents": code(
                lambda r, **kw: next(s.WatchEvents(r, **kw)),
                pb.WatchEventsRequest(from_sequence=1),
                md,
            ),
        }
    assert codes == {
        "no credential": C.FAILED_PRECONDITION,
        "a made-up credential": C.PERMISSION_DENIED,
        "MatchPrefix": C.PERMISSION_DENIED,
        "WatchEvents": C.PERMISSION_DENIED,
    }, codes
    _, records_after = journal_state(stack.redis.url)
    assert records_after == records_before  # nothing journaled, nothing dropped
    ref = offline([PROMPT], MAX_TOKENS)[0]
    # still worker-1/1, unharmed
    assert complete(stack.workers[0].url, PROMPT, MAX_TOKENS).text == ref
    report("hijacks_refused", {k: v.name for k, v in codes.items()})
