"""The checks of what a caller names: sequence ids, cache salts, token ids.

The pool runs them on every operation and the service on MatchPrefix; the
worker and the router check a request's salt with the same function. Each
raises `InvalidArgument` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import MAX_SALT_LEN, MAX_SEQ_ID_LEN, MAX_TOKEN_ID


def check_seq_id(seq_id: object) -> str:
    """The id, unless it is not a non-empty string of at most MAX_SEQ_ID_LEN characters."""
    if not isinstance(seq_id, str) or not seq_id or len(seq_id) > MAX_SEQ_ID_LEN:
        raise InvalidArgument(
            f"a sequence id must be a non-empty string of at most {MAX_SEQ_ID_LEN} characters"
        )
    return seq_id


def check_cache_salt(cache_salt: object) -> None:
    """None is "no salt" (the shared namespace); "" is refused: it would look
    like a tenant's salt yet share the unsalted namespace. A salt is text
    (valid Unicode), as every wire that carries it requires."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= MAX_SALT_LEN:
        raise InvalidArgument(
            f"cache_salt must be a non-empty string of at most {MAX_SALT_LEN} characters "
            "(unset for no salt)"
        )
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("cache_salt must be valid Unicode text") from None


def tokens_ok(tokens: Sequence[object]) -> bool:
    """Whether every token id is an int in [0, MAX_TOKEN_ID] (`check_tokens`' rule)."""
    top = MAX_TOKEN_ID
    # type() is int, not isinstance: bools and floats are not token ids.
    # NOTE: one plain loop, compiled (setup.py): a step's every token at a few ns each.
    for t in tokens:
        if type(t) is not int or not 0 <= t <= top:
            return False
    return True


def check_tokens(tokens: Sequence[object]) -> None:
    """InvalidArgument unless every token id is an int in [0, MAX_TOKEN_ID]."""
    if not tokens_ok(tokens):
        raise InvalidArgument(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
