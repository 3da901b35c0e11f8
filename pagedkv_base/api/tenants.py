"""API keys and the cache salt each key gets.

A prefix cache tells a caller how much of its prompt was already held
(`usage.prompt_tokens_details.cached_tokens`, the router's
`x-pagedkv-cached-tokens`, and a shorter time to first token). A caller who
may send prompts to a pool that others use can therefore guess what they
sent, a block at a time: a secret in someone else's prompt (a PIN after a
shared system prompt) falls to a few hundred probes. Blocks filled under one
`cache_salt` never serve a request under another, so a salt per tenant
closes that side channel.

Behind API keys each key is a tenant by default (`PAGEDKV_WORKER_CACHE_SALT_PER_API_KEY`,
on): a key's tenant id is `tenant_of(key)`, an HMAC keyed by the key, and a
request's salt is `tenant_salt(its tenant, its own cache_salt)`, so requests
under one key share cached blocks, requests under two keys never do, and no
request can name another key's salt. The worker salts what it admits this way
and the router matches prefixes under the same salt, so routing by cache keeps
working for keyed clients. The worker and the router must have the same keys
and the same setting.

The router never passes a client's key on: it presents a key of its own and
the client's tenant id in `x-pagedkv-tenant` (TENANT_HEADER). A worker takes
that header from a caller whose key it accepted: the id is an HMAC of a key,
so only who holds a key (or saw its id) can name its tenant, and a caller
naming its own tenant gains nothing.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from pagedkv_base.settings import CliError, read_file

_LABEL = b"pagedkv cache salt v2\0"
_TENANT_LABEL = b"pagedkv tenant v1\0"
_TENANT_PREFIX = "t1-"
TENANT_HEADER = "x-pagedkv-tenant"


def tenant_of(api_key: str) -> str:
    """The tenant id of an API key: an HMAC keyed by it (the key cannot be read back)."""
    return (
        _TENANT_PREFIX
        + hmac.new(api_key.encode("utf-8"), _TENANT_LABEL, hashlib.sha256).hexdigest()
    )


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The salt a request of `tenant` (`tenant_of` its key) is cached under: an
    HMAC of the request's own `cache_salt` (None: none given; a valid salt,
    checked by the caller) keyed by the tenant id. Fixed length, whatever the
    request's salt; no request's own salt equals it, nor any other tenant's."""
    own = b"\0" if cache_salt is None else b"\1" + cache_salt.encode("utf-8")
    return "apikey:" + hmac.new(tenant.encode("utf-8"), _LABEL + own, hashlib.sha256).hexdigest()


def api_key_of(request: Request) -> str | None:
    """The API key `ApiKeyCheck` let this request in with; None without keys."""
    return getattr(request.state, "api_key", None)


def tenant_of_request(request: Request) -> str | None:
    """The tenant of a request let in with a key: the one a router named
    (TENANT_HEADER, a well-formed id), else its own key's; None without keys."""
    key = api_key_of(request)
    if key is None:
        return None
    named = request.headers.get(TENANT_HEADER)
    if (
        named is not None
        and named.startswith(_TENANT_PREFIX)
        and len(named) == len(_TENANT_PREFIX) + 64
        and all(c in "0123456789abcdef" for c in named[len(_TENANT_PREFIX) :])
    ):
        return named
    return tenant_of(key)


def read_api_keys(path: str) -> list[str]:
    """The keys in file `path`: one a line; blank lines and lines starting with '#' skipped."""
    try:
        text = read_file(path, "API keys file").decode("utf-8")
    except UnicodeDecodeError:
        raise CliError(f"API keys file {path} is not UTF-8 text") from None
    keys = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not keys:
        raise CliError(f"API keys file {path} holds no key")
    return keys


def api_keys(api_key: str | None, api_keys_file: str | None) -> tuple[str, ...]:
    """Every key a component accepts: `--api-key` and the lines of `--api-keys-file`, each once."""
    keys: list[str] = [api_key] if api_key else []
    if api_keys_file:
        keys += read_api_keys(api_keys_file)
    return tuple(dict.fromkeys(keys))
