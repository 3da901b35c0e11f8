"""The KV-tier systems `bench tiers` compares, on real processes (`pagedkv.stack`).

- `no-tier`: one worker, its KV pool alone;
- `host`: one worker with a host tier (`--kv-offloading-size`) below its pool;
- `host+shared`: two workers, each with the host tier, behind a `round-robin`
  router, their remote allocator holding a shared store
  (`--kv-shared-store file://DIR --kv-shared-store-size GIB`, DIR a
  temporary folder);
- `unbounded`: one worker whose pool holds everything (the ceiling).

Each worker has its own embedded allocator but those of `host+shared`. A
system that cannot start is reported as such (`Systems.errors`), not started.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SYSTEMS = ("no-tier", "host", "host+shared", "unbounded")
SHARED = "host+shared"


@dataclass(frozen=True)
class Sizes:
    """What the systems hold: blocks in a KV pool, GiB of the host tier and of the shared store."""

    kv_blocks: int
    unbounded_blocks: int
    host_gib: float
    store_gib: float


@dataclass(frozen=True)
class Target:
    url: str  # where requests go
    workers: tuple[str, ...]  # the workers that answer them (whose /metrics tell the tiers' bytes)


@dataclass
class Systems:
    targets: dict[str, Target] = field(default_factory=dict)  # the systems that started
    errors: dict[str, str] = field(default_factory=dict)  # why each other one did not


def _gib(value: float) -> str:
    return f"{value:.12f}"


@contextlib.contextmanager
def started(names: Sequence[str], model: str, block_size: int, sizes: Sizes) -> Iterator[Systems]:
    """Start the systems `names` (healthy on entry, or in `errors`), stop them all on exit."""
    from pagedkv.stack import LocalStack, StackError, WorkerProcess, stop_processes

    common = [
        "--log-level",
        "warning",
        "--block-size",
        str(block_size),
        "--enable-prefix-caching",
        "--max-num-seqs",
        "4",
        "--threads",
        "1",
    ]
    host = ["--kv-offloading-size", _gib(sizes.host_gib)]
    alone = {
        "no-tier": ["--num-blocks", str(sizes.kv_blocks)],
        "host": ["--num-blocks", str(sizes.kv_blocks), *host],
        "unbounded": ["--num-blocks", str(sizes.unbounded_blocks)],
    }
    systems = Systems()
    workers = {
        name: WorkerProcess(f"bench-tiers-{name}", model=model, args=[*common, *alone[name]])
        for name in names
        if name in alone
    }
    store_dir = tempfile.mkdtemp(prefix="pagedkv-bench-tiers-store-")
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, store_dir, True)
        cleanup.callback(
            lambda: stop_processes([[w.proc for w in workers.values() if w.proc is not None]], 10.0)
        )
        for w in workers.values():
            w.start()
        if SHARED in names:
            stack = LocalStack(
                workers=2,
                model=model,
                worker_args=[*common, "--num-blocks", str(sizes.kv_blocks), *host],
                allocator_args=[
                    "--kv-shared-store",
                    f"file://{store_dir}",
                    "--kv-shared-store-size",
                    _gib(sizes.store_gib),
                ],
                router=True,
                router_args=["--policy", "round-robin", "--log-level", "warning"],
                startup_timeout=300,
            )
            try:
                cleanup.enter_context(stack)
                systems.targets[SHARED] = Target(stack.router_url, tuple(stack.worker_urls))
            except StackError as exc:
                systems.errors[SHARED] = _reason(str(exc))
        for name, w in workers.items():
            try:
                w.wait_healthy(300)
                systems.targets[name] = Target(w.url, (w.url,))
            except StackError as exc:
                systems.errors[name] = _reason(str(exc))
        yield systems


def _reason(text: str) -> str:
    """A failure's message without the whole log: its first
    line, then the error its process printed."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    told = [line for line in lines[1:] if "error" in line.lower()]
    return "\n".join(lines[:1] + told[-1:])
