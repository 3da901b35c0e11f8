"""`pagedkv up`: the docker-compose topology as local processes.

One allocator (gRPC, in-memory state unless told otherwise), N workers (or, with
`--prefill-workers N --decode-workers M`, a prefill/decode fleet: N workers with
`--kv-role prefill`, M with `--kv-role decode`, and a shared store for the
allocator, file:// in the log folder) serving
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
SIGKILL (a second Ctrl-C skips the grace period). A process that exits
meanwhile is restarted, as compose's `restart: unless-stopped` does
(`LocalStack.supervise`: one line per restart, a growing delay, and a
process that keeps exiting fast is given up on, which stops the stack);
`PAGEDKV_UP_RESTART=0` stops the stack when any process exits.

This module is the command line; the stack itself is `pagedkv.stack.LocalStack`.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from pagedkv.stack import LocalStack, StackError
from pagedkv.stack.config import UpArgs
from pagedkv_base.config import add_arguments, from_args, to_argv
from router.cli import RouterArgs
from worker.cli import WorkerArgs

# ---------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up",
        help="run the allocator and N workers (+ Redis, Prometheus) as local processes",
        description="The docker-compose topology as local processes, with prefixed logs; Ctrl-C "
        "stops it all. Other settings of the workers, the router and the allocators reach every "
        "process through their variables (PAGEDKV_WORKER_*, "
        "PAGEDKV_ROUTER_*, PAGEDKV_ALLOCATOR_*).",
    )
    add_arguments(p, UpArgs)  # its own, then the workers' and the router's it hands on
    return p


def worker_args_from(args: argparse.Namespace) -> list[str]:
    """The worker flags given to `pagedkv up`, as each worker's argv."""
    return to_argv(WorkerArgs, args)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    up = from_args(UpArgs, args)
    stack = LocalStack(
        workers=up.workers or 2,
        kv_roles=up.kv_roles,
        shared_store_gib=up.kv_shared_store_size,
        allocators=up.allocators,
        model=up.model,
        worker_args=worker_args_from(args),
        state=up.state,
        redis=up.redis,
        prometheus=up.prometheus,
        standby=up.standby,
        host=up.host,
        base_port=up.base_port,
        allocator_port=up.allocator_port,
        allocator_metrics_port=up.allocator_metrics_port,
        prometheus_port=up.prometheus_port,
        scrape_interval=up.scrape_interval,
        startup_timeout=up.timeout,
        grace=up.grace,
        log_dir=up.log_dir,
        echo=not up.quiet,
        router=up.router,
        api_key=up.api_key,
        router_port=up.router_port,
        router_args=to_argv(RouterArgs, args),
        # behind the router the workers are internal: loopback only
        worker_host="127.0.0.1" if up.router else None,
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
        for alloc, address, metrics in zip(
            stack.allocators, stack.allocator_addresses, stack.allocator_metrics_urls, strict=True
        ):
            table.add_row(
                alloc.name, str(procs[alloc.name].pid), f"grpc {address}  metrics {metrics}"
            )
        for alloc, address, metrics in zip(
            stack.standbys, stack.standby_addresses, stack.standby_metrics_urls, strict=True
        ):
            table.add_row(
                alloc.name,
                str(procs[alloc.name].pid),
                f"grpc {address}  metrics {metrics}  (standby)",
            )
        if stack.router_url:
            table.add_row(
                "router",
                str(procs["router"].pid),
                f"{stack.router_url}/v1  (the API)  {stack.router_url}/metrics",
            )
        for i, url in enumerate(stack.worker_urls, 1):
            role = f"  (--kv-role {up.kv_roles[i - 1]})" if up.kv_roles else ""
            table.add_row(
                f"worker-{i}", str(procs[f"worker-{i}"].pid), f"{url}/v1  {url}/metrics{role}"
            )
        if stack.redis_url:
            table.add_row("redis", str(procs["redis"].pid), stack.redis_url)
        if stack.prometheus_url:
            table.add_row("prometheus", str(procs["prometheus"].pid), stack.prometheus_url)
        console.print(table)
        console.print(
            f"logs and credentials (admin-token, router-token, worker tokens): {stack.log_dir}   "
            "Ctrl-C stops everything"
        )
        keys = stack.describe()["api_keys_file"]
        console.print(
            f"API key: {keys}  (export OPENAI_API_KEY=$(cat {keys}); send it as "
            "Authorization: Bearer KEY)"
            if keys
            else "[yellow]no API key (--no-api-key): any caller may use the API[/]",
            soft_wrap=True,
        )
        if up.ready_file:
            Path(up.ready_file).write_text(json.dumps(stack.describe(), indent=2))
        if up.restart:
            try:
                stack.supervise()  # returns only by a StackError: a process given up on
            except StackError:
                stack.failed = True
                raise
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
    console.print(
        "all processes stopped" + (f"; logs kept in {stack.log_dir}" if stack.failed else "")
    )
    return status
