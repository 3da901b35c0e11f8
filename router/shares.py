"""Each API key's share of the sequences in flight through the router.

A key holding `limit` sequences (prompts times n, counted when a request is
let in and given back when its answer ends, streamed or not) gets a 429
`rate_limit_exceeded` with `Retry-After` for one more, so one client's flood
cannot fill the workers' batches and queues ahead of every other client. A
request larger than the limit is let in alone (when its key holds none).
The share applies among keys: with one key or none every caller is one
tenant, whom nothing is kept from. Why a refusal rather than a queue:
docs/architecture.md, "The router's rules".
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv_base.api.errors import ApiError

RETRY_AFTER_S = 1  # what a refused client is told to wait: a sequence's answer takes about that


class KeyShares:
    """Sequences in flight per API key, at most `limit` each (0: no limit)."""

    def __init__(self, limit: int, keys: int) -> None:
        self.limit = limit if keys > 1 else 0
        self.held: dict[str, int] = {}

    def admit(self, key: str | None, asked: int) -> Callable[[], None]:
        """Let in a request of `asked` sequences under `key`: the function that
        gives them back (once, whoever calls it), or ApiError 429."""
        if not self.limit or key is None:
            return _nothing
        held = self.held.get(key, 0)
        if held and held + asked > self.limit:
            raise ApiError(
                429,
                f"this API key has {held} sequences in flight through the router and may "
                f"have at most {self.limit} (PAGEDKV_ROUTER_MAX_SEQUENCES_PER_KEY); "
                f"retry after {RETRY_AFTER_S} s",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held[key] = held + asked
        given_back = False

        def release() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                left = self.held[key] - asked
                if left:
                    self.held[key] = left
                else:
                    del self.held[key]

        return release


def _nothing() -> None:
    return None
