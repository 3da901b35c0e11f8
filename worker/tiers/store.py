"""The shared store's backends: bytes by key, shared by the workers of one KV layout.

The allocator's index is the authority on what the store holds (capacity, LRU,
presence); a backend only keeps bytes, so it needs no listing, expiry or
locking: a key is written once per content and deleted best effort.
- `file://PATH`: a directory on one host; an entry is written to a temporary
  file and renamed into place (a reader sees all of it or nothing), under two
  levels of 256 subdirectories (no directory past a few thousand entries).
- `redis://HOST:PORT/DB[?key_prefix=P]` (or rediss://): one string per entry
  under the prefix (default `pagedkv:kv:`); a batch is one pipeline.
`open_store` checks at start that the store answers (`pagedkv_base.store_url`,
the allocator's check too) and says what is wrong in one line
(`StoreOpenError`, a ValueError). Later failures raise `StoreError`; the mover
turns them into misses.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from pagedkv_base.store_url import FILE, StoreOpenError, check_store_url, redis_target, store_kind
from pagedkv_base.store_url import one_line as _one_line

__all__ = ["FileStore", "KVStore", "RedisStore", "StoreError", "StoreOpenError", "open_store"]

Buffer = bytes | bytearray | memoryview
_KEY_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
DEFAULT_REDIS_PREFIX = "pagedkv:kv:"


class StoreError(Exception):
    """The store did not answer or could not do what was asked (I/O, connection)."""


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


def open_store(url: str, timeout_s: float = 1.0) -> KVStore:
    """The store at `url` (`file://PATH` or `redis://HOST:PORT/DB`), checked to answer;
    StoreOpenError (one line) when it cannot be used."""
    check_store_url(url, timeout_s)
    kind, target = store_kind(url)
    return FileStore(target, url) if kind == FILE else RedisStore(url, timeout_s)
