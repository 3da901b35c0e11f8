"""Pools sharded over several allocator processes (`pagedkv up --allocators
N`, `LocalStack(allocators=N)`, `pagedkv router --allocator A,B`): each
worker registers with one allocator, the router follows them all and asks
each about its own pools, so placement by prefix works across allocators as
within one. Real processes: two allocators, two tiny-random workers (one
on each), the router, driven by the official openai client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allocator_service.client.router_client import RouterClient
from allocator_service.wire.v1 import allocator_pb2 as pb
from pagedkv.stack import LocalStack, StackError
from router.app import Router
from router.discovery import Discovery, MergedDiscovery, Worker
from tests.support.http import metric, openai_client

MODEL = "tiny-random"
BLOCK = 16
PREFIXES = [
    f"Shard {i} system prompt: " + f"you answer for tenant {i}, politely. " * 8 for i in range(2)
]


@pytest.fixture(scope="module")
def stack():
    args = ["--num-blocks", "256", "--block-size", str(BLOCK), "--max-num-seqs", "8"]
    with LocalStack(
        workers=2, allocators=2, model=MODEL, worker_args=args, router=True, startup_timeout=180
    ) as s:
        yield s


def test_each_worker_registers_with_its_own_allocator(stack):
    assert (
        len(stack.allocator_addresses) == 2
        and stack.allocator_address == stack.allocator_addresses[0]
    )
    for address, worker in zip(stack.allocator_addresses, ("worker-1", "worker-2"), strict=True):
        client = RouterClient(address, router_token=stack.router_token)
        try:
            assert [p.worker_id for p in client.list_pools()] == [worker]
        finally:
            client.close()
    health = httpx.get(f"{stack.router_url}/health").json()
    assert health == {
        "status": "ok",
        "workers": 2,
        "allocator": "ok",
        "policy": "kv",
        "allocators": 2,
        "allocators_unreachable": 0,
    }
    assert metric(stack.router_url, "pagedkv_router_allocators") == 2
    assert metric(stack.router_url, "pagedkv_router_allocators_unreachable") == 0


def test_requests_land_on_the_worker_holding_their_prefix_whichever_allocator_holds_its_pool(stack):
    # Each prefix goes straight to one worker, so only
    # that worker's pool (on its own allocator) holds it.
    for url, prefix in zip(stack.worker_urls, PREFIXES, strict=True):
        openai_client(url).completions.create(
            model=MODEL, prompt=prefix + "warm up", max_tokens=1, temperature=0
        )
    for owner, prefix in zip(("worker-1", "worker-2"), PREFIXES, strict=True):
        for question in ("What now?", "And then?"):
            raw = openai_client(stack.router_url).completions.with_raw_response.create(
                model=MODEL, prompt=prefix + question, max_tokens=4, temperature=0
            )
            assert raw.headers["x-pagedkv-worker"] == owner
            assert int(raw.headers["x-pagedkv-cached-tokens"]) >= (len(prefix) // BLOCK - 1) * BLOCK
    # the chosen worker always held the most any worker held: both allocators were asked
    best = metric(
        stack.router_url, "pagedkv_router_prefix_best_cached_tokens_total", {"policy": "kv"}
    )
    chosen = metric(stack.router_url, "pagedkv_router_prefix_cached_tokens_total", {"policy": "kv"})
    assert chosen == best > 0


def test_while_an_allocator_is_away_its_workers_are_ranked_after_the_others(stack):
    """worker-2 cannot compute while its allocator is away: a prompt whose
    prefix it holds goes to worker-1 meanwhile, and is answered."""
    prefix = PREFIXES[1]  # held by worker-2 (the test above)
    stack.allocators[1].kill()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(f"{stack.router_url}/health").json()["allocators_unreachable"] != 1:
            assert time.monotonic() < deadline, "the router never noticed the allocator was gone"
            time.sleep(0.1)
        assert httpx.get(f"{stack.router_url}/health").json()["allocator"] == "unreachable"
        assert metric(stack.router_url, "pagedkv_router_allocators_unreachable") == 1
        # MatchPrefix cannot ask allocator-2 now, so both workers look cold and
        # equally loaded: without the rule, ties would alternate onto worker-2
        # (and its request would wait for its allocator, past this timeout)
        client = openai_client(stack.router_url, timeout=30)
        for i in range(3):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prefix + f"While it is away, {i}?", max_tokens=4, temperature=0
            )
            assert raw.headers["x-pagedkv-worker"] == "worker-1" and raw.parse().choices[0].text
    finally:
        stack.allocators[1].start().wait_healthy(60)  # the same port: the stack stops as usual


def test_more_allocators_than_workers_is_refused():
    with pytest.raises(StackError, match="--allocators"):
        LocalStack(workers=1, allocators=2, model=MODEL)
    with pytest.raises(StackError, match="its own --state"):
        # each shard's state and ports are the stack's
        LocalStack(workers=2, allocators=2, model=MODEL, allocator_args=["--state=redis://h:1/0"])


def test_fixed_ports_that_overlap_are_refused_before_anything_starts():
    from pagedkv.stack.probes import free_port

    port = free_port("127.0.0.1")
    # allocator i listens on port + i and serves metrics on metrics_port + i: here both on `port`
    stack = LocalStack(
        workers=2, allocators=2, model=MODEL, allocator_port=port, allocator_metrics_port=port
    )
    with pytest.raises(
        StackError,
        match=f"port {port} for the allocator's metrics is also the port of the allocator",
    ):
        stack.start()
    assert stack.processes == {}


@pytest.mark.parametrize(
    "state, second",
    [
        ("memory", "memory"),
        ("redis://h:6379/0", "pagedkv:allocator:shard-2:"),
        (
            "redis://h:6379/0?key_prefix=teamA:",
            "teamA:shard-2:",
        ),  # two stacks on one Redis stay apart
    ],
)
def test_each_allocator_keeps_its_journal_under_its_own_key_prefix(state, second):
    from allocator_service.store.journal import split_prefix
    from pagedkv.stack.local import _shard_state

    assert _shard_state(state, 0) == state
    if state == "memory":
        assert _shard_state(state, 1) == "memory"
        return
    url, prefix = split_prefix(_shard_state(state, 1))
    assert url == "redis://h:6379/0" and prefix == second
    assert split_prefix(_shard_state(state, 2))[1] == second.replace("shard-2", "shard-3")


def test_an_allocator_named_twice_is_refused():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "router",
            "--allocator",
            "127.0.0.1:1,127.0.0.1:1",
            "--model",
            MODEL,
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "named twice" in proc.stderr


class _Part:
    """A Discovery's view, as MergedDiscovery reads it."""

    def __init__(self, workers: dict[str, Worker], ok: bool = True) -> None:
        self.workers, self.allocator_ok = workers, ok


_workers = st.lists(
    st.tuples(
        st.sampled_from(["http://a", "http://b", "http://c"]), st.booleans(), st.integers(0, 8)
    ),
    max_size=3,
)


@given(st.lists(st.tuples(_workers, st.booleans()), min_size=1, max_size=3))
def test_merged_view_keeps_every_url_prefers_answering_allocator_then_pool_then_free_blocks(
    parts,
):
    views = []
    for index, (entries, ok) in enumerate(parts):
        view = {
            url: Worker(
                url, pool_id=f"p{index}" if pooled else "", free_blocks=free, allocator=index
            )
            for url, pooled, free in entries
        }
        views.append((view, ok))
    merged = MergedDiscovery([_Part(v, ok) for v, ok in views])  # type: ignore[list-item]
    got = merged.workers
    assert set(got) == {url for v, _ in views for url in v}
    for url, w in got.items():
        rivals = [(ok, bool(v[url].pool_id), v[url].free_blocks) for v, ok in views if url in v]
        assert w in [v[url] for v, _ in views if url in v]
        assert (parts[w.allocator][1], bool(w.pool_id), w.free_blocks) == max(rivals)


def test_merged_view_follows_a_part_that_lists_again():
    one, two = (
        _Part({"http://a": Worker("http://a", pool_id="p", allocator=0)}),
        _Part({}, ok=False),
    )
    merged = MergedDiscovery([one, two])  # type: ignore[list-item]
    assert list(merged.workers) == ["http://a"]
    assert not merged.allocator_ok and merged.allocators_unreachable == 1
    # a new listing: a new dict
    two.workers = {"http://b": Worker("http://b", pool_id="q", allocator=1)}
    two.allocator_ok = True
    assert (
        sorted(merged.workers) == ["http://a", "http://b"]
        and merged.workers["http://b"].allocator == 1
    )
    assert merged.allocator_ok


class _Unanswered(Exception):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED


class _FakeAllocator:
    """A RouterClient's MatchPrefix: answers, or times out."""

    def __init__(self, pool_id: str, cached: int, times_out: bool = False) -> None:
        self.pool_id, self.cached, self.times_out, self.calls = pool_id, cached, times_out, 0

    async def match_prefix_async(self, fingerprint, tokens, salt):
        self.calls += 1
        if self.times_out:
            raise _Unanswered()
        return [pb.PrefixMatch(pool_id=self.pool_id, cached_tokens=self.cached, free_blocks=9)]


def test_an_allocator_that_does_not_answer_matchprefix_is_not_asked_again_until_it_lists():
    """One request pays the unanswered allocator's deadline, not every one."""
    clients = [_FakeAllocator("p0", 32), _FakeAllocator("p1", 48, times_out=True)]
    parts = [Discovery(c, index=i) for i, c in enumerate(clients)]
    for p in parts:
        p.allocator_ok = True  # as after a listing
    router = Router(None, MergedDiscovery(parts), "kv", allocators=clients)
    workers = [
        Worker(f"http://w{i}", pool_id=f"p{i}", model_fingerprint="m", block_size=4, allocator=i)
        for i in range(2)
    ]
    tokens = list(range(20))
    first = asyncio.run(router.matching.cached_tokens(workers, tokens, None))
    assert first == {(0, "p0"): (32, 9, 0, 0)}  # the other's pools route by load
    assert not router.discovery.allocator_answers(1) and router.discovery.allocator_answers(0)
    again = asyncio.run(router.matching.cached_tokens(workers, tokens, None))
    assert again == first and [c.calls for c in clients] == [2, 1]  # not asked the second time
    parts[1].allocator_ok = True  # its next listing succeeded
    clients[1].times_out = False
    assert asyncio.run(router.matching.cached_tokens(workers, tokens, None)) == {
        (0, "p0"): (32, 9, 0, 0),
        (1, "p1"): (48, 9, 0, 0),
    }
