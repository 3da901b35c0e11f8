"""Prefill/decode fleets of real processes for the P/D tests: workers of a role, a router
following their allocator, the fleet itself (`pd_fleet`), and what the tests read of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai

from allocator_service.client.router_client import RouterClient
from pagedkv.stack import RouterProcess, WorkerProcess
from tests.support.drills import wait_for
from tests.support.http import metric

MODEL = "tiny-random"
BLOCK = 4
WORKER_ARGS = ["--num-blocks", "96", "--block-size", str(BLOCK), "--max-model-len", "256"]
PROMPT = "{}: the prefill worker computes this prompt, and the decode worker loads it"


def pd_worker(name: str, allocator: str, *args: str) -> WorkerProcess:
    return WorkerProcess(
        name,
        model=MODEL,
        allocator=allocator,
        args=["--log-level", "warning", "--threads", "1", *WORKER_ARGS, *args],
    )


def pd_router(allocator: str) -> RouterProcess:
    return RouterProcess(
        model=MODEL,
        allocator=allocator,
        args=["--log-level", "warning"],
        # long enough for a busy machine to confirm the blocks (a transfer cut short is
        # computed, which the cached-token checks would read as a failure), short enough
        # for the failing-store case, which waits it out
        env={"PAGEDKV_ROUTER_PD_TRANSFER_TIMEOUT": "15"},
    )


def pd_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def answer_texts(url: str, prompt: str, *, n: int = 1, stream: bool = False, chat: bool = False):
    """(texts by choice index, usage, headers) of one greedy request through `url`."""
    kw = dict(model=MODEL, max_tokens=8, temperature=0, n=n, stream=stream)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    c = pd_client(url)
    if chat:
        raw = c.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": prompt}], **kw
        )
    else:
        raw = c.completions.with_raw_response.create(prompt=prompt, **kw)
    answer = raw.parse()
    texts = [""] * n
    usage = None
    for part in answer if stream else [answer]:
        usage = part.usage or usage
        for ch in part.choices:
            piece = (ch.delta.content if stream else ch.message.content) if chat else ch.text
            texts[ch.index] += piece or ""
    return texts, usage, raw.headers


def pools_by_worker(alloc) -> dict[str, object]:
    return {p.worker_id: p for p in RouterClient(alloc.address).list_pools()}


def outcome_count(fleet, outcome: str) -> float:
    return router_outcomes(fleet["router"].url, outcome)


def router_outcomes(router_url: str, outcome: str) -> float:
    """The split requests the router at `router_url` counted under `outcome`."""
    return metric(router_url, "pagedkv_router_pd_requests_total", {"outcome": outcome})


OUTCOMES = ("transferred", "incomplete", "prefill_failed")


def split_story(
    router_url: str, workers: dict[str, str], logs: dict[str, str], lines: int = 40
) -> str:
    """What a failed split check prints: the router's split outcomes and wait, each worker's
    shared-tier series (`workers`: name -> URL) and the last `lines` of each process's log
    (`logs`: name -> its text), so a failure on a busy machine says which leg fell short."""
    out = [
        "router outcomes: "
        + ", ".join(f"{o}={router_outcomes(router_url, o)}" for o in OUTCOMES)
        + f"; transfer wait {metric(router_url, 'pagedkv_router_pd_transfer_wait_seconds_sum')} s"
    ]
    for name, url in workers.items():
        text = httpx.get(f"{url}/metrics", timeout=5).text
        out += [f"---- {name} {url}"]
        out += [
            x
            for x in text.splitlines()
            if "kv_tier_" in x and 'tier="shared"' in x and "_created{" not in x
        ]
    for name, text in logs.items():
        out += [f"---- {name}", *text.splitlines()[-lines:]]
    return "\n".join(out)


def fleet_story(fleet) -> str:
    """`split_story` of a `pd_fleet`."""
    workers = {n: fleet[n].url for n in ("prefill", "decode")}
    logs = {n: fleet[n].log() for n in ("router", "prefill", "decode", "allocator")}
    return split_story(fleet["router"].url, workers, logs)


def no_blocks_held(alloc) -> None:
    wait_for(
        lambda: all(p.used_blocks == 0 for p in pools_by_worker(alloc).values()),
        30,
        "every pool to hold no block",
    )


@contextlib.contextmanager
def pd_fleet(allocator_server, store_url: str) -> Iterator[dict]:
    """An allocator on the shared store `store_url`, a prefill and a decode worker, and a
    router that knows both: {"allocator", "prefill", "decode", "router"}."""
    with allocator_server(
        "--kv-shared-store",
        store_url,
        "--kv-shared-store-size",
        "0.05",
        "--metrics-port",
        "0",
        env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "5"},
    ) as alloc:
        prefill = pd_worker("prefill-1", alloc.address, "--kv-role", "prefill").start()
        decode = pd_worker("decode-1", alloc.address, "--kv-role", "decode").start()
        router = None
        try:
            prefill.wait_healthy(120)
            decode.wait_healthy(120)
            router = pd_router(alloc.address).start()
            router.wait_healthy(60)
            wait_for(
                lambda: httpx.get(f"{router.url}/health").json()["workers"] == 2,
                30,
                "the router to know both workers",
            )
            yield {"allocator": alloc, "prefill": prefill, "decode": decode, "router": router}
        finally:
            for p in (router, prefill, decode):
                if p is not None:
                    p.terminate()
