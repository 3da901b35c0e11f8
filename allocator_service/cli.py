"""`pagedkv allocator` and `python -m allocator_service`: run the service.

Only argparse and the settings scheme are imported at module level so that
`pagedkv --help` stays fast; grpc, redis and prometheus load inside `run`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from allocator_service.config import Limits
from pagedkv_base.config import add_arguments as add_setting_flags
from pagedkv_base.config import from_args, name_of, setting
from pagedkv_base.settings import (
    LOG_LEVELS,
    CliError,
    gib_or_none,
    log_level,
    read_file,
    read_secret,
    run_command,
    seconds,
)

DESCRIPTION = """\
Run the PagedKV allocator: the gRPC service that owns every worker's block
tables, refcounts and prefix-cache index. Every setting is also an
environment variable (shown in brackets; some are variables only: see the
configuration reference); a flag wins over its variable.
"""


@dataclass(frozen=True, slots=True)
class AllocatorArgs:
    """Every setting of `pagedkv allocator`: its flags, variables and reference come from here."""

    component: ClassVar[str] = "allocator"

    listen: str = setting(
        "127.0.0.1:50051",
        "address to serve gRPC on; port 0 picks a free one, [::]:PORT or 0.0.0.0:PORT "
        "for every interface",
        metavar="HOST:PORT",
    )
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics and /pools (and with --playground /playground) on this port "
        "(same host as --listen; 0 = any free port); off when not given",
        metavar="PORT",
    )
    playground: bool = setting(
        False,
        "also serve /playground, the teaching widget that runs a small allocator per call, on "
        "--metrics-port (one run at a time); off on a production allocator",
    )
    state: str = setting(
        "memory",
        "'memory' keeps state in this process only; a redis:// URL journals every accepted change "
        "in Redis before replying and rebuilds the exact state on start (append ?key_prefix=NAME: "
        "to share one Redis); redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME/DB follows the "
        "primary those Redis Sentinels name through a failover",
        metavar="memory|redis://HOST:PORT/DB",
    )
    standby: bool = setting(
        False,
        "with --state redis: run as a hot standby: follow the journal as the leader writes it (the "
        "same state in memory), answer calls with UNAVAILABLE not_leader and the leader's address, "
        "and take over when the leader's lease runs out (it died or paused); a deposed leader "
        "becomes a standby. Without it the allocator "
        "claims the state at start (fencing off any other)",
    )
    leader_lease: float = setting(
        1.0,
        "with --state redis: seconds the leader's lease in Redis lasts unless renewed (5 times a "
        "lease); a standby takes over this long after the leader stopped renewing it",
        parse=seconds,
        flag=False,
    )
    advertise_address: str | None = setting(
        None,
        "HOST:PORT at which clients reach this allocator's gRPC port, which a standby names to "
        "them when this one leads",
        metavar="HOST:PORT",
        shown_default="--listen's (the host's name for 0.0.0.0 or [::])",
    )
    auth_token_file: str | None = setting(
        None,
        "file holding a bearer token every call must send as 'authorization: Bearer TOKEN' (health "
        "checks exempt); none = no server-wide token",
        metavar="PATH",
    )
    worker_tokens_file: str | None = setting(
        None,
        "file of worker tokens, one 'WORKER_ID URL TOKEN [BLOCKS]' per line: a worker sending "
        "TOKEN may register only WORKER_ID advertising URL, and no other credential but the admin "
        "token may register that id or advertise that address; BLOCKS, its quota: its pool has at "
        "most that many blocks, and they are kept for it while it has no pool (a restart), so no "
        "other pool takes them. With it and no --auth-token-file, every worker needs its own token",
        metavar="PATH",
    )
    max_pool_blocks: int | None = setting(
        None,
        "the most blocks one pool may have, unless its worker token gives a quota "
        "(RESOURCE_EXHAUSTED past it); none: the server's "
        f"total ({Limits().max_total_blocks:,} blocks)",
        metavar="N",
    )
    admin_token_file: str | None = setting(
        None,
        "file holding the admin bearer token: every call, and GetPoolStats, ResetPrefixCache and "
        "DumpPool of ANY pool without its credential; none = no admin role",
        metavar="PATH",
    )
    router_token_file: str | None = setting(
        None,
        "file holding the router bearer token, which MatchPrefix, WatchEvents and ListPools then "
        "require (or the admin token) and which may call nothing else. Without it those calls are "
        "open to any caller only when --auth-token-file is unset too (a development setup); with "
        "--auth-token-file alone they need the admin token",
        metavar="PATH",
    )
    lease_ttl: float = setting(
        30.0,
        "seconds: drop a pool (and free its blocks) when no call renewed it for this long",
        parse=seconds,
        flag=False,
    )
    tls_cert: str | None = setting(
        None, "serve TLS with this certificate chain (needs --tls-key)", metavar="PEM"
    )
    tls_key: str | None = setting(None, "private key of --tls-cert", metavar="PEM")
    snapshot_every: int = setting(
        1000,
        "with --state redis: write a full snapshot every N journal records, so a restart replays "
        "at most N",
        flag=False,
    )
    max_snapshot_mb: int = setting(
        256,
        "with --state redis: the most a snapshot may take; the pools whose part is over their "
        "share (in proportion to their blocks) of a snapshot that would be larger are dropped "
        "(snapshot_too_large) and the snapshot is written "
        "without them; at most 512, Redis's value limit",
        flag=False,
    )
    redis_wait_replicas: int = setting(
        0,
        "with --state redis: after every journal write wait (Redis WAIT) until N replicas hold it "
        "before replying; a write they do not acknowledge in time is UNAVAILABLE (the worker "
        "retries). For durability across the loss of the Redis host",
        flag=False,
    )
    redis_wait_timeout: float = setting(
        1.0,
        "seconds the wait for replicas (PAGEDKV_ALLOCATOR_REDIS_WAIT_REPLICAS) lasts",
        parse=seconds,
        flag=False,
    )
    fair_share_window_ms: float = setting(
        100.0,
        "per-pool CPU fair share: while pools contend, the pool that used more CPU over about this "
        "long waits for a call of the one that used less (delayed, never refused); 0 = off",
        flag=False,
    )
    journal_key_file: str | None = setting(
        None,
        "with --state redis: file holding the journal key (at least 32 bytes; `pagedkv "
        "credentials` writes one): every record's chain digest and the snapshot's are HMAC-SHA256 "
        "under it, so whoever can write to Redis without it cannot edit the state unnoticed (the "
        "allocator and --check refuse it); none = Redis is trusted with the state. A journal "
        "written without a key is read only without one",
        metavar="PATH",
        flag=False,
    )
    journal_anchor_file: str | None = setting(
        None,
        "with --state redis: a file of this instance's (outside Redis) where it notes the last "
        "record it wrote (about once a second); a load that finds Redis ending before that record, "
        "or holding another record there, is refused (the store was rolled back or replaced). "
        "Delete the file after restoring Redis from a backup on purpose",
        metavar="PATH",
        flag=False,
    )
    kv_shared_store: str | None = setting(
        None,
        "the KV store this allocator's workers share (tier 2 below their host tiers): file://PATH "
        "(a directory every worker mounts), redis://HOST:PORT/DB, or peer:// (no shared place: "
        "each entry stays in the memory of the worker that wrote it, which serves it to the "
        "others; every worker needs --advertise-url); the allocator indexes it, the "
        "workers move the bytes (a worker opts out with --no-kv-shared-store). Checked at start: a "
        "path it cannot write or a Redis that does not "
        "answer is an error. Needs --kv-shared-store-size",
        metavar="URL",
    )
    kv_shared_store_size: float = setting(
        0.0,
        "GiB the shared store may hold (its index evicts least recently used entries past it); "
        "with peer://, also what each worker may keep of it in its memory",
        parse=gib_or_none,
        metavar="GIB",
    )
    check: bool = setting(
        False,
        "verify the journal in --state (digests, record chain, step chains, head) without serving "
        "or writing; print what was found; exit 0 if sound, 1 if not",
    )
    log_level: str = setting("INFO", "log level, any case", parse=log_level, choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if ":" not in self.listen:
            raise ValueError(f"--listen wants HOST:PORT, not {self.listen!r}")
        if not 1 <= self.max_snapshot_mb <= 512:
            raise ValueError(
                f"{name_of(AllocatorArgs, 'max_snapshot_mb')} "
                "must be 1 to 512 (Redis's value limit)"
            )
        from allocator_service.store.journal import REDIS_SCHEMES

        if not (self.state == "memory" or self.state.startswith(REDIS_SCHEMES)):
            raise ValueError(f"--state must be 'memory' or a redis:// URL, not {self.state!r}")
        store, size = (
            name_of(AllocatorArgs, "kv_shared_store"),
            name_of(AllocatorArgs, "kv_shared_store_size"),
        )
        if self.kv_shared_store and not self.kv_shared_store_size:
            raise ValueError(f"{store} needs {size} (GiB it may hold)")
        if self.kv_shared_store_size and not self.kv_shared_store:
            raise ValueError(f"{size} is for {store}, which is not given")
        if not 0 < self.leader_lease <= 60:
            raise ValueError(
                f"{name_of(AllocatorArgs, 'leader_lease')} "
                "must be more than 0 and at most 60 seconds"
            )
        if self.standby and self.state == "memory":
            raise ValueError("--standby follows a journal: it needs --state redis://...")
        if self.journal_anchor_file and self.state == "memory":
            raise ValueError(
                f"{name_of(AllocatorArgs, 'journal_anchor_file')} anchors a journal: "
                "it needs --state redis://..."
            )
        if self.advertise_address is not None and ":" not in self.advertise_address:
            raise ValueError(f"--advertise-address wants HOST:PORT, not {self.advertise_address!r}")
        if self.redis_wait_replicas < 0 or not self.redis_wait_timeout > 0:
            raise ValueError(
                f"{name_of(AllocatorArgs, 'redis_wait_replicas')} must be >= 0 and "
                f"{name_of(AllocatorArgs, 'redis_wait_timeout')} positive"
            )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_setting_flags(parser, AllocatorArgs)
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "allocator",
        help="run the allocator gRPC service",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return add_arguments(p)


def options_from_args(args: argparse.Namespace):
    from allocator_service.config import ServiceConfig
    from allocator_service.rpc.server import ServeOptions

    a = from_args(AllocatorArgs, args)
    token = read_secret(a.auth_token_file, "auth token file") if a.auth_token_file else None
    admin = read_secret(a.admin_token_file, "admin token file") if a.admin_token_file else None
    router = read_secret(a.router_token_file, "router token file") if a.router_token_file else None
    tokens = [t for t in (token, admin, router) if t]
    if len(set(tokens)) != len(tokens):
        raise CliError(
            "--auth-token-file, --admin-token-file and "
            "--router-token-file must hold different tokens"
        )
    worker_tokens = {}
    if a.worker_tokens_file:
        from allocator_service.roles import parse_worker_tokens

        try:
            worker_tokens = parse_worker_tokens(
                read_file(a.worker_tokens_file, "worker tokens file").decode()
            )
        except ValueError as exc:
            raise CliError(f"--worker-tokens-file {a.worker_tokens_file}: {exc}") from exc
        if set(worker_tokens) & set(tokens):
            raise CliError("a worker token must differ from the auth, admin and router tokens")
    if a.kv_shared_store:
        from pagedkv_base.store_url import StoreOpenError, check_store_url

        try:
            check_store_url(a.kv_shared_store)
        except StoreOpenError as exc:
            raise CliError(f"--kv-shared-store: {exc}") from exc
    journal_key = (
        read_file(a.journal_key_file, "journal key file").strip() if a.journal_key_file else None
    )
    if journal_key is not None and len(journal_key) < 32:
        raise CliError(
            f"the journal key file {a.journal_key_file} holds "
            f"{len(journal_key)} bytes; a key needs 32 or more"
        )
    try:
        config = ServiceConfig(
            lease_ttl_s=a.lease_ttl,
            snapshot_every=a.snapshot_every,
            max_snapshot_bytes=a.max_snapshot_mb << 20,
            fair_share_window_s=a.fair_share_window_ms / 1e3,
            reserved_blocks={g.worker_id: g.blocks for g in worker_tokens.values() if g.blocks},
            store_groups={g.worker_id: g.store_group for g in worker_tokens.values()},
            max_pool_blocks=a.max_pool_blocks,
            journal_key=journal_key,
            journal_anchor_file=a.journal_anchor_file,
            shared_store=a.kv_shared_store or "",
            shared_store_bytes=int(a.kv_shared_store_size * 2**30),
            standby=a.standby,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    return ServeOptions(
        listen=a.listen,
        state=a.state,
        metrics_port=a.metrics_port,
        playground=a.playground,
        auth_token=token,
        admin_token=admin,
        router_token=router,
        worker_tokens=worker_tokens,
        tls_cert=read_file(a.tls_cert, "TLS certificate") if a.tls_cert else None,
        tls_key=read_file(a.tls_key, "TLS key") if a.tls_key else None,
        config=config,
        redis_wait_replicas=a.redis_wait_replicas,
        redis_wait_timeout_s=a.redis_wait_timeout,
        leader_lease_s=a.leader_lease,
        advertise_address=a.advertise_address,
    )


def run(args: argparse.Namespace) -> int:
    import logging
    import sys
    from pathlib import Path

    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from allocator_service.rpc.server import serve
    from allocator_service.store.anchor import read_anchor
    from allocator_service.store.registry import CorruptState
    from allocator_service.store.replay import check
    from allocator_service.wire.errors import StoreUnavailable

    options = options_from_args(args)  # a CliError: exit 2, reported by run_command
    if args.check:
        try:
            anchor_file = options.config.journal_anchor_file
            anchor = read_anchor(Path(anchor_file)) if anchor_file else None
            return check(options.state, key=options.config.journal_key, anchor=anchor)
        except (StoreUnavailable, CorruptState) as exc:
            print(f"pagedkv allocator --check: cannot read the state: {exc}", file=sys.stderr)
            return 1
    try:
        return serve(options)
    except CorruptState as exc:
        print(
            f"pagedkv allocator: cannot start: {exc} (recovery: docs/operations.md, "
            "'A journal that cannot be replayed')",
            file=sys.stderr,
        )
        return 1
    except (StoreUnavailable, OSError) as exc:
        print(f"pagedkv allocator: cannot start: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="python -m allocator_service",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return run_command("allocator", run, parser.parse_args(argv))
