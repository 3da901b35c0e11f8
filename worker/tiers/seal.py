"""A store group's seal: AES-256-GCM over every shared-store entry a worker of
the group writes.

The group's secret (`--kv-store-key-file`, 32 bytes or more) gives one key by
HKDF-SHA256; its `key_id` (8 bytes of an HMAC of it) travels in each entry, so
a reader with another group's key says so instead of "forged". Each entry is
sealed under a key of its own, HMAC-SHA256(group key, 16 random bytes), with a
zero nonce: a key seals one message, so no nonce is ever reused, however many
entries (a random 96-bit nonce under one key would be good for about 2^32).
The associated data is the entry's header and store key (`NAMESPACE-HASH`):
an entry moved to another key, layout or block does not open.

What it protects and what not, and why one key per group: docs/operations.md,
"Security".
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["KEY_ID_BYTES", "MIN_SECRET_BYTES", "SALT_BYTES", "TAG_BYTES", "StoreSeal"]

MIN_SECRET_BYTES = 32
SALT_BYTES = 16  # per entry: its own key's input
KEY_ID_BYTES = 8
TAG_BYTES = 16  # the GCM tag after the ciphertext
_INFO = b"pagedkv/kv-store-seal/v1"
_NONCE = bytes(12)  # NOTE: safe only because each entry key seals exactly one entry


class StoreSeal:
    """Seals and opens entries under one store group's secret."""

    __slots__ = ("_key", "key_id")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"a store key needs {MIN_SECRET_BYTES} bytes or more, got {len(secret)}"
            )
        self._key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret)
        self.key_id = hmac.digest(self._key, b"key id", hashlib.sha256)[:KEY_ID_BYTES]

    def _aead(self, salt: bytes | memoryview) -> AESGCM:
        return AESGCM(hmac.digest(self._key, salt, hashlib.sha256))

    @staticmethod
    def new_salt() -> bytes:
        """A fresh entry's salt (the input of its own key): random."""
        return os.urandom(SALT_BYTES)

    def seal(self, salt: bytes, payload: bytes | memoryview, aad: bytes) -> bytes:
        """The ciphertext of `payload` with its tag, under the key of `salt` (a `new_salt()`,
        used for this one entry), bound to `aad`."""
        return self._aead(salt).encrypt(_NONCE, payload, aad)

    def open(
        self, salt: bytes | memoryview, sealed: bytes | memoryview, aad: bytes
    ) -> bytes | None:
        """The payload, or None when `sealed` was not sealed
        under this key with `salt` and `aad`."""
        try:
            return self._aead(salt).decrypt(_NONCE, sealed, aad)
        except InvalidTag:
            return None
