"""The simulated model's output: a token that is a function of the sequence's tokens.

`TokenDigest` keeps a 64-bit rolling digest of a sequence's tokens
(h = h x P + token + 1, mod 2^64), extended by the tokens added since the
last draw, so a draw costs the new tokens only. The drawn token is the
digest, mixed (MurmurHash3's finaliser), modulo the vocabulary, moved past
the model's eos ids: the same tokens give the same output on every worker
and every run, and nothing ends a sequence but the request's own rules.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["TokenDigest", "next_token"]

_MASK = (1 << 64) - 1
_P = 0x100000001B3


class TokenDigest:
    __slots__ = ("count", "value")

    def __init__(self) -> None:
        self.count = 0
        self.value = 0

    def extend(self, tokens: Sequence[int]) -> int:
        """The digest of `tokens`, whose first `count` were seen before."""
        h = self.value
        for t in tokens[self.count :]:
            h = (h * _P + t + 1) & _MASK
        self.value, self.count = h, len(tokens)
        return h


def next_token(digest: int, vocab_size: int, avoid: Collection[int]) -> int:
    z = digest
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & _MASK
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & _MASK
    z ^= z >> 33
    token = z % vocab_size
    while token in avoid and len(avoid) < vocab_size:
        token = (token + 1) % vocab_size
    return token
