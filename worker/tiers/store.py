"""The shared store's backends: bytes by key, shared by the workers of one KV layout.

The allocator's index is the authority on what the store holds (capacity, LRU,
presence); a backend only keeps bytes, so it needs no listing, expiry or
locking: a key is written once per content and deleted best effort.
- `file://PATH`: a directory on one host; an entry is written to a temporary
  file and renamed into place (a reader sees all of it or nothing), under two
  levels of 256 subdirectories (no directory past a few thousand entries).
- `redis://HOST:PORT/DB[?key_prefix=P]` (or rediss://): one string per entry
  under the prefix (default `pagedkv:kv:`); a batch is one pipeline.
- `peer://`: no shared place (`PeerStore`). A worker keeps the entries it
  writes in its own memory (at most the store's capacity, least recently
  used dropped first) and serves them on its peer route; a reader pulls an
  entry from the worker the allocator names as its writer (`fetch`), one
  POST per writer and step, all of a step's within its pull timeout. The
  bytes are the same entries (`entry.py`), so a reader checks them as it
  checks any store's.
`open_store` checks at start that the store answers (`pagedkv_base.store_url`,
the allocator's check too) and says what is wrong in one line
(`StoreOpenError`, a ValueError). Later failures raise `StoreError`; the mover
turns them into misses.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedkv_base.store_url import (
    FILE,
    PEER,
    StoreOpenError,
    check_store_url,
    redis_target,
    store_kind,
)
from pagedkv_base.store_url import one_line as _one_line

__all__ = [
    "FileStore",
    "KVStore",
    "PeerStore",
    "PullTimeSpent",
    "RedisStore",
    "StoreError",
    "StoreOpenError",
    "open_store",
]

Buffer = bytes | bytearray | memoryview
_KEY_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
DEFAULT_REDIS_PREFIX = "pagedkv:kv:"


class StoreError(Exception):
    """The store did not answer or could not do what was asked (I/O, connection)."""


class PullTimeSpent(StoreError):
    """A peer store's writer not asked: the step's pull deadline had passed."""


class KVStore(ABC):
    """Bytes by key. `get` of an absent key is None; `delete` of one is no error."""

    url: str

    @abstractmethod
    def put(self, key: str, data: Buffer) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        for key, data in items:
            self.put(key, data)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)

    def close(self) -> None:  # noqa: B027 - a backend without resources has nothing to close
        pass

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key):
        raise ValueError(f"a store key is 1-200 of [A-Za-z0-9._-], got {key!r}")
    return key


class FileStore(KVStore):
    """Entries as files under `root` (see the module docstring)."""

    def __init__(self, root: str | Path, url: str | None = None) -> None:
        self.root = Path(root)
        self.url = url or f"file://{self.root}"

    def _path(self, key: str) -> Path:
        fan = hashlib.blake2b(_check_key(key).encode(), digest_size=2).hexdigest()
        return self.root / fan[:2] / fan[2:] / key

    def put(self, key: str, data: Buffer) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old entry, the new one, or none
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{self.url}: cannot write {key[:24]}... ({_one_line(exc)})") from exc

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot read {key[:24]}... ({_one_line(exc)})") from exc

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot delete {key[:24]}... ({_one_line(exc)})") from exc


class RedisStore(KVStore):
    """Entries as Redis strings under `prefix`; the `*_many` calls are one pipeline each."""

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        rest, prefix = redis_target(url)
        self.prefix = prefix if prefix is not None else DEFAULT_REDIS_PREFIX
        self._errors = (redis.RedisError, OSError)
        try:
            # No retries: a store that does not answer is a miss now; the mover tries again later.
            self._client = redis.Redis.from_url(
                rest,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as exc:
            raise StoreOpenError(f"shared store {url}: {_one_line(exc)}") from exc

    def _k(self, key: str) -> str:
        return self.prefix + _check_key(key)

    def _fail(self, what: str, exc: BaseException) -> StoreError:
        return StoreError(f"{self.url}: {what} failed ({_one_line(exc)})")

    def put(self, key: str, data: Buffer) -> None:
        self.put_many([(key, data)])

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        if not items:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, data in items:
                pipe.set(self._k(key), data)
            pipe.execute()
        except self._errors as exc:
            raise self._fail("SET", exc) from exc

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            return list(self._client.mget([self._k(key) for key in keys]))
        except self._errors as exc:
            raise self._fail("MGET", exc) from exc

    def delete_many(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            self._client.unlink(*[self._k(key) for key in keys])
        except self._errors as exc:
            raise self._fail("UNLINK", exc) from exc

    def close(self) -> None:
        self._client.close()


PEER_ROUTE = "/internal/kv/entries"  # the worker's route that serves its peer store's entries
MAX_PEER_KEYS = 4096  # keys in one pull
_ABSENT = 0  # a pulled entry's frame: a u64 of its length + 1, 0 for absent


def frame_entries(entries: Sequence[bytes | None]) -> bytes:
    """A peer route's answer: per key asked, in order, its entry or nothing."""
    out = bytearray()
    for data in entries:
        out += struct.pack(">Q", _ABSENT if data is None else len(data) + 1)
        if data is not None:
            out += data
    return bytes(out)


def unframe_entries(body: bytes, count: int) -> list[bytes | None]:
    """The entries of a peer route's answer to `count` keys; StoreError when
    it is not `count` frames exactly."""
    out: list[bytes | None] = []
    view, at = memoryview(body), 0
    for _ in range(count):
        if at + 8 > len(view):
            raise StoreError("a peer's answer is cut short")
        (n,) = struct.unpack_from(">Q", view, at)
        at += 8
        if n == _ABSENT:
            out.append(None)
            continue
        if at + n - 1 > len(view):
            raise StoreError("a peer's answer is cut short")
        out.append(bytes(view[at : at + n - 1]))
        at += n - 1
    if at != len(view):
        raise StoreError("a peer's answer has bytes past its entries")
    return out


class PeerStore(KVStore):
    """A `peer://` store (module docstring): this worker's entries in memory, at
    most `capacity_bytes` (least recently written or read dropped first), served
    to whoever presents `peer_key` (`serve`), and other workers' entries pulled
    from them (`fetch`). `own_url`: where others reach this worker (its
    advertised URL); a load naming it is read here. `pull_timeout_s`: the
    most one step's pulls take, all writers together (the mover's deadline).
    `on_served(entries, bytes)`: told of each answer served."""

    url = "peer://"

    def __init__(
        self, own_url: str, peer_key: str, capacity_bytes: int, pull_timeout_s: float = 1.0
    ) -> None:
        import httpx

        self.own_url = own_url.rstrip("/")
        self.peer_key = peer_key
        self.capacity_bytes = capacity_bytes
        self.pull_timeout_s = pull_timeout_s
        self.on_served: Callable[[int, int], None] | None = None
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._errors = (httpx.HTTPError, OSError)
        self._client = httpx.Client(timeout=pull_timeout_s)

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key: str, data: Buffer) -> None:
        entry = bytes(data)
        with self._lock:
            old = self._entries.pop(_check_key(key), None)
            if old is not None:
                self._used -= len(old)
            if len(entry) > self.capacity_bytes:
                return  # never held: a reader's pull finds it missing
            self._entries[key] = entry
            self._used += len(entry)
            while self._used > self.capacity_bytes:
                self._used -= len(self._entries.popitem(last=False)[1])

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def delete(self, key: str) -> None:
        with self._lock:
            data = self._entries.pop(key, None)
            if data is not None:
                self._used -= len(data)

    def authorized(self, authorization: str | None) -> bool:
        """Whether a peer route's caller presented this store group's key."""
        token = (authorization or "").removeprefix("Bearer ")
        return bool(self.peer_key) and hmac.compare_digest(token.encode(), self.peer_key.encode())

    def serve(self, keys: Sequence[str]) -> bytes:
        """The answer to a pull of `keys`; ValueError for a key that is not
        one, or more than MAX_PEER_KEYS of them."""
        if not 0 < len(keys) <= MAX_PEER_KEYS:
            raise ValueError(f"a pull asks for 1 to {MAX_PEER_KEYS} keys, one a line")
        for key in keys:
            _check_key(key)
        entries = self.get_many(keys)
        body = frame_entries(entries)
        if self.on_served is not None:
            self.on_served(sum(e is not None for e in entries), len(body) - 8 * len(keys))
        return body

    def fetch(self, source: str, keys: Sequence[str], deadline: float) -> list[bytes | None]:
        """The entries of `keys` from the worker at `source` (this one's own
        memory when it is this worker): None for one it does not hold;
        StoreError when its whole answer has not come by `deadline`
        (`time.monotonic()`), or it answers anything but the entries asked for."""
        source = source.rstrip("/")
        if not source or source == self.own_url:
            return self.get_many(keys)
        left = deadline - time.monotonic()
        if left <= 0:
            raise PullTimeSpent(f"peer {source}: not asked, the step's pull time is spent")
        body = bytearray()
        try:
            with self._client.stream(
                "POST",
                source + PEER_ROUTE,
                content="\n".join(keys).encode(),
                headers={"Authorization": f"Bearer {self.peer_key}"},
                timeout=left,
            ) as r:
                if r.status_code != 200:
                    raise StoreError(f"peer {source}: answered {r.status_code}")
                for chunk in r.iter_bytes():  # each read within `left`, the whole by the deadline
                    body += chunk
                    if time.monotonic() > deadline:
                        raise StoreError(
                            f"peer {source}: no whole answer within {self.pull_timeout_s:g} s"
                        )
        except self._errors as exc:
            raise StoreError(f"peer {source}: no answer ({_one_line(exc)})") from exc
        return unframe_entries(bytes(body), len(keys))

    def close(self) -> None:
        self._client.close()


def open_store(
    url: str,
    timeout_s: float = 1.0,
    *,
    own_url: str = "",
    peer_key: str = "",
    capacity: int = 0,
    pull_timeout_s: float = 1.0,
) -> KVStore:
    """The store at `url` (`file://PATH`, `redis://HOST:PORT/DB` or `peer://`),
    checked to answer; StoreOpenError (one line) when it cannot be used. A peer
    store: this worker's `own_url`, its group's `peer_key` and the store's
    `capacity` in bytes, from the allocator, and `pull_timeout_s`."""
    check_store_url(url, timeout_s)
    kind, target = store_kind(url)
    if kind == PEER:
        if not own_url or not peer_key or capacity <= 0:
            raise StoreOpenError(
                "shared store peer://: this worker needs an advertised URL (--advertise-url) "
                "and the allocator's peer key and store size"
            )
        return PeerStore(own_url, peer_key, capacity, pull_timeout_s)
    return FileStore(target, url) if kind == FILE else RedisStore(url, timeout_s)
