"""Where accepted state changes go before the reply: nowhere (memory) or a
Redis journal with periodic snapshots.

Redis layout, under a key prefix (default `pagedkv:allocator:`):

- `journal`  list of framed `JournalRecord`s, oldest first: the records
  after the snapshot (the frame and its chained digest: `encode_entry`);
- `snapshot` the registry snapshot including everything up to its `index`;
- `head`     `<index>:<chain digest hex>` of the last record written (or of
  the snapshot when the journal is empty), set in the same atomic write as
  the record: a journal shorter than its head lost its tail;
- `owner`    the fencing token of the one instance allowed to write,
  `EPOCH:INSTANCE`: a claim (`claim`) takes the next `epoch` and sets it,
  so an old instance that is still running (a network partition, a slow
  kill, a SIGSTOP past its lease) is fenced off instead of interleaving
  writes;
- `epoch`    the last fencing epoch issued (INCR by every claim);
- `leader`   the leader lease: `TOKEN ADDRESS`, expiring after the lease
  time (PX) unless its leader renews it (`renew`). A standby claims the
  state when it is gone (`store/leader.py`); a start without `--standby`
  claims it at once (`force`).

Each write is ONE round trip: a Lua script that checks ownership (the
writer's token, its fencing epoch included, must be the owner key's) and the
head, then RPUSHes the record and moves the head (or stores the snapshot and
empties the journal), which Redis runs atomically. The script tells apart
"another instance owns this state" (FENCED: the owner key names another
token: a later epoch claimed it) from "Redis lost what we wrote" (LOST: the owner key is gone, or
the head is not the one this instance wrote last): a flush, evicted keys, a
restart without its data or a failover to a lagging replica. A write whose
head already is the one it would set is a retried call that landed: it is
not pushed twice.

This module stores bytes; framing them is `framing.py`, replaying them
`replay.py`, what they mean `registry.py`.
"""

from __future__ import annotations

import logging
import secrets
from typing import NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from allocator_service.wire.errors import (
    StoreFenced,
    StoreLost,
    StoreMisconfigured,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pagedkv:allocator:"


# ------------------------------------------------------------- the stores

_CHECK = """
local owner = redis.call('GET', KEYS[1])
if not owner then
  return redis.error_reply('LOST the allocator state keys are gone from Redis '
    .. '(flushed, evicted, or a Redis without its data)')
end
if owner ~= ARGV[1] then
  return redis.error_reply('FENCED another allocator instance owns this state')
end
local head = redis.call('GET', KEYS[2]) or ''
"""

# KEYS owner head journal; ARGV instance entry prev_head new_head
_APPEND = (
    _CHECK
    + """
if head == ARGV[4] then return 0 end
if head ~= ARGV[3] then
  return redis.error_reply('LOST the journal head in Redis is ' .. head
    .. ', this instance wrote ' .. ARGV[3] .. ' last (Redis lost records)')
end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('SET', KEYS[2], ARGV[4])
return 1
"""
)

# A snapshot taken off the hot path includes the records up to one whose
# chain digest it names; records appended meanwhile stay. Find that record
# (at the expected position, else by a scan), store the snapshot and trim the
# journal up to it, in one step; 0 if the journal no longer holds it.
# KEYS owner head snapshot journal; ARGV instance snapshot position_hint chain
_SNAPSHOT = (
    _CHECK
    + """
local function covers(e)
  local magic = e and string.sub(e, 1, 4)
  return (magic == 'PKJ2' or magic == 'PKJ3') and string.sub(e, 37, 68) == ARGV[4]
end
local pos = tonumber(ARGV[3])
if pos < 1 or not covers(redis.call('LINDEX', KEYS[4], pos - 1)) then
  pos = 0
  local n = redis.call('LLEN', KEYS[4])
  for i = 1, n do
    if covers(redis.call('LINDEX', KEYS[4], i - 1)) then pos = i break end
  end
  if pos == 0 then return 0 end
end
redis.call('SET', KEYS[3], ARGV[2])
redis.call('LTRIM', KEYS[4], pos, -1)
return 1
"""
)

# A new history from a snapshot: after a replay that repaired damage, or
# after Redis lost the state. Takes the owner key back only if it is this
# instance's or gone. KEYS owner head snapshot journal; ARGV instance snapshot head
_RESEED = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
  return redis.error_reply('FENCED another allocator instance owns this state')
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""


# Take the state: the next fencing epoch, the owner key and the leader lease,
# unless another leader's lease is alive (and not `force`, nor the lease value
# ARGV[5]: the one of a leader seen gone).
# KEYS owner leader epoch; ARGV instance address lease_ms force gone
_CLAIM = """
local current = redis.call('GET', KEYS[2])
if current and ARGV[4] ~= '1' and current ~= ARGV[5] then return {0, current} end
local token = redis.call('INCR', KEYS[3]) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token)
redis.call('SET', KEYS[2], token .. ' ' .. ARGV[2], 'PX', ARGV[3])
return {1, token}
"""

# What each instance's Redis connections are named: CLIENT_NAME + its instance id.
CLIENT_NAME = "pagedkv-allocator-"

# Keep the lease: 1 renewed (or set again: it ran out but nobody claimed the
# state since), 0 deposed (another token owns the state or holds the lease),
# -1 the owner key is gone (Redis lost the state: the next write says LOST).
# KEYS owner leader; ARGV token address lease_ms
_RENEW = """
local mine = ARGV[1] .. ' ' .. ARGV[2]
local current = redis.call('GET', KEYS[2])
if current == mine then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
local owner = redis.call('GET', KEYS[1])
if current then return 0 end
if not owner then return -1 end
if owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], mine, 'PX', ARGV[3])
return 1
"""

# Give the lease up (a leader that stops): a standby takes over at once.
# KEYS leader; ARGV token address
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] .. ' ' .. ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A standby's look at the store: the head, the leader lease, and the journal
# entries after record ARGV[1], or false for them when the journal no longer
# holds the next one (a snapshot trimmed past it, a reseed, a store that lost
# records: the caller loads the whole state again).
# KEYS head journal leader; ARGV index
_TAIL = """
local head = redis.call('GET', KEYS[1]) or ''
local leader = redis.call('GET', KEYS[3]) or ''
local last = tonumber(string.match(head, '^(%d+):')) or 0
local n = redis.call('LLEN', KEYS[2])
local after = tonumber(ARGV[1])
local from = after - (last - n)
if from < 0 or after > last then return {head, leader, last - n, false} end
return {head, leader, last - n, redis.call('LRANGE', KEYS[2], from, -1)}
"""


class Tail(NamedTuple):
    """What a standby reads (`RedisJournal.tail`): the head marker, the
    leader lease's value (empty: nobody holds it) and the entries after the
    standby's last record (None: load the whole state again)."""

    head: bytes
    leader: str
    base: int  # the record the journal's first entry follows (the snapshot's)
    entries: list[bytes] | None


class Loaded(NamedTuple):
    """What a store holds: the snapshot blob, the journal's entries after
    it, and the head marker (None where absent)."""

    snapshot: bytes | None
    entries: list[bytes]
    head: bytes | None


class MemoryJournal:
    """No durability: the state lives and dies with the process."""

    durable = False
    address = ""  # no leader lease: the one instance serves
    lease_s = 0.0
    token = ""

    def load(self, take_ownership: bool = True, check_owner: bool = True) -> Loaded:
        return Loaded(None, [], None)

    def append(self, entry: bytes, prev_head: bytes, new_head: bytes) -> None:
        pass

    def write_snapshot(self, snapshot: bytes, hint: int, chain: bytes) -> bool:
        return True

    def reseed(self, snapshot: bytes, head: bytes) -> None:
        pass

    def probe(self, head: bytes) -> None:
        pass

    def claim(self, force: bool) -> bool:
        return True  # the only instance there is

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "memory"


class RedisJournal:
    durable = True

    def __init__(
        self,
        url: str,
        timeout_s: float = 2.0,
        wait_replicas: int = 0,
        wait_timeout_s: float = 1.0,
        address: str = "",
        lease_s: float = 1.0,
    ) -> None:
        """`address`: where this instance serves (the leader lease names it,
        so a standby can send clients there); `lease_s`: the leader lease."""
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self._redis_errors = redis.exceptions.RedisError
        url, self.prefix = split_prefix(url)
        self.url = url
        # A couple of quick retries ride over a blip; a retried write that
        # had landed finds the head it would set and is not pushed twice.
        self.instance = secrets.token_hex(8)
        self.client = redis_client(
            url,
            socket_timeout=timeout_s + wait_timeout_s if wait_replicas else timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
            # named, so a standby can see that this instance's connections are gone (`connected`)
            client_name=CLIENT_NAME + self.instance,
        )
        # The fencing token every write carries (`EPOCH:INSTANCE`, set by `claim`):
        # until it claims the state, this instance writes nothing.
        self.token = ""
        self.address = address
        self.lease_s = lease_s
        self.leader = ""  # the leader lease's value as last read: `TOKEN ADDRESS`
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        self._keys = {
            k: self.prefix + k for k in ("journal", "snapshot", "owner", "head", "leader", "epoch")
        }
        self._append = self.client.register_script(_APPEND)
        self._claim = self.client.register_script(_CLAIM)
        self._renew = self.client.register_script(_RENEW)
        self._tail = self.client.register_script(_TAIL)
        self._release = self.client.register_script(_RELEASE)
        self._snapshot = self.client.register_script(_SNAPSHOT)
        self._reseed = self.client.register_script(_RESEED)

    def describe(self) -> str:
        return f"{self.url} (keys {self.prefix}*)"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as exc:
            text = str(exc)
            if text.startswith("LOST "):
                raise StoreLost(f"during {what}: {text[5:]}") from exc
            if text.startswith("FENCED "):
                raise StoreFenced(f"fenced during {what}: {text[7:]}") from exc
            raise StoreUnavailable(f"the state store (Redis) failed during {what}: {exc}") from exc

    def _replicated(self, what: str) -> None:
        """With `wait_replicas`: block until that many replicas hold every
        write so far (Redis WAIT), else StoreUnavailable (the write is on the
        primary only: its outcome is treated as unknown)."""
        if not self.wait_replicas:
            return
        timeout_ms = max(1, int(self.wait_timeout_s * 1000))
        acked = self._call(f"{what} (WAIT)", self.client.wait, self.wait_replicas, timeout_ms)
        if acked < self.wait_replicas:
            raise StoreUnavailable(
                f"only {acked} of {self.wait_replicas} Redis replicas acknowledged the {what} "
                f"within {self.wait_timeout_s:g} s"
            )

    def check_config(self) -> None:
        """Refuse a Redis that may evict journal keys. A Redis that hides
        CONFIG (managed services rename it) gets a warning."""
        try:
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except self._redis_errors as exc:
            if "unknown command" in str(exc).lower() or "no permission" in str(exc).lower():
                log.warning(
                    "cannot read Redis maxmemory-policy (%s); make sure it is noeviction", exc
                )
                return
            raise StoreUnavailable(f"the state store (Redis) failed during start: {exc}") from exc
        if policy is not None and policy != "noeviction":
            raise StoreMisconfigured(
                f"Redis at {self.url} has maxmemory-policy {policy!r}: it may evict journal "
                "records; set it to noeviction (CONFIG SET "
                "maxmemory-policy noeviction) or use another Redis"
            )

    def claim(self, force: bool, gone: str = "") -> bool:
        """Take the state (the next fencing epoch, the owner key and the
        leader lease, naming this instance's address) unless another
        leader's lease is alive and not `force`, nor still `gone` (the lease
        value of a leader whose connections are gone: `connected`): then
        False, and `leader` says who holds it. On success every later write
        carries the new token."""
        self.check_config()
        keys = [self._keys["owner"], self._keys["leader"], self._keys["epoch"]]
        took, value = self._call(
            "claim",
            self._claim,
            keys=keys,
            args=[self.instance, self.address, self._lease_ms(), int(force), gone],
        )
        if not took:
            self.leader = value.decode(errors="replace")
            return False
        self.token = value.decode()
        self.leader = f"{self.token} {self.address}"
        return True

    def renew(self) -> int:
        """Keep the lease: 1 kept, 0 deposed (another instance claimed the
        state), -1 the owner key is gone (a store that lost the state)."""
        keys = [self._keys["owner"], self._keys["leader"]]
        return int(
            self._call(
                "lease renewal",
                self._renew,
                keys=keys,
                args=[self.token, self.address, self._lease_ms()],
            )
        )

    def connected(self, instance: str) -> bool | None:
        """Whether the allocator `instance` has a connection to Redis open
        (CLIENT LIST); None when Redis does not tell (CLIENT not allowed).
        A process that died (SIGKILL, a crash) has none: its kernel closed
        them. A stopped one (SIGSTOP) keeps them."""
        try:
            clients = self.client.client_list(_type="normal")
        except self._redis_errors as exc:
            if "unknown command" in str(exc).lower() or "permission" in str(exc).lower():
                return None
            raise StoreUnavailable(
                f"the state store (Redis) failed during client list: {exc}"
            ) from exc
        return any(c.get("name") == CLIENT_NAME + instance for c in clients)

    def release(self) -> None:
        """Give the leader lease up, if this instance holds it (a leader that
        stops): a standby claims the state at its next look, not after the lease."""
        if self.token:
            self._call(
                "lease release",
                self._release,
                keys=[self._keys["leader"]],
                args=[self.token, self.address],
            )

    def _lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    def tail(self, index: int) -> Tail:
        """A standby's look at the store (one round trip): the head, the
        leader lease and the entries after record `index`."""
        keys = [self._keys["head"], self._keys["journal"], self._keys["leader"]]
        head, leader, base, entries = self._call(
            "journal tail", self._tail, keys=keys, args=[index]
        )
        return Tail(
            head or b"",
            (leader or b"").decode(errors="replace"),
            int(base),
            None if entries is None else list(entries),
        )

    def load(self, take_ownership: bool = True, check_owner: bool = True) -> Loaded:
        """Read the snapshot, the journal after it and the head (one MULTI,
        so all come from the same moment). At start-up the server claims
        the state first (`claim`, forced: a start without a standby takes
        it); a reload after an error only checks it still owns it, so two
        instances never take the state back and forth; `check_owner` False
        only reads (`--check`, a standby)."""
        if take_ownership:
            self.claim(force=True)

        def read():
            with self.client.pipeline(transaction=True) as p:
                p.get(self._keys["owner"])
                p.get(self._keys["snapshot"])
                p.lrange(self._keys["journal"], 0, -1)
                p.get(self._keys["head"])
                return p.execute()

        owner, snap, records, head = self._call("load", read)
        if check_owner:
            if owner is None:
                raise StoreLost("during reload: the allocator state keys are gone from Redis")
            if owner != self.token.encode():
                raise StoreFenced("another allocator instance owns this state now")
            self._replicated("journal")
        return Loaded(snap, list(records), head)

    def append(self, entry: bytes, prev_head: bytes, new_head: bytes) -> None:
        keys = [self._keys["owner"], self._keys["head"], self._keys["journal"]]
        self._call(
            "journal append", self._append, keys=keys, args=[self.token, entry, prev_head, new_head]
        )
        self._replicated("journal record")

    def write_snapshot(self, snapshot: bytes, hint: int, chain: bytes) -> bool:
        """Store a snapshot that includes the journal up to the record whose
        chain digest is `chain` (expected at position `hint`, counting from
        1) and drop those records; later ones stay. False (nothing written)
        if the journal no longer holds that record."""
        keys = [
            self._keys["owner"],
            self._keys["head"],
            self._keys["snapshot"],
            self._keys["journal"],
        ]
        done = self._call(
            "snapshot", self._snapshot, keys=keys, args=[self.token, snapshot, hint, chain]
        )
        if done:
            self._replicated("snapshot")
        return bool(done)

    def reseed(self, snapshot: bytes, head: bytes) -> None:
        """Replace the whole stored state by this snapshot (and take the
        owner key back if it is gone)."""
        keys = [
            self._keys["owner"],
            self._keys["head"],
            self._keys["snapshot"],
            self._keys["journal"],
        ]
        self._call("reseed", self._reseed, keys=keys, args=[self.token, snapshot, head])
        self._replicated("snapshot")

    def probe(self, head: bytes) -> None:
        """Is the store still ours and whole? StoreLost, StoreFenced or
        StoreUnavailable if not (one round trip, no write)."""

        def read():
            with self.client.pipeline(transaction=False) as p:
                p.get(self._keys["owner"])
                p.get(self._keys["head"])
                return p.execute()

        owner, stored = self._call("health check", read)
        if owner is None:
            raise StoreLost(
                "the allocator state keys are gone from Redis "
                "(flushed, evicted, or a Redis without its data)"
            )
        if owner != self.token.encode():
            raise StoreFenced("another allocator instance owns this state")
        if (stored or b"") != head:
            raise StoreLost(
                f"the journal head in Redis is {(stored or b'').decode(errors='replace')!r}, "
                f"this instance wrote {head.decode()!r} last (Redis lost records)"
            )

    def close(self) -> None:
        self.client.close()


def with_prefix(url: str, suffix: str) -> str:
    """`url` with its key prefix (`key_prefix`, else the default) extended
    by `suffix`: another allocator's keys in the same Redis database."""
    rest, prefix = split_prefix(url)
    parts = urlsplit(rest)
    query = parse_qsl(parts.query, keep_blank_values=True) + [("key_prefix", prefix + suffix)]
    return urlunsplit(parts._replace(query=urlencode(query, safe=":")))


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


SENTINEL = "redis+sentinel://"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", SENTINEL)


def redis_client(url: str, **options):
    """A client of the Redis at `url` (its `redis.Redis` options given): `redis://`,
    `rediss://`, `unix://`, or `redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER/DB`,
    the primary that those Redis Sentinels name now (redis-py's `Sentinel`: a
    connection lost to a failover is made again to the primary they promoted).
    ValueError, one line, for a Sentinel URL that names no master."""
    import redis

    if not url.startswith(SENTINEL):
        return redis.Redis.from_url(url, **options)
    from redis.sentinel import Sentinel

    parts = urlsplit(url)
    path = [p for p in parts.path.split("/") if p]
    hosts = []
    for item in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url}: want {SENTINEL}HOST:PORT[,HOST:PORT...]/MASTER_NAME/DB")
        hosts.append((host, int(port)))
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{url}: want {SENTINEL}HOST:PORT[,HOST:PORT...]/MASTER_NAME/DB")
    db = int(path[1]) if len(path) == 2 else 0
    timeouts = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if k in options}
    return Sentinel(hosts, sentinel_kwargs=timeouts, **timeouts).master_for(
        path[0], db=db, **options
    )


def open_journal(
    state: str,
    timeout_s: float = 2.0,
    wait_replicas: int = 0,
    wait_timeout_s: float = 1.0,
    address: str = "",
    lease_s: float = 1.0,
) -> MemoryJournal | RedisJournal:
    """`memory` or `redis://host:port/db[?key_prefix=...]` (any of REDIS_SCHEMES);
    with Redis, `wait_replicas` > 0 makes every write wait (Redis WAIT, up to
    `wait_timeout_s`) until that many replicas hold it; `address` and
    `lease_s`: the leader lease's (`RedisJournal`)."""
    if state == "memory":
        return MemoryJournal()
    if state.startswith(REDIS_SCHEMES):
        return RedisJournal(state, timeout_s, wait_replicas, wait_timeout_s, address, lease_s)
    raise ValueError(f"--state must be 'memory' or a redis:// URL, not {state!r}")
