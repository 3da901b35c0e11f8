"""The shared KV store's URL: its one check, for the allocator that owns the
store (`--kv-shared-store`) and the worker that opens it.

- `file://PATH`: a directory this process can write entries into;
- `redis://HOST:PORT/DB[?key_prefix=P]` (or rediss://): a Redis that answers PING;
- `peer://`: no shared place: each entry stays in the memory of the worker
  that wrote it, and readers pull it from that worker (docs/architecture.md,
  "Prefill and decode on separate workers").

`check_store_url` says what is wrong in one line (`StoreOpenError`, a
ValueError): an unknown kind, no path, a path it cannot write, a Redis that
does not answer.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

FILE, REDIS, PEER = "file", "redis", "peer"
PEER_URL = "peer://"
_REDIS_SCHEMES = ("redis://", "rediss://")


class StoreOpenError(ValueError):
    """A store URL that cannot be used: unknown kind, unwritable path, unreachable Redis."""


def one_line(exc: BaseException) -> str:
    """An exception as one line of text."""
    text = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def store_kind(url: str) -> tuple[str, str]:
    """(FILE, directory), (REDIS, url) or (PEER, ""); StoreOpenError for anything else."""
    if url.startswith("file://"):
        path = url.removeprefix("file://")
        if not path:
            raise StoreOpenError(
                f"shared store {url!r}: give a directory, e.g. file:///dev/shm/pagedkv"
            )
        return FILE, path
    if url.startswith(_REDIS_SCHEMES):
        return REDIS, url
    if url.startswith(PEER_URL):
        if url != PEER_URL:
            raise StoreOpenError(
                f"shared store {url!r}: peer:// takes nothing after it (entries stay with "
                "their writer, readers pull them from its advertised URL)"
            )
        return PEER, ""
    raise StoreOpenError(
        f"shared store {url!r}: unknown kind; use file://PATH, redis://HOST:PORT/DB or peer://"
    )


def is_peer(url: str) -> bool:
    """Whether `url` names the peer store (entries pulled from their writer)."""
    return url == PEER_URL


def redis_target(url: str) -> tuple[str, str | None]:
    """(the URL without `key_prefix`, the prefix given or None)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = next((v for k, v in query if k == "key_prefix"), None)
    return urlunsplit(
        parts._replace(query=urlencode([(k, v) for k, v in query if k != "key_prefix"]))
    ), prefix


def probe_directory(root: Path, url: str) -> None:
    """StoreOpenError unless `root` is a directory this process can write entries into."""
    probe = root / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"pagedkv")
        probe.unlink()
    except OSError as exc:
        raise StoreOpenError(
            f"shared store {url}: cannot write to {root} ({one_line(exc)})"
        ) from exc


def check_store_url(url: str, timeout_s: float = 1.0) -> None:
    """StoreOpenError (one line) unless the store at `url` can be used now."""
    kind, target = store_kind(url)
    if kind == PEER:
        return  # nothing to reach: each worker holds its own entries
    if kind == FILE:
        probe_directory(Path(target), url)
        return
    import redis

    try:
        client = redis.Redis.from_url(
            redis_target(url)[0], socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
    except ValueError as exc:
        raise StoreOpenError(f"shared store {url}: {one_line(exc)}") from exc
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        raise StoreOpenError(f"shared store {url}: unreachable ({one_line(exc)})") from exc
    finally:
        client.close()
