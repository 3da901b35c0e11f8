"""The live `/pools` page against a real allocator with a worker serving
requests, in headless Chromium (tests/web/cdp.py); and who may see it."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Free, PoolConfig
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import stub
from tests.web import cdp

TOKEN, ADMIN, ROUTER = "pools-s3cret", "admin-s3cret", "router-s3cret"
OUT = Path(__file__).parents[2] / "out"
WORKER = "page-worker"

needs_chromium = pytest.mark.skipif(
    not cdp.available(), reason="needs Debian's chromium (/usr/bin/chromium); .ci/run installs it"
)


@pytest.fixture(scope="module")
def allocator(tmp_path_factory, allocator_server):
    d = tmp_path_factory.mktemp("tokens")
    for name, value in (("token", TOKEN), ("admin", ADMIN), ("router", ROUTER)):
        (d / name).write_text(value + "\n")
    with allocator_server(
        "--auth-token-file",
        str(d / "token"),
        "--metrics-port",
        "0",
        env={
            "PAGEDKV_ALLOCATOR_LEASE_TTL": "60",
            "PAGEDKV_ALLOCATOR_ADMIN_TOKEN_FILE": str(d / "admin"),
            "PAGEDKV_ALLOCATOR_ROUTER_TOKEN_FILE": str(d / "router"),
        },
    ) as s:
        s.base = s.metrics_url.rsplit("/", 1)[0]
        s.token_file = d / "token"
        yield s


@pytest.fixture(scope="module")
def worker(allocator, worker_process):
    with worker_process(
        "--model",
        "tiny-random",
        "--worker-id",
        WORKER,
        "--num-blocks",
        "96",
        "--block-size",
        "4",
        "--enable-prefix-caching",
        "--allocator",
        allocator.address,
        "--allocator-token-file",
        str(allocator.token_file),
    ) as url:
        yield url


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.readline() if "stream" in url else r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_page_and_stream_need_the_admin_or_router_token(allocator):
    for path in ("/pools", "/pools/stream", "/pools/api/table?pool=x&seq=y"):
        assert get(allocator.base + path)[0] == 401, path
        assert get(allocator.base + path, "wrong")[0] == 401, path
        assert get(allocator.base + path, TOKEN)[0] == 403, path  # the pools' token is not enough
        assert (
            get(allocator.base + path + ("&" if "?" in path else "?") + "token=wrong")[0] == 401
        ), path
    assert get(allocator.base + "/pools", ROUTER)[0] == 200
    assert get(allocator.base + "/pools", ADMIN)[0] == 200
    # how the page's EventSource sends it
    assert get(f"{allocator.base}/pools?token={ROUTER}")[0] == 200
    assert get(allocator.base + "/pools/stream", ADMIN)[0] == 200
    # /metrics stays open, as it was
    status, body = get(allocator.metrics_url)
    assert status == 200 and b"pagedkv_allocator_pools" in body


def test_metrics_bytes_are_prometheus_clients_own():
    """The new HTTP server answers /metrics with exactly the bytes
    prometheus_client's own server gives for the same registry."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    from allocator_service.web.app import start_web_server, stop_web_server

    registry = CollectorRegistry()
    Counter("pagedkv_test_things", "Things.", ["kind"], registry=registry).labels("a").inc(3)
    ours = start_web_server(0, "127.0.0.1", registry=registry, service=object())
    theirs, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        for path in ("/metrics", "/metrics?name[]=pagedkv_test_things_total"):
            for accept in ("", "application/openmetrics-text; version=1.0.0", "gzip"):
                headers = (
                    {"Accept-Encoding": "gzip"}
                    if accept == "gzip"
                    else ({"Accept": accept} if accept else {})
                )
                a = urllib.request.urlopen(
                    urllib.request.Request(
                        f"http://127.0.0.1:{ours.server_port}{path}", headers=headers
                    ),
                    timeout=5,
                )
                b = urllib.request.urlopen(
                    urllib.request.Request(
                        f"http://127.0.0.1:{theirs.server_port}{path}", headers=headers
                    ),
                    timeout=5,
                )
                assert a.read() == b.read(), (path, accept)
                assert a.headers["Content-Type"] == b.headers["Content-Type"]
    finally:
        stop_web_server(ours)
        theirs.shutdown()


def pool_stats(allocator, pool_id: str) -> pb.GetPoolStatsResponse:
    s, md, channel = stub(allocator.address, ADMIN)
    try:
        return s.GetPoolStats(pb.GetPoolStatsRequest(pool=pb.PoolRef(pool_id=pool_id)), metadata=md)
    finally:
        channel.close()


def dom_counts(browser, pool_id: str) -> dict:
    """What the page shows of a pool: its counts and its cells, by state."""
    return browser.eval(f"""(() => {{
        const el = document.querySelector('section.pool[data-pool="{pool_id}"]');
        if (!el) return null;
        const cells = (s) => el.querySelectorAll('.grid .b.' + s).length;
        return {{used: +el.dataset.used, cached: +el.dataset.cached, free: +el.dataset.free,
                 blocks: +el.dataset.blocks, sequences: +el.dataset.sequences,
                 cells: {{used: cells('used'), cached: cells('cached'), free: cells('free')}},
                 shown: [...el.querySelectorAll('[data-count]')]
                        .map(b => b.dataset.count + '=' + b.textContent)}};
    }})()""")


def expect(stats) -> dict:
    return {
        "used": stats.used_blocks,
        "cached": stats.cached_blocks,
        "free": stats.free_blocks - stats.cached_blocks,
        "blocks": stats.num_blocks,
    }


def settle(browser, allocator, pool_id: str, timeout: float = 10.0) -> dict:
    """Wait until the page agrees with GetPoolStats (no request running)."""
    deadline = time.monotonic() + timeout
    while True:
        want, got = expect(pool_stats(allocator, pool_id)), dom_counts(browser, pool_id)
        if got and {k: got[k] for k in want} == want:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"the page shows {got}, GetPoolStats says {want}")
        time.sleep(0.1)


def complete(url: str, prompt: str, max_tokens: int, stream: bool = False):
    body = {
        "model": "tiny-random",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        return urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        raise AssertionError(
            f"the worker refused the request: {e.code} {e.read()[:500]!r}"
        ) from None


@needs_chromium
def test_live_page_follows_a_worker(allocator, worker):
    OUT.mkdir(exist_ok=True)
    pool_id = f"{WORKER}/1"
    complete(worker, "the same system prompt, then question one", 8).read()
    with cdp.Browser(1280, 400) as browser:
        browser.goto(f"{allocator.base}/pools?token={ROUTER}")
        browser.wait_for(f"document.querySelector('section.pool[data-pool=\"{pool_id}\"]')")
        got = settle(browser, allocator, pool_id)
        assert got["cells"] == {k: got[k] for k in ("used", "cached", "free")}  # one cell per block
        assert got["cached"] > 0  # the finished request's full blocks stay findable

        # New requests: their blocks appear while they run (two at once,
        # sharing a prompt: shared blocks carry their refcount).
        base_used = got["used"]
        seen: dict[str, float] = {}
        responses = [
            complete(worker, f"the same system prompt, then question {q} " * 2, 200, stream=True)
            for q in ("two", "three")
        ]
        first = responses[0].readline()
        t0 = time.monotonic()
        assert first
        done = [threading.Event() for _ in responses]
        for resp, ev in zip(responses, done, strict=True):
            threading.Thread(target=lambda r=resp, e=ev: (r.read(), e.set()), daemon=True).start()
        sel = f'section.pool[data-pool="{pool_id}"]'
        try:
            browser.wait_for(
                f"(+document.querySelector('{sel}').dataset.used) > {base_used}",
                timeout=3.0,
                interval=0.02,
            )
            seen["appear_s"] = time.monotonic() - t0
            # Clicking a sequence highlights its table, in order (at once:
            # the requests must still be running to have a table).
            browser.eval(f"document.querySelector('{sel} .seq').click()")
            browser.wait_for(f"document.querySelector('{sel} .b.hl')", 3.0)
            order = browser.eval(
                f"[...document.querySelectorAll('{sel} "
                ".b.hl')].map(b => [+b.dataset.b, +b.textContent])"
            )
            line = browser.eval(f"document.querySelector('{sel} .table-line').textContent")
            table = json.loads(line[line.index("[") : line.index("]") + 1])
            assert sorted(order, key=lambda x: x[1]) == [[b, i] for i, b in enumerate(table)]
            if not all(e.is_set() for e in done):
                browser.screenshot(str(OUT / "pools-selected.png"))
            time.sleep(2.1)  # sparkline samples
        finally:
            for e in done:
                e.wait(60)
        browser.eval(
            f'document.querySelector(\'section.pool[data-pool="{pool_id}"] '
            '.seq[aria-pressed="true"]\')?.click()'
        )
        # Finished: its blocks turn cached or free, and the page agrees again.
        got = settle(browser, allocator, pool_id)
        assert got["used"] == base_used and got["cached"] > 0
        assert got["cells"] == {k: got[k] for k in ("used", "cached", "free")}
        time.sleep(1.2)  # one more sparkline sample
        browser.screenshot(str(OUT / "pools.png"))
    print(
        "\n/pools: a new request's blocks shown "
        f"{1000 * seen['appear_s']:.0f} ms after its first token"
    )
    assert seen["appear_s"] < 3.0


@needs_chromium
def test_a_step_reaches_the_page_quickly(allocator):
    """From a Step's answer to the page drawing it, on a small pool."""
    client = GrpcAllocator(
        allocator.address, PoolSpec("latency-pool", PoolConfig(64, 4, True, "m")), auth_token=TOKEN
    )
    try:
        sel = f'section.pool[data-pool="{client.pool_id}"]'
        with cdp.Browser(1280, 720) as browser:
            browser.goto(f"{allocator.base}/pools?token={ROUTER}")
            browser.wait_for(f"document.querySelector('{sel}')")
            times = []
            for i in range(8):
                assert client.step([Admit(f"s{i}", list(range(100 * i + 1, 100 * i + 9)))])[0].ok
                answered = time.time()
                browser.wait_for(
                    f"+document.querySelector('{sel}').dataset.used === {2 * (i + 1)}",
                    timeout=3,
                    interval=0.005,
                )
                # the page's own clock (same machine): when it drew the change
                drawn = browser.eval(f"+document.querySelector('{sel}').dataset.renderedAt") / 1000
                times.append(drawn - answered)
        times.sort()
        print(
            f"\n/pools: a step drawn {1000 * times[len(times) // 2]:.0f} ms (median of 8), "
            f"{1000 * times[-1]:.0f} ms at most"
        )
        assert times[-1] < 2.0
    finally:
        client.close()


@needs_chromium
def test_a_100k_block_pool_stays_responsive(allocator):
    spec = PoolSpec("big-pool", PoolConfig(100_000, 16, True, "m"))
    client = GrpcAllocator(allocator.address, spec, auth_token=TOKEN)
    try:
        pool_id = client.pool_id
        tokens = list(range(1, 16 * 20_000))
        assert client.step([Admit("big-1", tokens[: 16 * 30_000 // 2])])[0].ok
        assert client.step([Admit("big-2", list(range(7, 16 * 5_000)))])[0].ok
        client.step([Free("big-2")])
        with cdp.Browser(1280, 720) as browser:
            t0 = time.monotonic()
            browser.goto(f"{allocator.base}/pools?token={ADMIN}")
            sel = f'section.pool[data-pool="{pool_id}"]'
            browser.wait_for(
                f"document.querySelector('{sel}')?.dataset.blocks === '100000'", timeout=15
            )
            shown_s = time.monotonic() - t0
            got = settle(browser, allocator, pool_id)
            cells = browser.eval(f"document.querySelectorAll('{sel} .grid .b').length")
            assert cells <= 4096  # grouped cells, not 100k
            # A change reaches the page quickly.
            t1 = time.monotonic()
            assert client.step([Admit("big-3", list(range(900_000, 900_000 + 16 * 100)))])[0].ok
            browser.wait_for(
                f"+document.querySelector('{sel}').dataset.used === {got['used'] + 100}",
                timeout=5,
                interval=0.02,
            )
            update_s = time.monotonic() - t1
            # Zoom: a grouped cell opens its blocks one cell each.
            browser.eval(f"document.querySelector('{sel} .grid .b.agg').click()")
            browser.wait_for(f"document.querySelector('{sel} .grid .b[data-b]')", timeout=5)
            assert browser.eval(
                f"document.querySelector('{sel} .grid .b[data-b=\"0\"]').className"
            ).startswith("b used")
            browser.screenshot(str(OUT / "pools-100k-zoomed.png"), full_page=False)
        print(
            f"\n/pools, 100k blocks: first render {1000 * shown_s:.0f} ms, an admit shown "
            f"{1000 * update_s:.0f} ms after its step"
        )
        assert update_s < 3.0
    finally:
        client.close()
