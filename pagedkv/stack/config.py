"""`UpArgs`: the one definition of `pagedkv up`'s own settings (flags, variables
PAGEDKV_UP_*, reference), as `pagedkv_base.config` makes them, and of the
components whose settings it hands on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagedkv.stack.services import FAST_EXIT_S, GIVE_UP_AFTER, RESTART_DELAYS
from pagedkv_base.config import setting
from pagedkv_base.settings import seconds
from router.cli import RouterArgs
from worker.cli import WorkerArgs


@dataclass(frozen=True, slots=True)
class UpArgs:
    """The settings of `pagedkv up` itself (what `LocalStack` is started with); the
    workers' and the router's that it offers (`stack=True` in WorkerArgs and
    RouterArgs) are theirs, handed on as given."""

    component: ClassVar[str] = "up"
    # offered as flags of `pagedkv up` (their `stack=True` settings) and handed to each process
    hands_on: ClassVar[tuple[type, ...]] = (WorkerArgs, RouterArgs)

    workers: int | None = setting(
        None,
        "number of worker processes (each --kv-role both); not with --prefill-workers and "
        "--decode-workers",
        shown_default="`2`",
    )
    prefill_workers: int = setting(
        0,
        "a prefill/decode fleet: this many workers with --kv-role prefill (the router sends them "
        "prompts to compute), beside --decode-workers; the allocator gets a shared store (file:// "
        "in the log folder) their blocks move through",
    )
    decode_workers: int = setting(
        0,
        "a prefill/decode fleet: this many workers with --kv-role decode (the router sends them "
        "each request, its prompt loaded from the shared store), beside --prefill-workers",
    )
    kv_shared_store_size: float = setting(
        4.0,
        "GiB the shared store of a prefill/decode fleet holds (the allocator's "
        "--kv-shared-store-size)",
        flag=False,
    )
    model: str = setting(
        "smollm2",
        "model every worker serves (and the router tokenizes with): smollm2, "
        "tiny-random, a path or a Hugging Face repo id",
    )
    host: str = setting(
        "127.0.0.1", "address the allocator and the router bind (the workers too with --no-router)"
    )
    router: bool = setting(
        True, "run the router in front of the workers; --no-router: clients use the workers"
    )
    api_key: bool = setting(
        True,
        "generate an API key (LOG_DIR/api-keys, kept across restarts) that the router and "
        "every worker require as `Authorization: Bearer KEY`; --no-api-key: an open API, for "
        "a development setup only (any caller may use it, and learn from cached tokens what "
        "other callers sent)",
    )
    router_port: int = setting(8000, "HTTP port of the router; 0 picks a free one")
    base_port: int = setting(
        8001, "HTTP port of worker 1; worker i gets base+i-1; 0 picks free ports", flag=False
    )
    allocators: int = setting(
        1,
        "allocator processes the workers' pools are sharded over: worker i registers with "
        "allocator ((i - 1) mod N), the router follows them all; at most --workers",
    )
    allocator_port: int = setting(
        50051,
        "gRPC port of the allocator (allocator i: this + i - 1); 0 picks a free one",
        flag=False,
    )
    allocator_metrics_port: int = setting(
        9400,
        "Prometheus /metrics and /pools port of the allocator (allocator i: this + i - 1); 0 picks "
        "a free one",
        flag=False,
    )
    state: str = setting("memory", "allocator state: memory or redis://host:port/db")
    redis: bool = setting(
        False,
        "start a redis-server (append-only, on a free port) when the binary exists and keep the "
        "allocator's journal in it",
    )
    standby: bool = setting(
        False,
        "give each allocator a hot standby (allocator --standby) that follows its journal and "
        "takes over within the leader lease when it dies or pauses; needs --redis or --state "
        "redis://...; the workers and the router follow the leader",
    )
    prometheus: bool = setting(
        False,
        "start a prometheus (when the binary exists) "
        "scraping the allocators, the router and every worker",
    )
    prometheus_port: int = setting(9090, "Prometheus web port; 0 picks a free one", flag=False)
    scrape_interval: str = setting("2s", "Prometheus scrape interval", flag=False)
    timeout: float = setting(
        300.0, "seconds each stage may take to become healthy", parse=seconds, flag=False
    )
    grace: float = setting(
        10.0, "seconds between SIGTERM and SIGKILL at shutdown", parse=seconds, flag=False
    )
    log_dir: str | None = setting(
        None,
        "keep each process's log as DIR/NAME.log",
        shown_default="a temporary folder, removed at exit",
    )
    restart: bool = setting(
        True,
        "restart a process that exits, as compose's restart: unless-stopped (one line per restart, "
        f"a delay doubling from {RESTART_DELAYS[0]:g} s while it keeps exiting within "
        f"{FAST_EXIT_S:g} s of starting; after {GIVE_UP_AFTER} such exits in a row the stack "
        "stops); 0 stops the stack when any process exits",
        flag=False,
    )
    ready_file: str | None = setting(
        None, "when everything is healthy, write the addresses and pids there as JSON"
    )
    quiet: bool = setting(
        False, "do not echo the processes' output (it still goes to the log files)"
    )

    def __post_init__(self) -> None:
        pd = self.prefill_workers or self.decode_workers
        if pd and self.workers is not None:
            raise ValueError(
                "--workers cannot be combined with --prefill-workers/--decode-workers: give "
                "either --workers N (each worker both) or --prefill-workers N --decode-workers M"
            )
        if pd and not (self.prefill_workers >= 1 and self.decode_workers >= 1):
            raise ValueError(
                "a prefill/decode fleet needs --prefill-workers and --decode-workers, each at "
                "least 1"
            )

    @property
    def kv_roles(self) -> list[str]:
        """Each worker's --kv-role, in start order; empty for a fleet of `--workers` (both)."""
        return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers
