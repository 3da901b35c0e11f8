"""Who may call what: the three roles and the ONE table of methods they may
call (the interceptor applies it; the servicer reads the caller's role).

A call's role comes from its `authorization: Bearer <token>` metadata:

- **admin** (the admin token): every method; GetPoolStats, ResetPrefixCache
  and DumpPool of ANY pool without the pool's credential.
- **router** (the router token): MatchPrefix, WatchEvents and ListPools only.
- **pool** (a worker token, the server-wide token, or no token when the
  server has neither): RegisterPool and the calls on a pool whose credential
  it presents. It may call the router's methods only in a development setup:
  no router token, no server-wide token and no worker tokens configured.

A *worker token* (`--worker-tokens-file`) is bound to one worker id and the
address it advertises (`WorkerGrant`): its holder may register that worker
there and nothing else, and that id and that address may be registered with
no other credential but the admin token (an admin approves any). So a fixed
id such as compose's `worker-1` cannot be squatted, and no caller can list
its own server, or another worker's address, under a bound worker. The
router still proves every listed address before it sends a request there
(`attest.py`).

A token that matches none of the configured ones, or none where one is
needed, is UNAUTHENTICATED; a valid token of a role the method does not
allow is PERMISSION_DENIED.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import MAX_STORE_GROUP_LEN, STORE_NAME_CHARS
from allocator_service.core.tier_index import check_store_names
from allocator_service.wire.attest import normalise_url
from allocator_service.wire.errors import PermissionDenied, Unauthenticated

ADMIN, ROUTER, POOL = "admin", "router", "pool"

ROUTER_METHODS = frozenset(("MatchPrefix", "WatchEvents", "ListPools"))
# Pool calls an admin may make on any pool, without the pool's credential.
ADMIN_ANY_POOL = frozenset(("GetPoolStats", "ResetPrefixCache", "DumpPool"))

# The role of the call the current thread is serving (set by the
# interceptor around the handler; the servicer reads it).
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("pagedkv_caller_role", default=POOL)


def caller_role() -> str:
    return _caller.get()


def set_caller_role(role: str) -> contextvars.Token:
    return _caller.set(role)


def reset_caller_role(token: contextvars.Token) -> None:
    _caller.reset(token)


@dataclass(frozen=True, slots=True)
class WorkerGrant:
    """What one worker token may register: this worker id at this address,
    with `blocks` a pool of at most that many blocks, which the server
    keeps for it whether or not it holds a pool (None: no quota), in store
    group `store_group`: the workers whose store entries it loads and that
    load its entries (the operator's `group=`; the worker id when none is
    given, so a worker trusts no other worker's entries unless told to)."""

    worker_id: str
    advertise_url: str
    blocks: int | None = None
    store_group: str = ""

    def __post_init__(self) -> None:
        if not self.store_group:
            object.__setattr__(self, "store_group", own_store_group(self.worker_id))


def own_store_group(worker_id: str) -> str:
    """The store group of a bound worker that names none: its worker id when that
    is a group's name, else the id's name-safe part and a digest of it (unique)."""
    try:
        check_store_group(worker_id)
        return worker_id
    except ValueError:
        safe = re.sub(f"[^{STORE_NAME_CHARS}]", "_", worker_id)[: MAX_STORE_GROUP_LEN - 17]
        return f"{safe}-{hashlib.sha256(worker_id.encode()).hexdigest()[:16]}"


def check_store_group(name: str) -> None:
    """ValueError unless `name` can name a store group."""
    try:
        check_store_names("", name)
    except InvalidArgument:
        ok = False
    else:
        ok = bool(name)
    if not ok:
        raise ValueError(
            f"the store group {name!r} must be 1 to {MAX_STORE_GROUP_LEN} characters of "
            f"[{STORE_NAME_CHARS}]"
        )


def parse_worker_tokens(text: str) -> dict[str, WorkerGrant]:
    """A worker tokens file: one `WORKER_ID URL TOKEN [BLOCKS] [group=NAME]`
    per line (blank lines and `#` comments skipped) -> token -> grant;
    BLOCKS: the worker's quota, kept for it; NAME: its store group
    (`WorkerGrant`). Raises ValueError, naming the line, on a malformed line
    or a repeated id, address or token."""
    grants: dict[str, WorkerGrant] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        group = ""
        if words and words[-1].startswith("group="):
            group = words.pop()[len("group=") :]
            if not group:
                raise ValueError(f"line {n}: group= needs a name")
        if len(words) not in (3, 4):
            raise ValueError(
                f"line {n}: want 'WORKER_ID URL TOKEN [BLOCKS] "
                f"[group=NAME]', got {len(words)} fields"
            )
        worker_id, url, token = words[:3]
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"line {n}: the address must be an http:// or https:// URL, not {url!r}"
            )
        blocks = None
        if len(words) == 4:
            if not words[3].isdigit() or int(words[3]) < 1:
                raise ValueError(
                    f"line {n}: BLOCKS must be a positive whole number, not {words[3]!r}"
                )
            blocks = int(words[3])
        grant = WorkerGrant(worker_id, normalise_url(url), blocks, group)
        try:
            check_store_group(grant.store_group)
        except ValueError as exc:
            raise ValueError(f"line {n}: {exc}") from None
        for seen_token, seen in grants.items():
            if (
                hmac.compare_digest(seen_token, token)
                or seen.worker_id == worker_id
                or seen.advertise_url == grant.advertise_url
            ):
                raise ValueError(f"line {n}: worker id, address and token must each appear once")
        grants[token] = grant
    return grants


@dataclass(frozen=True, slots=True, eq=False)
class Roles:
    """The configured tokens (None: not configured) and the worker tokens
    (token -> the one worker it may register)."""

    auth_token: str | None = None
    admin_token: str | None = None
    router_token: str | None = None
    worker_tokens: Mapping[str, WorkerGrant] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tokens = [
            t for t in (self.auth_token, self.admin_token, self.router_token) if t is not None
        ]
        if any(not t for t in tokens) or any(not t for t in self.worker_tokens):
            raise ValueError("a configured token must not be empty")
        if len(set(tokens)) != len(tokens) or set(tokens) & set(self.worker_tokens):
            raise ValueError(
                "the auth, admin, router and worker tokens must differ from each other"
            )

    @property
    def any_token(self) -> bool:
        return bool(self.auth_token or self.admin_token or self.router_token or self.worker_tokens)

    @property
    def open_registration(self) -> bool:
        """Any caller is a pool (development setup: no server-wide and no worker token)."""
        return self.auth_token is None and not self.worker_tokens

    @property
    def open_router_calls(self) -> bool:
        """The router's methods answer the pool role (development setup)."""
        return self.router_token is None and self.open_registration

    def _match(self, bearer: bytes | None) -> tuple[str | None, WorkerGrant | None]:
        if bearer is not None:
            for token, role in (
                (self.admin_token, ADMIN),
                (self.router_token, ROUTER),
                (self.auth_token, POOL),
            ):
                if token is not None and hmac.compare_digest(bearer, f"Bearer {token}".encode()):
                    return role, None
            for token, grant in self.worker_tokens.items():
                if hmac.compare_digest(bearer, f"Bearer {token}".encode()):
                    return POOL, grant
        return (POOL if self.open_registration else None), None

    def role_of(self, bearer: bytes | None) -> str | None:
        """The role a bearer value (`Bearer <token>`, or None when absent)
        proves, or None when it proves nothing that is needed."""
        return self._match(bearer)[0]

    def grant_of(self, bearer: bytes | None) -> WorkerGrant | None:
        """The worker a worker token binds (None: not a worker token)."""
        return self._match(bearer)[1]

    def check_registration(
        self, role: str, grant: WorkerGrant | None, worker_id: str, advertise_url: str
    ) -> None:
        """Raise PermissionDenied unless a caller of `role` (holding `grant`)
        may register `worker_id` advertising `advertise_url`."""
        if role == ADMIN:
            return  # an admin approves any registration
        url = normalise_url(advertise_url)
        if grant is not None:
            if worker_id != grant.worker_id or url != grant.advertise_url:
                raise PermissionDenied(
                    f"this worker token registers worker {grant.worker_id!r} advertising "
                    f"{grant.advertise_url!r} only, not {worker_id!r} advertising {url!r}"
                )
            return
        for bound in self.worker_tokens.values():
            if worker_id == bound.worker_id:
                raise PermissionDenied(
                    f"worker id {worker_id!r} is bound to its own worker token "
                    "(--worker-tokens-file): register it with that token"
                )
            if url and url == bound.advertise_url:
                raise PermissionDenied(
                    f"the address {url!r} is bound to worker {bound.worker_id!r} "
                    "(--worker-tokens-file): only its worker token may advertise it"
                )

    def check(self, method: str, bearer: bytes | None) -> str:
        """The caller's role, or raises Unauthenticated / PermissionDenied."""
        role = self.role_of(bearer)
        if role is None:
            raise Unauthenticated("missing or wrong bearer token (authorization metadata)")
        if role == ADMIN:
            return role
        if method in ROUTER_METHODS:
            if role == ROUTER or self.open_router_calls:
                return role
            if bearer is not None and self._known(bearer):  # the server-wide (pool) token
                raise PermissionDenied(
                    f"{method} needs the router or admin token, not the pools' token"
                )
            raise Unauthenticated(
                f"{method} needs the router or admin token (authorization metadata)"
            )
        if role == ROUTER:
            raise PermissionDenied(
                f"the router token may call {', '.join(sorted(ROUTER_METHODS))} only, not {method}"
            )
        return role

    def _known(self, bearer: bytes) -> bool:
        return any(
            t is not None and hmac.compare_digest(bearer, f"Bearer {t}".encode())
            for t in (self.auth_token, self.admin_token, self.router_token, *self.worker_tokens)
        )
