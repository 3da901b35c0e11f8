"""`pagedkv allocator` and `python -m allocator_service`: run the service.

Only argparse and the settings scheme are imported at module level so that
`pagedkv --help` stays fast; grpc, redis and prometheus load inside `run`.
"""

from __future__ import annotations

import argparse

from pagedkv_base.settings import (
    LOG_LEVELS,
    CliError,
    env_default,
    env_switch,
    log_level,
    read_file,
    read_secret,
    run_command,
)

DESCRIPTION = """\
Run the PagedKV allocator: the gRPC service that owns every worker's block
tables, refcounts and prefix-cache index. Every flag can also be given as an
environment variable (shown in brackets); a flag wins over its variable.
"""


def _env(flag: str, default=None, type=str) -> dict:
    return env_default("allocator", flag, default, type)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--listen", **_env("--listen", "127.0.0.1:50051"), metavar="HOST:PORT",
      help="address to serve gRPC on; port 0 picks a free one, [::]:PORT or 0.0.0.0:PORT "
           "for every interface [%(default)s] [PAGEDKV_ALLOCATOR_LISTEN]")
    a("--metrics-port", **_env("--metrics-port", type=int), metavar="PORT",
      help="serve Prometheus metrics on this port (same host as --listen; 0 = any free "
           "port); off when not given [PAGEDKV_ALLOCATOR_METRICS_PORT]")
    a("--state", **_env("--state", "memory"), metavar="memory|redis://HOST:PORT/DB",
      help="'memory' keeps state in this process only; a redis:// URL journals every "
           "accepted change in Redis before replying and rebuilds the exact state on "
           "start (append ?key_prefix=NAME: to share one Redis) [%(default)s] "
           "[PAGEDKV_ALLOCATOR_STATE]")
    a("--auth-token-file", **_env("--auth-token-file"), metavar="PATH",
      help="file holding a bearer token every call must send as 'authorization: Bearer "
           "TOKEN' (health checks exempt); none = no server-wide token "
           "[PAGEDKV_ALLOCATOR_AUTH_TOKEN_FILE]")
    a("--admin-token-file", **_env("--admin-token-file"), metavar="PATH",
      help="file holding the admin bearer token: every call, and GetPoolStats, "
           "ResetPrefixCache and DumpPool of ANY pool without its credential; none = no "
           "admin role [PAGEDKV_ALLOCATOR_ADMIN_TOKEN_FILE]")
    a("--router-token-file", **_env("--router-token-file"), metavar="PATH",
      help="file holding the router bearer token, which MatchPrefix, WatchEvents and ListPools then "
           "require (or the admin token) and which may call nothing else. Without it those "
           "calls are open to any caller only when --auth-token-file is unset too (a "
           "development setup); with --auth-token-file alone they need the admin token "
           "[PAGEDKV_ALLOCATOR_ROUTER_TOKEN_FILE]")
    a("--lease-ttl", **_env("--lease-ttl", 30.0, float), metavar="SECONDS",
      help="drop a pool (and free its blocks) when no call renewed it for this long "
           "[%(default)s] [PAGEDKV_ALLOCATOR_LEASE_TTL]")
    a("--tls-cert", **_env("--tls-cert"), metavar="PEM",
      help="serve TLS with this certificate chain (needs --tls-key) [PAGEDKV_ALLOCATOR_TLS_CERT]")
    a("--tls-key", **_env("--tls-key"), metavar="PEM",
      help="private key of --tls-cert [PAGEDKV_ALLOCATOR_TLS_KEY]")
    a("--snapshot-every", **_env("--snapshot-every", 1000, int), metavar="N",
      help="with --state redis: write a full snapshot every N journal records, so a "
           "restart replays at most N [%(default)s] [PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY]")
    a("--max-snapshot-mb", **_env("--max-snapshot-mb", 256, int), metavar="MB",
      help="with --state redis: a snapshot larger than this is not written (logged; tried again "
           "later; the journal keeps every record); at most 512, Redis's value limit "
           "[%(default)s] [PAGEDKV_ALLOCATOR_MAX_SNAPSHOT_MB]")
    a("--redis-wait-replicas", **_env("--redis-wait-replicas", 0, int), metavar="N",
      help="with --state redis: after every journal write wait (Redis WAIT) until N replicas "
           "hold it before replying; a write they do not acknowledge in time is UNAVAILABLE "
           "(the worker retries). For durability across the loss of the Redis host "
           "[%(default)s] [PAGEDKV_ALLOCATOR_REDIS_WAIT_REPLICAS]")
    a("--redis-wait-timeout", **_env("--redis-wait-timeout", 1.0, float), metavar="SECONDS",
      help="how long --redis-wait-replicas waits [%(default)s] [PAGEDKV_ALLOCATOR_REDIS_WAIT_TIMEOUT]")
    a("--fair-share-window-ms", **_env("--fair-share-window-ms", 100.0, float), metavar="MS",
      help="per-pool CPU fair share: while pools contend, the pool that used more CPU over about "
           "this long waits for a call of the one that used less (delayed, never refused); 0 = off "
           "[%(default)s] [PAGEDKV_ALLOCATOR_FAIR_SHARE_WINDOW_MS]")
    a("--check", **env_switch("allocator", "--check"),
      help="verify the journal in --state (digests, record chain, step chains, head) without "
           "serving or writing; print what was found; exit 0 if sound, 1 if not "
           "[PAGEDKV_ALLOCATOR_CHECK]")
    a("--log-level", **_env("--log-level", "INFO", log_level), choices=LOG_LEVELS,
      help="any case [%(default)s] [PAGEDKV_ALLOCATOR_LOG_LEVEL]")
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
    from allocator_service.server import ServeOptions

    token = read_secret(args.auth_token_file, "auth token file") if args.auth_token_file else None
    admin = read_secret(args.admin_token_file, "admin token file") if args.admin_token_file else None
    router = read_secret(args.router_token_file, "router token file") if args.router_token_file else None
    tokens = [t for t in (token, admin, router) if t]
    if len(set(tokens)) != len(tokens):
        raise CliError("--auth-token-file, --admin-token-file and --router-token-file must hold different tokens")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together")
    if ":" not in args.listen:
        raise CliError(f"--listen wants HOST:PORT, not {args.listen!r}")
    try:
        if not 1 <= args.max_snapshot_mb <= 512:
            raise ValueError("--max-snapshot-mb must be 1 to 512 (Redis's value limit)")
        config = ServiceConfig(lease_ttl_s=args.lease_ttl, snapshot_every=args.snapshot_every,
                               max_snapshot_bytes=args.max_snapshot_mb << 20,
                               fair_share_window_s=args.fair_share_window_ms / 1e3)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if not (args.state == "memory" or args.state.startswith(("redis://", "rediss://", "unix://"))):
        raise CliError(f"--state must be 'memory' or a redis:// URL, not {args.state!r}")
    if args.redis_wait_replicas < 0 or not args.redis_wait_timeout > 0:
        raise CliError("--redis-wait-replicas must be >= 0 and --redis-wait-timeout positive")
    return ServeOptions(
        listen=args.listen,
        state=args.state,
        metrics_port=args.metrics_port,
        auth_token=token,
        admin_token=admin,
        router_token=router,
        tls_cert=read_file(args.tls_cert, "TLS certificate") if args.tls_cert else None,
        tls_key=read_file(args.tls_key, "TLS key") if args.tls_key else None,
        config=config,
        redis_wait_replicas=args.redis_wait_replicas,
        redis_wait_timeout_s=args.redis_wait_timeout,
    )


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from allocator_service.errors import StoreUnavailable
    from allocator_service.server import check, serve
    from allocator_service.state import CorruptState

    options = options_from_args(args)  # a CliError: exit 2, reported by run_command
    if args.check:
        try:
            return check(options)
        except StoreUnavailable as exc:
            print(f"pagedkv allocator --check: cannot read the state: {exc}", file=sys.stderr)
            return 1
    try:
        return serve(options)
    except CorruptState as exc:
        print(f"pagedkv allocator: cannot start: {exc} (recovery: docs/RELIABILITY.md, "
              "'A journal that cannot be replayed')", file=sys.stderr)
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
