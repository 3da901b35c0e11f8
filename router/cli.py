"""`pagedkv router` / `python -m router`: one OpenAI-style front door for many workers.

Learns the workers from the allocator (each worker registers its pool with
--advertise-url; with pools sharded over several allocators, from each of
them: --allocator A,B,...) and sends each request to the worker whose pool already
holds the most of its prompt, weighed against load (--policy kv); or a
static --workers list. Serves /v1/completions, /v1/chat/completions (server-
sent events passed through as they come), /v1/models, /health and /metrics.
"""

from __future__ import annotations

import argparse
import os

from pagedkv_base.settings import (
    LOG_LEVELS,
    CliError,
    env_default,
    log_level,
    read_secret,
    run_command,
    seconds,
)
from router.policy import POLICIES

CACHE_VIEWS = ("events", "match-prefix")

ENV_HELP = """\
Every flag can also be given as the environment variable PAGEDKV_ROUTER_<FLAG>
(--listen: PAGEDKV_ROUTER_LISTEN, --allocator: PAGEDKV_ROUTER_ALLOCATOR, ...); a
flag wins over its variable. --api-key also reads VLLM_API_KEY when
PAGEDKV_ROUTER_API_KEY is not set.
"""



def _env(flag: str, default=None, type=str) -> dict:
    return env_default("router", flag, default, type)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


_address.__name__ = "HOST:PORT"


def _allocators(text: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]`: each allocator once."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        _address(a)
    if not addresses:
        raise argparse.ArgumentTypeError("expected HOST:PORT[,HOST:PORT...]")
    twice = sorted({a for a in addresses if addresses.count(a) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"allocator {twice[0]} named twice")
    return addresses


_allocators.__name__ = "allocator list"


def _urls(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise argparse.ArgumentTypeError(f"expected http:// or https:// URLs separated by commas, got {bad[0]!r}")
    return urls


_urls.__name__ = "URL list"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", **_env("--listen", "127.0.0.1:8000", _address),
                   help="HOST:PORT to serve the API on (default 127.0.0.1:8000)")
    p.add_argument("--allocator", **_env("--allocator", None, _allocators),
                   help="HOST:PORT of the allocator service: where the live workers and the prefix each "
                        "pool holds come from (without it, --workers is needed and routing uses load alone); "
                        "pools sharded over several allocators: HOST:PORT,HOST:PORT,... (each is followed and "
                        "asked about its own pools)"),
    p.add_argument("--workers", **_env("--workers", None, _urls),
                   help="a static list of worker URLs (http://HOST:PORT,...), instead of or, with "
                        "--allocator, restricting the workers the allocator lists")
    p.add_argument("--model", **_env("--model", "smollm2"),
                   help="the model whose tokenizer and chat template prompts are tokenized with for MatchPrefix, "
                        "as the workers load it: 'tiny-random', 'smollm2', a Hugging Face folder or repo id, a "
                        ".gguf file (default smollm2; not loaded without --allocator)")
    p.add_argument("--policy", **_env("--policy", "kv"), choices=POLICIES,
                   help="kv: most cached prefix weighed against load (2*overlap - usage - waiting); "
                        "least-load; round-robin (default kv)")
    p.add_argument("--cache-view", **_env("--cache-view", "events"), choices=CACHE_VIEWS,
                   help="events: keep the pools' prefix caches in the router from the allocator's block events "
                        "(a snapshot, then every change) and match prompts here, asking MatchPrefix only while "
                        "that copy is not in step; match-prefix: ask MatchPrefix for every request (default "
                        "events; only --policy kv reads the cache)")
    p.add_argument("--router-token-file", **_env("--router-token-file"),
                   help="file holding the allocator's router bearer token (its --router-token-file)")
    p.add_argument("--allocator-tls-ca", **_env("--allocator-tls-ca"),
                   help="CA certificate (PEM) to verify the allocator's TLS certificate")
    p.add_argument("--api-key", **_env("--api-key", os.environ.get("VLLM_API_KEY") or None),
                   help="require `Authorization: Bearer KEY` on every /v1/* route, as a worker does; the "
                        "header is forwarded to the workers either way (env PAGEDKV_ROUTER_API_KEY, else "
                        "VLLM_API_KEY)")
    p.add_argument("--first-byte-timeout", metavar="SECONDS", **_env("--first-byte-timeout", 60.0, seconds),
                   help="a worker that has not answered a request's status in this long is skipped and the "
                        "request sent to another (default 60)")
    p.add_argument("--refresh-interval", metavar="SECONDS", **_env("--refresh-interval", 1.0, seconds),
                   help="list the allocator's pools at least this often, besides on every pool event: their "
                        "free blocks weigh in the kv policy's usage term (MatchPrefix, when asked, gives them "
                        "fresh) (default 1)")
    p.add_argument("--log-level", **_env("--log-level", "INFO", log_level), choices=LOG_LEVELS,
                   help="log level, any case (default INFO)")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("router", help="run the KV-aware router: one OpenAI-style front door for many workers",
                       description=__doc__ + "\n" + ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def build_router(args: argparse.Namespace):
    """The Router (tokenizer loaded, allocator client made), not started."""
    from pagedkv_base.model_files import ModelLoadError, load_tokenizer
    from router.app import Router
    from router.discovery import Discovery, MergedDiscovery
    from router.prefix_view import PrefixView

    if not args.allocator and not args.workers:
        raise CliError("give --allocator HOST:PORT (workers found there) or --workers URL,...")
    token = read_secret(args.router_token_file, "router token file") if args.router_token_file else None
    tokenizer = None
    clients = []
    if args.allocator:
        try:
            # The tokenizer and chat template the worker loads (pagedkv_base.model_files), no
            # weights (only MatchPrefix needs the prompt's tokens: without an allocator, none).
            tokenizer = load_tokenizer(args.model)
        except (ValueError, ModelLoadError, OSError) as exc:
            raise CliError(str(exc)) from None
        from allocator_service.client.grpc_client import RouterClient

        # No retries: a request routes by load alone rather than wait for an allocator that is away.
        clients = [RouterClient(a, router_token=token, tls_ca=args.allocator_tls_ca, deadline_s=2.0, retries=0)
                   for a in args.allocator]
    # The view is only read to rank by cached prefix (`kv`).
    follow_blocks = args.cache_view == "events" and args.policy == "kv"
    parts = [Discovery(c, args.workers or (), refresh_s=args.refresh_interval, index=i,
                       view=PrefixView() if follow_blocks else None) for i, c in enumerate(clients)]
    if len(parts) > 1:
        discovery = MergedDiscovery(parts)
    else:
        discovery = parts[0] if parts else Discovery(None, args.workers or (), refresh_s=args.refresh_interval)
    return Router(tokenizer, discovery, args.policy, allocators=clients,
                  first_byte_timeout=args.first_byte_timeout)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from router.app import create_app

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = build_router(args)
    host, port = args.listen
    app = create_app(router, api_key=args.api_key)
    print(f"router: policy {args.policy}, workers from "
          f"{'the allocator at ' + ','.join(args.allocator) if args.allocator else 'the static list'}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m router`: this command alone, without the `pagedkv` umbrella."""
    parser = argparse.ArgumentParser(prog="pagedkv router", description=__doc__ + "\n" + ENV_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_command("router", run, parser.parse_args(argv))
