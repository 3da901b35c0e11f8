"""End to end in processes: the allocator service + two workers (+ a real
Prometheus when the binary is installed), driven by the official openai
client."""

from __future__ import annotations

import concurrent.futures
import shutil
import time

import httpx
import openai
import pytest

from pagedkv.stack import LocalStack
from pagedkv_base.settings import cpu_count
from tests.support.http import metric
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model

PROMPTS = [
    "the first prompt",
    "a second, somewhat longer prompt for the pool",
    "three",
    "four words go here",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def stack():
    # A small pool (24 blocks of 4 = 96 slots) so concurrent requests preempt.
    args = [
        "--num-blocks",
        "24",
        "--block-size",
        "4",
        "--enable-prefix-caching",
        "--max-model-len",
        "96",
    ]
    with LocalStack(
        workers=2,
        model="tiny-random",
        worker_args=args,
        prometheus=shutil.which("prometheus") is not None,
        scrape_interval="1s",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    engine = LLMEngine(load_model("tiny-random"), EngineConfig(num_blocks=256, block_size=4))
    outs = engine.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    return [o.text for o in outs]


def ask(url: str, prompt: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(
        model="tiny-random",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if stream:
        return "".join(
            c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices
        )
    return client.completions.create(**kw).choices[0].text


def test_the_workers_divide_the_cores(stack):
    # LocalStack (so `pagedkv up`) passes each of its 2 workers half the cores;
    # each worker reports the thread count torch runs with.
    for worker, url in zip(stack.workers, stack.worker_urls, strict=True):
        argv = worker.argv()
        assert argv[argv.index("--threads") + 1] == "1/2"
        assert metric(url, "pagedkv_worker_threads") == max(1, cpu_count() // 2)


def test_two_workers_match_the_offline_engine_under_preemption(stack, offline):
    jobs = [
        (url, i, stream)
        for url in stack.worker_urls
        for i in range(len(PROMPTS))
        for stream in (False, True)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: (j[1], ask(j[0], PROMPTS[j[1]], j[2])), jobs))
    for i, text in results:
        assert text == offline[i]
    # The pools were too small for all at once: preemptions happened and
    # every block came back afterwards.
    for url in stack.worker_urls:
        assert metric(url, "pagedkv_worker_preemptions_total", {"cause": "out_of_blocks"}) > 0
        assert metric(url, "pagedkv_worker_kv_blocks_used") == 0


def _prom(url: str, query: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
    assert r["status"] == "success"
    return r["data"]["result"]


def test_prometheus_scrapes_utilisation_and_preemptions(stack, offline):
    if stack.prometheus_url is None:
        pytest.skip("skipped: no `prometheus` binary on this machine (Debian package `prometheus`)")
    # the workload of the previous test forced preemptions; wait for a scrape
    deadline = time.monotonic() + 30
    preempt, util = [], []
    while time.monotonic() < deadline:
        preempt = _prom(stack.prometheus_url, "sum by (worker) (pagedkv_worker_preemptions_total)")
        util = _prom(stack.prometheus_url, "pagedkv_worker_kv_slot_utilisation_ratio")
        alloc = _prom(stack.prometheus_url, "pagedkv_allocator_pool_capacity_blocks")
        if (
            len(preempt) == 2
            and len(util) == 2
            and all(float(p["value"][1]) > 0 for p in preempt)
            and alloc
        ):
            break
        time.sleep(1)
    assert len(preempt) == 2 and all(float(p["value"][1]) > 0 for p in preempt)
    assert len(util) == 2 and all(0 < float(u["value"][1]) <= 1 for u in util)
    up = _prom(stack.prometheus_url, "up")
    assert len(up) == 3 and all(u["value"][1] == "1" for u in up)
