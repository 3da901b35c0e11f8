"""`pagedkv up`: the docker-compose topology as local processes.

One allocator (gRPC, in-memory state unless told otherwise), N workers serving
the OpenAI-style HTTP API on loopback, the router in front of them on port
8000 (the one address clients use: it sends each request to the worker whose
KV pool holds most of its prompt; `--no-router` leaves it out and the
workers bind --host), and optionally a Redis for the allocator's journal
(`--redis`) and a Prometheus scraping everything (`--prometheus`) when their
binaries are on PATH. Each process's output is echoed with a coloured name
prefix (but for the access-log lines of /health and /metrics) and kept in
`<log dir>/<name>.log`; `pagedkv up` returns when you press
Ctrl-C (or send SIGTERM): the router and workers first, then Prometheus, the allocator and
Redis get SIGTERM, and whatever is still alive after the grace period gets
SIGKILL (a second Ctrl-C skips the grace period).

This module is the command line; the stack itself is `pagedkv.stack.LocalStack`.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from pagedkv.stack import LocalStack, StackError
from pagedkv_base.settings import parse_threads
from router.policy import POLICIES

# ---------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up", help="run the allocator and N workers (+ Redis, Prometheus) as local processes",
        description="The docker-compose topology as local processes, with prefixed logs; Ctrl-C stops it all.",
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker processes (default: 2)")
    p.add_argument("--model", default="smollm2", help="model every worker serves: smollm2, tiny-random or a path (default: smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="address the allocator and workers bind (default: 127.0.0.1)")
    p.add_argument("--router", action=argparse.BooleanOptionalAction, default=True,
                   help="run the router in front of the workers (default: on); --no-router: clients use the workers")
    p.add_argument("--router-port", type=int, default=8000, help="HTTP port of the router; 0 picks a free one (default: 8000)")
    p.add_argument("--policy", default="kv", choices=POLICIES,
                   help="the router's policy (default: kv)")
    p.add_argument("--base-port", type=int, default=8001, help="HTTP port of worker 1; worker i gets base+i-1; 0 picks free ports (default: 8001)")
    p.add_argument("--allocators", type=int, default=1,
                   help="allocator processes the workers' pools are sharded over: worker i registers with allocator "
                        "((i - 1) mod N), the router follows them all; at most --workers (default: 1)")
    p.add_argument("--allocator-port", type=int, default=50051, help="gRPC port of the allocator (allocator i: this + i - 1); 0 picks a free one (default: 50051)")
    p.add_argument("--allocator-metrics-port", type=int, default=9400, help="Prometheus /metrics port of the allocator (allocator i: this + i - 1); 0 picks a free one (default: 9400)")
    p.add_argument("--state", default="memory", help="allocator state: memory or redis://host:port/db (default: memory)")
    p.add_argument("--redis", action="store_true", help="start a redis-server (append-only, on a free port) when the binary exists and keep the allocator's journal in it")
    p.add_argument("--prometheus", action="store_true", help="start a prometheus (when the binary exists) scraping the allocator and every worker")
    p.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus web port; 0 picks a free one (default: 9090)")
    p.add_argument("--scrape-interval", default="2s", help="Prometheus scrape interval (default: 2s)")
    pool = p.add_argument_group("worker settings passed through to every worker")
    pool.add_argument("--num-blocks", type=int, help="KV blocks per worker pool")
    pool.add_argument("--kv-cache-memory", help="KV pool size per worker instead of --num-blocks, e.g. 2GiB")
    pool.add_argument("--block-size", type=int, help="tokens per KV block")
    pool.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                      help="share cached prompt prefixes between requests (default: on)")
    pool.add_argument("--device", help="cpu or cuda")
    pool.add_argument("--dtype", help="model and KV dtype, e.g. float32, bfloat16")
    pool.add_argument("--max-num-seqs", type=int, help="most sequences in one running batch")
    pool.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one scheduler step")
    pool.add_argument("--threads", type=parse_threads, metavar="N|A/B",
                      help="compute threads per worker, a count or a share of the cores "
                           "(default: the cores divided among the workers, max(1, cores // workers))")
    pool.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                      help="any other worker flag, once per word: --worker-arg=--seed --worker-arg=1")
    p.add_argument("--allocator-arg", action="append", default=[], metavar="ARG",
                   help="any other allocator flag, once per word: --allocator-arg=--lease-ttl --allocator-arg=30")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each stage may take to become healthy (default: 300)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL at shutdown (default: 10)")
    p.add_argument("--log-dir", help="keep each process's log as DIR/NAME.log (default: a temporary folder, removed at exit)")
    p.add_argument("--ready-file", help="when everything is healthy, write the addresses and pids there as JSON")
    p.add_argument("--quiet", action="store_true", help="do not echo the processes' output (it still goes to the log files)")
    return p


def worker_args_from(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for flag in ("num_blocks", "kv_cache_memory", "block_size", "device", "dtype", "max_num_seqs",
                 "max_num_batched_tokens", "threads"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    # Said either way: the worker's own default (on) may be turned off by its environment.
    out.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    return out + list(args.worker_arg)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    stack = LocalStack(
        workers=args.workers, allocators=args.allocators, model=args.model, worker_args=worker_args_from(args),
        allocator_args=args.allocator_arg, state=args.state, redis=args.redis, prometheus=args.prometheus,
        host=args.host, base_port=args.base_port, allocator_port=args.allocator_port,
        allocator_metrics_port=args.allocator_metrics_port, prometheus_port=args.prometheus_port,
        scrape_interval=args.scrape_interval, startup_timeout=args.timeout, grace=args.grace,
        log_dir=args.log_dir, echo=not args.quiet,
        router=args.router, router_port=args.router_port, router_args=["--policy", args.policy],
        # behind the router the workers are internal: loopback only
        worker_host="127.0.0.1" if args.router else None,
    )
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if stopping:  # a second Ctrl-C / SIGTERM: no more grace period
            stack.hurry.set()
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 0
    try:
        stack.start()
        table = Table(title="pagedkv up: all healthy", title_justify="left")
        for col in ("process", "pid", "address"):
            table.add_column(col)
        procs = stack.processes
        for alloc, address, metrics in zip(stack.allocators, stack.allocator_addresses, stack.allocator_metrics_urls,
                                           strict=True):
            table.add_row(alloc.name, str(procs[alloc.name].pid), f"grpc {address}  metrics {metrics}")
        if stack.router_url:
            table.add_row("router", str(procs["router"].pid),
                          f"{stack.router_url}/v1  (the API: policy {args.policy})  {stack.router_url}/metrics")
        for i, url in enumerate(stack.worker_urls, 1):
            table.add_row(f"worker-{i}", str(procs[f"worker-{i}"].pid), f"{url}/v1  {url}/metrics")
        if stack.redis_url:
            table.add_row("redis", str(procs["redis"].pid), stack.redis_url)
        if stack.prometheus_url:
            table.add_row("prometheus", str(procs["prometheus"].pid), stack.prometheus_url)
        console.print(table)
        console.print(f"logs: {stack.log_dir}   Ctrl-C stops everything")
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps(stack.describe(), indent=2))
        dead = stack.wait()
        stopping = True
        stack.failed = True
        raise StackError(dead.describe_failure(f"exited with status {dead.popen.returncode}"))
    except KeyboardInterrupt:
        stopping = True
        console.print("[bold]stopping[/] (Ctrl-C again to skip the grace period)")
    except StackError as exc:
        stopping = True
        console.print(Text.assemble(("pagedkv up: error: ", "bold red"), str(exc)))
        status = 1
    finally:
        stopping = True
        stack.stop()
    console.print("all processes stopped" + (f"; logs kept in {stack.log_dir}" if stack.failed else ""))
    return status
