"""Who may call what: the three roles and the ONE table of methods they may
call (the interceptor applies it; the servicer reads the caller's role).

A call's role comes from its `authorization: Bearer <token>` metadata:

- **admin** (the admin token): every method; GetPoolStats, ResetPrefixCache
  and DumpPool of ANY pool without the pool's credential.
- **router** (the router token): MatchPrefix, WatchEvents and ListPools only.
- **pool** (the server-wide token, or no token when the server has none):
  RegisterPool and the calls on a pool whose credential it presents. It may
  call the router's methods only in a development setup: no router and no
  server-wide token configured.

A token that matches none of the configured ones, or none where one is
needed, is UNAUTHENTICATED; a valid token of a role the method does not
allow is PERMISSION_DENIED.
"""

from __future__ import annotations

import contextvars
import hmac
from dataclasses import dataclass

from allocator_service.errors import PermissionDenied, Unauthenticated

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
class Roles:
    """The configured tokens (None: not configured)."""

    auth_token: str | None = None
    admin_token: str | None = None
    router_token: str | None = None

    def __post_init__(self) -> None:
        tokens = [t for t in (self.auth_token, self.admin_token, self.router_token) if t is not None]
        if any(not t for t in tokens):
            raise ValueError("a configured token must not be empty")
        if len(set(tokens)) != len(tokens):
            raise ValueError("the auth, admin and router tokens must differ from each other")

    @property
    def any_token(self) -> bool:
        return bool(self.auth_token or self.admin_token or self.router_token)

    @property
    def open_router_calls(self) -> bool:
        """The router's methods answer the pool role (development setup)."""
        return self.router_token is None and self.auth_token is None

    def role_of(self, bearer: bytes | None) -> str | None:
        """The role a bearer value (`Bearer <token>`, or None when absent)
        proves, or None when it proves nothing that is needed."""
        if bearer is not None:
            for token, role in ((self.admin_token, ADMIN), (self.router_token, ROUTER),
                                (self.auth_token, POOL)):
                if token is not None and hmac.compare_digest(bearer, f"Bearer {token}".encode()):
                    return role
        return POOL if self.auth_token is None else None

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
                raise PermissionDenied(f"{method} needs the router or admin token, not the pools' token")
            raise Unauthenticated(f"{method} needs the router or admin token (authorization metadata)")
        if role == ROUTER:
            raise PermissionDenied(f"the router token may call {', '.join(sorted(ROUTER_METHODS))} only, "
                                   f"not {method}")
        return role

    def _known(self, bearer: bytes) -> bool:
        return any(
            t is not None and hmac.compare_digest(bearer, f"Bearer {t}".encode())
            for t in (self.auth_token, self.admin_token, self.router_token)
        )
