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
on): a request's salt is `tenant_salt(its key, its own cache_salt)`, an HMAC
keyed by the API key, so requests under one key share cached blocks, requests
under two keys never do, and no request can name another key's salt. The
worker salts what it admits this way and the router matches prefixes under
the same salt, so routing by cache keeps working for keyed clients. The
worker and the router must have the same keys and the same setting.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from pagedkv_base.settings import CliError, read_file

_LABEL = b"pagedkv cache salt v1\0"


def tenant_salt(api_key: str, cache_salt: str | None) -> str:
    """The salt a request let in with `api_key` is cached under: an HMAC of the
    request's own `cache_salt` (None: none given; a valid salt, checked by the
    caller) keyed by the API key. Fixed length, whatever the request's salt;
    no request's own salt equals it, nor any other key's."""
    own = b"\0" if cache_salt is None else b"\1" + cache_salt.encode("utf-8")
    return "apikey:" + hmac.new(api_key.encode("utf-8"), _LABEL + own, hashlib.sha256).hexdigest()


def api_key_of(request: Request) -> str | None:
    """The API key `ApiKeyCheck` let this request in with; None without keys."""
    return getattr(request.state, "api_key", None)


def read_api_keys(path: str) -> list[str]:
    """The keys in file `path`: one a line; blank lines and lines starting with '#' skipped."""
    try:
        text = read_file(path, "API keys file").decode("utf-8")
    except UnicodeDecodeError:
        raise CliError(f"API keys file {path} is not UTF-8 text") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise CliError(f"API keys file {path} holds no key")
    return keys


def api_keys(api_key: str | None, api_keys_file: str | None) -> tuple[str, ...]:
    """Every key a component accepts: `--api-key` and the lines of `--api-keys-file`, each once."""
    keys: list[str] = [api_key] if api_key else []
    if api_keys_file:
        keys += read_api_keys(api_keys_file)
    return tuple(dict.fromkeys(keys))

