"""The router's front door trusts no worker's word: a pool is sent users'
requests (and the router's key) only when its worker has proven, at the
address the pool advertises, that it serves that pool; and a worker token
registers only its own worker, at its own address.

Real processes: an allocator, a tiny-random worker and the router
(LocalStack, with the credentials it generates, or one shared worker
token), an attacker's HTTP server on loopback, and the attacker's pools
registered over gRPC. Each attack is one the red team ran: its own server
listed under the real model's name, the real worker's address re-listed
under another model's name (the real model answered 404), a squatted fixed
worker id."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from allocator_service.wire.v1 import allocator_pb2 as pb
from pagedkv.bench.attackers import Attacker, rogue_pool
from pagedkv.stack import LocalStack
from tests.support.allocator import code_of, stub
from tests.support.http import metric, openai_client

MODEL = "tiny-random"
ARGS = ["--num-blocks", "64", "--block-size", "16", "--max-num-seqs", "4"]
C = grpc.StatusCode


def _wait_unproven(router_url: str, n: int) -> None:
    """Until the router has listed (and failed to prove) `n` pools."""
    deadline = time.monotonic() + 30
    while (metric(router_url, "pagedkv_router_unproven_pools") or 0) < n:
        assert time.monotonic() < deadline, "the router never listed the attacker's pools"
        time.sleep(0.1)


def _all_answered_by_the_worker(stack: LocalStack, attacker: Attacker, n: int = 20) -> None:
    client = openai_client(stack.router_url, api_key="the-users-own-key")
    want = (
        openai_client(stack.worker_urls[0])
        .completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
        .choices[0]
        .text
    )
    for i in range(n):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, user=f"u{i}"
        )
        assert raw.headers["x-pagedkv-worker"] == "worker-1"
        assert raw.parse().choices[0].text == want
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert attacker.posts == 0
    # no user's (or the router's) credentials
    assert not any(auth for _, _, auth in attacker.requests)


@pytest.fixture(scope="module")
def generated():
    """A stack with the credentials `LocalStack` (and `pagedkv up`) generate."""
    with LocalStack(
        workers=1, model=MODEL, worker_args=ARGS, router=True, startup_timeout=180
    ) as s:
        yield s


@pytest.fixture(scope="module")
def shared():
    """A stack whose workers share one token (the simple setup)."""
    with LocalStack(
        workers=1,
        model=MODEL,
        worker_args=ARGS,
        router=True,
        startup_timeout=180,
        token="shared-pools-token",
    ) as s:
        yield s


def test_with_generated_credentials_nobody_else_registers_a_pool(generated):
    s, _, channel = stub(generated.allocator_address)
    worker_token = (generated.log_dir / "worker-1.token").read_text().strip()
    with Attacker(MODEL) as attacker:
        for worker_id, token in (("evil", None), ("worker-1", None), ("evil", "guess")):
            with pytest.raises(grpc.RpcError) as refused:
                rogue_pool(generated.allocator_address, worker_id, attacker.url, MODEL, token)
            assert refused.value.code() == C.UNAUTHENTICATED
        # worker-1's own token registers worker-1 at worker-1's address, nothing else
        for worker_id, url in (
            ("evil", attacker.url),
            ("worker-1", attacker.url),
            ("evil", generated.worker_urls[0]),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                rogue_pool(generated.allocator_address, worker_id, url, MODEL, worker_token)
            assert refused.value.code() == C.PERMISSION_DENIED
            assert "registers worker 'worker-1'" in refused.value.details()
        _all_answered_by_the_worker(generated, attacker)
    # the router's token is its own
    assert code_of(s.ListPools, pb.ListPoolsRequest()) == C.UNAUTHENTICATED
    channel.close()


def test_a_shared_token_holder_cannot_steer_requests_off_the_real_worker(shared):
    """The pools it registers advertise the real worker's address (under the
    real model's name and under another's) and its own server, which relays
    the real worker's identity answer: none of them is proven, so none is
    sent anything, and the real model stays served."""
    token = "shared-pools-token"
    real = shared.worker_urls[0]
    with Attacker(MODEL, relay=real) as attacker:
        pools = [
            rogue_pool(shared.allocator_address, "evil-1", real, "other-model", token),
            rogue_pool(shared.allocator_address, "evil-2", real, MODEL, token),
            rogue_pool(shared.allocator_address, "evil-3", attacker.url, MODEL, token),
        ]
        try:
            _wait_unproven(shared.router_url, 3)
            assert httpx.get(f"{shared.router_url}/health").json()["workers"] == 1
            _all_answered_by_the_worker(shared, attacker)
            # it was asked
            assert any(path.startswith("/pagedkv/identity") for _, path, _ in attacker.requests)
        finally:
            for p in pools:
                p.close()


def test_a_forged_identity_answer_is_not_accepted(shared):
    with Attacker(MODEL) as attacker:
        pool = rogue_pool(
            shared.allocator_address, "evil-forger", attacker.url, MODEL, "shared-pools-token"
        )
        attacker.pool_id = pool.pool_id
        try:
            _wait_unproven(shared.router_url, 1)
            _all_answered_by_the_worker(shared, attacker, n=5)
        finally:
            pool.close()


def test_the_identity_route_proves_only_its_own_pool(shared):
    real = shared.worker_urls[0]
    assert httpx.get(f"{real}/pagedkv/identity", params={"nonce": "xyz"}).status_code == 400
    answer = httpx.get(f"{real}/pagedkv/identity", params={"nonce": "ab" * 16}).json()
    assert answer["worker_id"] == "worker-1" and answer["pool_id"].startswith("worker-1/")
    again = httpx.get(f"{real}/pagedkv/identity", params={"nonce": "cd" * 16}).json()
    assert again["pool_id"] == answer["pool_id"] and again["proof"] != answer["proof"]
