"""`pagedkv router` / `python -m router`: one OpenAI-style front door for many workers.

Learns the workers from the allocator (each worker registers its pool with
--advertise-url; with pools sharded over several allocators, from each of
them: --allocator A,B,...) and sends each request to the worker whose pool already
holds the most of its prompt unless its load is too far above another's
(--policy kv); or a
static --workers list. Serves /v1/completions, /v1/chat/completions (server-
sent events passed through as they come), /v1/models, /health and /metrics.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from pagedkv_base.config import add_arguments as add_setting_flags
from pagedkv_base.config import from_args, setting
from pagedkv_base.settings import LOG_LEVELS, CliError, log_level, read_secret, run_command, seconds
from router.policy import POLICIES, Balance

CACHE_VIEWS = ("events", "match-prefix")

ENV_HELP = """\
Every setting is also the environment variable PAGEDKV_ROUTER_<SETTING> (shown
in brackets; some are variables only: see the configuration reference); a
flag wins over its variable. --api-key also reads VLLM_API_KEY when
PAGEDKV_ROUTER_API_KEY is not set.
"""


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


_address.__name__ = "HOST:PORT"


def _allocators(text: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]`: each allocator once; one with standbys
    is its addresses joined by `|` (HOST:PORT|HOST:PORT)."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        for replica in a.split("|"):
            _address(replica.strip())
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
        raise argparse.ArgumentTypeError(
            f"expected http:// or https:// URLs separated by commas, got {bad[0]!r}"
        )
    return urls


_urls.__name__ = "URL list"


@dataclass(frozen=True, slots=True)
class RouterArgs:
    """Every setting of `pagedkv router`: its flags, variables and reference come from here."""

    component: ClassVar[str] = "router"

    listen: tuple[str, int] = setting(
        ("127.0.0.1", 8000),
        "HOST:PORT to serve the API on",
        parse=_address,
        shown_default="127.0.0.1:8000",
    )
    allocator: list[str] | None = setting(
        None,
        "HOST:PORT of the allocator service: where the live workers and the prefix each pool holds "
        "come from (without it, --workers is needed and routing uses load alone); pools sharded "
        "over several allocators: HOST:PORT,HOST:PORT,... (each is followed and asked about its "
        "own pools); an allocator with a hot standby: its addresses joined by |, "
        "HOST:PORT|HOST:PORT (the router follows its leader)",
        parse=_allocators,
    )
    workers: list[str] | None = setting(
        None,
        "a static list of worker URLs (http://HOST:PORT,...), instead of or, with --allocator, "
        "restricting the workers the allocator lists",
        parse=_urls,
    )
    model: str = setting(
        "smollm2",
        "the model whose tokenizer and chat template prompts are tokenized with for MatchPrefix, "
        "as the workers load it: 'tiny-random', 'smollm2', a Hugging Face folder or repo id, a "
        ".gguf file (not loaded without --allocator)",
    )
    policy: str = setting(
        "kv",
        "kv: most cached prefix (less what the placement would evict; at least CACHE_THRESHOLD of "
        "the prompt), else the worker sent the fewest blocks lately that its pool still holds, "
        "unless the worker's requests in flight pass both balance thresholds over the least "
        "loaded's, then least load; least-load; round-robin",
        choices=POLICIES,
        stack=True,
    )
    cache_view: str = setting(
        "events",
        "events: keep the pools' prefix caches in the router from the allocator's block events "
        "(a snapshot, then every change) and match prompts here, asking MatchPrefix only while "
        "that copy is not in step; match-prefix: ask MatchPrefix for "
        "every request (only --policy kv reads the cache)",
        choices=CACHE_VIEWS,
        flag=False,
    )
    router_token_file: str | None = setting(
        None, "file holding the allocator's router bearer token (its --router-token-file)"
    )
    allocator_tls_ca: str | None = setting(
        None, "CA certificate (PEM) to verify the allocator's TLS certificate"
    )
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer KEY` on every /v1/* route, as a worker does, and present "
        "KEY to the workers (give them the same --api-key); "
        "a client's own header is never forwarded",
        fallback_env="VLLM_API_KEY",
    )
    api_keys_file: str | None = setting(
        None,
        "file of API keys, one a line ('#' comments and blank lines skipped): each is accepted as "
        "--api-key is, with or without it; the router presents its first key to the workers with "
        "the client's tenant id (an HMAC of the client's key, "
        "never the key), so give the workers the same keys",
    )
    cache_salt_per_api_key: bool = setting(
        True,
        "behind API keys, match each key's prompts in its own cache, as the workers (with the same "
        "setting) cache them: a request's cache salt is derived from its key and its own "
        "cache_salt; 0 matches in the cache all keys share",
        flag=False,
    )
    max_sequences_per_key: int = setting(
        32,
        "each API key's share: the most sequences (prompts times n) its requests may have in "
        "flight through this router; one more is a 429 with Retry-After, so one client cannot "
        "fill the workers ahead of the others (a larger request is let in alone); applies with "
        "two keys or more; 0: no share",
    )
    first_byte_timeout: float = setting(
        60.0,
        "seconds: a worker that has not answered a request's status in this long is skipped, and "
        "the request sent to another, if the request never reached it; if it did, the client gets "
        "a 504. Also the longest a worker may keep the router waiting for the rest of a whole "
        "answer, or between two events of a stream: past it "
        "the answer ends (a 504 if nothing was passed on yet)",
        parse=seconds,
        flag=False,
    )
    pd_transfer_timeout: float = setting(
        5.0,
        "seconds: a request split between a prefill and a decode worker waits at most this long, "
        "after its prefill leg, for its prompt's blocks to be found in the shared store; past it "
        "the decode worker computes what it does not find",
        parse=seconds,
        flag=False,
    )
    max_answer_mb: int = setting(
        1024,
        "MiB: the largest answer passed on from a worker (a larger one is a 502 when the worker "
        "says its size, else cut there); whole answers over 1 MiB "
        "are passed on as they arrive, never held whole",
        flag=False,
    )
    header_timeout: float = setting(
        10.0,
        "seconds: a client's request head (line and headers) must arrive within this long of its "
        "connection opening, or of the last answer on a "
        "kept-alive one; else the connection is closed",
        parse=seconds,
        flag=False,
    )
    body_timeout: float = setting(
        60.0,
        "seconds: a request's body must arrive within this long after its head; else the "
        "connection is closed",
        parse=seconds,
        flag=False,
    )
    max_connections: int = setting(
        4096,
        "connections and requests in progress at once; past it a request is answered 503 at once",
        flag=False,
    )
    refresh_interval: float = setting(
        1.0,
        "seconds: list the allocator's pools at least this often, besides on every pool event: "
        "their free blocks weigh in the kv policy's usage term "
        "(MatchPrefix, when asked, gives them fresh)",
        parse=seconds,
        flag=False,
    )
    balance_abs_threshold: int = setting(
        Balance().abs_threshold,
        "kv: a worker is overloaded when its requests in flight exceed the least loaded "
        "worker's by more than this AND by more than the relative threshold; an overloaded worker "
        "gets a request only when every worker is (below both, a prefix stays where it is cached)",
        flag=False,
    )
    balance_rel_threshold: float = setting(
        Balance().rel_threshold,
        "kv: the relative balance threshold: a worker is overloaded only when its requests in "
        "flight are also more than this many times the least loaded worker's",
        flag=False,
    )
    cache_threshold: float = setting(
        Balance().cache_threshold,
        "kv: the least share of a prompt (0 to 1) a worker's cached prefix must "
        "cover to draw the request; a smaller match counts "
        "as none and the request goes by room and load",
        flag=False,
    )
    log_level: str = setting("INFO", "log level, any case", parse=log_level, choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("the balance thresholds are at least 0 (absolute) and 1 (relative)")
        if self.max_sequences_per_key < 0:
            raise ValueError("--max-sequences-per-key is a count of sequences, at least 0")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("the cache threshold is a share of the prompt, from 0 to 1")
        if not self.allocator and not self.workers:
            raise ValueError(
                "give --allocator HOST:PORT (workers found there) or --workers URL,..."
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p, RouterArgs)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "router",
        help="run the KV-aware router: one OpenAI-style front door for many workers",
        description=__doc__ + "\n" + ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def build_router(args: argparse.Namespace):
    """The Router (tokenizer loaded, allocator client made), not started."""
    from pagedkv_base.api.tenants import api_keys
    from pagedkv_base.model_files import ModelLoadError, load_tokenizer
    from router.app import Router
    from router.discovery import Discovery, MergedDiscovery
    from router.prefix_view import PrefixView
    from router.shares import KeyShares

    r = from_args(RouterArgs, args)
    token = read_secret(r.router_token_file, "router token file") if r.router_token_file else None
    tokenizer = None
    clients = []
    if r.allocator:
        try:
            # The tokenizer and chat template the worker loads (pagedkv_base.model_files), no
            # weights (only MatchPrefix needs the prompt's tokens: without an allocator, none).
            tokenizer = load_tokenizer(r.model)
        except (ValueError, ModelLoadError, OSError) as exc:
            raise CliError(str(exc)) from None
        from allocator_service.client.router_client import RouterClient

        # No retries: a request routes by load alone rather than wait for an allocator that is away.
        clients = [
            RouterClient(
                a, router_token=token, tls_ca=r.allocator_tls_ca, deadline_s=2.0, retries=0
            )
            for a in r.allocator
        ]
    # The view is only read to rank by cached prefix (`kv`).
    follow_blocks = r.cache_view == "events" and r.policy == "kv"
    parts = [
        Discovery(
            c,
            r.workers or (),
            refresh_s=r.refresh_interval,
            index=i,
            view=PrefixView() if follow_blocks else None,
        )
        for i, c in enumerate(clients)
    ]
    if len(parts) > 1:
        discovery = MergedDiscovery(parts)
    else:
        discovery = (
            parts[0] if parts else Discovery(None, r.workers or (), refresh_s=r.refresh_interval)
        )
    keys = api_keys(r.api_key, r.api_keys_file)
    return Router(
        tokenizer,
        discovery,
        r.policy,
        allocators=clients,
        first_byte_timeout=r.first_byte_timeout,
        transfer_timeout=r.pd_transfer_timeout,
        max_answer_bytes=r.max_answer_mb << 20,
        worker_api_key=next(iter(keys), None),
        shares=KeyShares(r.max_sequences_per_key, len(keys)),
        cache_salt_per_api_key=r.cache_salt_per_api_key,
        balance=Balance(r.balance_abs_threshold, r.balance_rel_threshold, r.cache_threshold),
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from pagedkv_base.api.serving import serve, serve_options
    from pagedkv_base.api.tenants import api_keys
    from router.routes import create_app

    r = from_args(RouterArgs, args)
    logging.basicConfig(level=r.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = build_router(args)
    host, port = r.listen
    app = create_app(router, api_key=api_keys(r.api_key, r.api_keys_file))
    print(
        f"router: policy {r.policy}, workers from "
        f"{'the allocator at ' + ','.join(r.allocator) if r.allocator else 'the static list'}",
        flush=True,
    )
    serve(
        app,
        host,
        port,
        log_level=r.log_level.lower(),
        **serve_options(
            header_timeout=r.header_timeout,
            body_timeout=r.body_timeout,
            max_connections=r.max_connections,
        ),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m router`: this command alone, without the `pagedkv` umbrella."""
    parser = argparse.ArgumentParser(
        prog="pagedkv router",
        description=__doc__ + "\n" + ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_command("router", run, parser.parse_args(argv))
