"""Proving which pool a worker's HTTP address serves.

A router sends users' prompts (and the router's own API key) only to a
worker it has verified. The allocator lists each pool with an *attestation
key* derived from the pool's credential; the worker, which holds that
credential, derives the same key. The router asks the pool's advertised
address `GET /pagedkv/identity?nonce=N` and accepts the pool only when the
answer names that pool and carries `proof(key, N, pool_id, url)`.

So an address re-advertised by another pool is not that pool's (the worker
there proves its own pool, not the impostor's), a stale pool whose worker
restarted under a new pool is not routed, and nothing at an address can
claim a pool without its credential. Which addresses a caller may advertise
at all is the allocator's rule (`roles.WorkerGrant`); this module is only
the proof, shared by the three parties.
"""

from __future__ import annotations

import hashlib
import hmac
import re

# The worker's route that answers the challenge.
IDENTITY_PATH = "/pagedkv/identity"
_NONCE = re.compile(r"[0-9a-f]{32,128}")
_CONTEXT = b"pagedkv attest v1"


def credential_digest(credential: str) -> bytes:
    """What the allocator keeps of a pool's credential (never the credential itself)."""
    return hashlib.sha256(credential.encode()).digest()


def attest_key(digest: bytes) -> bytes:
    """The key a pool's identity answers are proven with: derived from the
    credential's digest, so the allocator and the worker compute it alike,
    and it grants no call on the pool."""
    return hmac.new(digest, _CONTEXT, hashlib.sha256).digest()


def normalise_url(url: str) -> str:
    return url.strip().rstrip("/")


def valid_nonce(nonce: str) -> bool:
    """32 to 128 lowercase hex digits."""
    return bool(_NONCE.fullmatch(nonce))


def proof(key: bytes, nonce: str, pool_id: str, url: str) -> str:
    """Hex HMAC-SHA256 over the nonce, the pool and the address it answers at."""
    msg = f"{nonce}\n{pool_id}\n{normalise_url(url)}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def verify(key: bytes, nonce: str, pool_id: str, url: str, answer: object) -> bool:
    """Whether `answer` (the identity route's JSON) proves pool `pool_id` at `url`."""
    if not key or not isinstance(answer, dict):
        return False
    claimed, given = answer.get("pool_id"), answer.get("proof")
    if claimed != pool_id or not isinstance(given, str):
        return False
    return hmac.compare_digest(given, proof(key, nonce, pool_id, url))
