"""The routing systems `bench route` compares, on real processes (`pagedkv.stack`).

One allocator and two workers whose pools each hold only part of the
tenants' prefixes, with one router per policy (`kv`, `least-load`,
`round-robin`) in front of them, and a `kv` router asking MatchPrefix per
request (`kv-match-prefix`; the default `kv` matches in its copy of the
pools' caches, kept from the allocator's events); plus a reference worker
alone with both pools' memory (its own embedded allocator, behind no router).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

POLICIES = ("kv", "least-load", "round-robin")
REFERENCE = "one-worker-2x-memory"
ASKING = "kv-match-prefix"  # kv asking MatchPrefix per request: the cache view's comparison


@dataclass(frozen=True)
class Target:
    url: str  # where requests go
    workers: tuple[str, ...]  # the workers that answer them (whose counters tell the hit rate)


@dataclass(frozen=True)
class Topology:
    targets: dict[str, Target]  # system name -> where to send its requests
    direct: str  # one of the two workers, for the router's added latency
    kv_router: str


@contextlib.contextmanager
def topology(model: str, num_blocks: int, block_size: int, max_num_seqs: int) -> Iterator[Topology]:
    """Start every system (healthy on entry), stop them all on exit."""
    from pagedkv.stack import LocalStack, RouterProcess, WorkerProcess, stop_processes

    worker_args = [
        "--log-level",
        "warning",
        "--block-size",
        str(block_size),
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    routers: dict[str, RouterProcess] = {}
    with LocalStack(
        workers=2,
        model=model,
        worker_args=[*worker_args, "--num-blocks", str(num_blocks)],
        startup_timeout=300,
    ) as stack:
        single = WorkerProcess(
            "reference",
            model=model,  # embedded allocator: no router sees it
            args=[*worker_args, "--num-blocks", str(2 * num_blocks)],
        )
        try:
            single.start()
            router_args = {policy: ["--policy", policy] for policy in POLICIES}
            router_args[ASKING] = []
            for name, args in router_args.items():
                view = {"PAGEDKV_ROUTER_CACHE_VIEW": "match-prefix"} if name == ASKING else None
                routers[name] = RouterProcess(
                    f"router-{name}",
                    allocator=stack.allocator_address,
                    model=model,
                    args=[*args, "--log-level", "warning", *stack.router_credentials],
                    env=view,
                )
                routers[name].start()
            single.wait_healthy(300)
            for r in routers.values():
                r.wait_healthy(300)
            targets = {name: Target(r.url, tuple(stack.worker_urls)) for name, r in routers.items()}
            targets[REFERENCE] = Target(single.url, (single.url,))
            yield Topology(targets, direct=stack.worker_urls[0], kv_router=routers["kv"].url)
        finally:
            stop_processes(
                [
                    [r.proc for r in routers.values() if r.proc is not None]
                    + ([single.proc] if single.proc is not None else [])
                ],
                10.0,
            )
