"""Where accepted state changes go before the reply: nowhere (memory) or a
Redis journal with periodic snapshots.

Redis layout, under a key prefix (default `pagedkv:allocator:`):

- `journal`  list of `JournalRecord` bytes, oldest first: the records after
  the snapshot;
- `snapshot` the registry snapshot (JSON) including everything up to its
  `index`;
- `owner`    the id of the server instance allowed to write. A starting
  server takes ownership, so an old instance that is still running (a
  network partition, a slow kill) is fenced off instead of interleaving
  writes.

Each write is ONE round trip: a Lua script that checks ownership and then
RPUSHes the record (or stores the snapshot and empties the journal), which
Redis runs atomically. A step record carries its step id and digest, so the
journal entry and the "last step id" of the pool are the same atomic write.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from allocator_service.errors import StoreUnavailable

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pagedkv:allocator:"

_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED another allocator instance owns this state')
end
return redis.call('RPUSH', KEYS[2], ARGV[2])
"""

_SNAPSHOT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED another allocator instance owns this state')
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
return 1
"""


class MemoryJournal:
    """No durability: the state lives and dies with the process."""

    durable = False

    def load(self, take_ownership: bool = True) -> tuple[dict[str, Any] | None, list[bytes]]:
        return None, []

    def append(self, record: bytes) -> None:
        pass

    def write_snapshot(self, snapshot: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "memory"


class RedisJournal:
    durable = True

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self._redis_errors = redis.exceptions.RedisError
        url, self.prefix = split_prefix(url)
        self.url = url
        # A couple of quick retries ride over a blip; a duplicate RPUSH they
        # might cause is harmless (replay skips a record index it has seen).
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
        )
        self.instance = secrets.token_hex(8)
        self._keys = {k: self.prefix + k for k in ("journal", "snapshot", "owner")}
        self._append = self.client.register_script(_APPEND)
        self._snapshot = self.client.register_script(_SNAPSHOT)

    def describe(self) -> str:
        return f"{self.url} (keys {self.prefix}*)"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as exc:
            raise StoreUnavailable(f"the state store (Redis) failed during {what}: {exc}") from exc

    def load(self, take_ownership: bool = True) -> tuple[dict[str, Any] | None, list[bytes]]:
        """Read the snapshot and the journal after it (one MULTI, so both come
        from the same moment). At start-up the server takes ownership; a
        reload after an error only checks it still has it, so two instances
        never take the state back and forth."""

        def read():
            with self.client.pipeline(transaction=True) as p:
                if take_ownership:
                    p.set(self._keys["owner"], self.instance)
                else:
                    p.get(self._keys["owner"])
                p.get(self._keys["snapshot"])
                p.lrange(self._keys["journal"], 0, -1)
                owner, snap, records = p.execute()
            return owner, snap, records

        owner, snap, records = self._call("load", read)
        if not take_ownership and owner != self.instance.encode():
            raise StoreUnavailable("another allocator instance owns this state now")
        return (json.loads(snap) if snap else None), list(records)

    def append(self, record: bytes) -> None:
        keys = [self._keys["owner"], self._keys["journal"]]
        self._call("journal append", self._append, keys=keys, args=[self.instance, record])

    def write_snapshot(self, snapshot: bytes) -> None:
        """Store a snapshot of everything applied so far and drop the journal
        it includes (the caller holds the lock: nothing was appended since)."""
        keys = [self._keys["owner"], self._keys["snapshot"], self._keys["journal"]]
        self._call("snapshot", self._snapshot, keys=keys, args=[self.instance, snapshot])

    def close(self) -> None:
        self.client.close()


def split_prefix(url: str) -> tuple[str, str]:
    """`redis://h:p/db?key_prefix=x:` -> (`redis://h:p/db`, `x:`)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = DEFAULT_PREFIX
    rest = []
    for k, v in query:
        if k == "key_prefix":
            prefix = v
        else:
            rest.append((k, v))
    return urlunsplit(parts._replace(query=urlencode(rest))), prefix


def open_journal(state: str, timeout_s: float = 2.0) -> MemoryJournal | RedisJournal:
    """`memory` or `redis://host:port/db[?key_prefix=...]`."""
    if state == "memory":
        return MemoryJournal()
    if state.startswith(("redis://", "rediss://", "unix://")):
        return RedisJournal(state, timeout_s)
    raise ValueError(f"--state must be 'memory' or a redis:// URL, not {state!r}")
