"""The blocks of the prompts this router sent each worker lately that its pool
still holds: how much of each pool the traffic it routes keeps warm.

Per worker: each placement's whole-block hashes (`prompt_chain` of its first
`RECORDED_TOKENS` tokens, under the request's salt), oldest first; a block
sent again moves to the end, one two requests share counts once, and at most
the pool's own number are kept. Before counting, the oldest go up to the
first that the view says the pool holds or whose latest request is pending
(still computed, or just answered: the view hears of its blocks later);
without a view in step only the pool's size trims.

Why: docs/architecture.md, "The router's rules, and why".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container

from allocator_service.core import InvalidArgument, check_cache_salt
from allocator_service.core.hashing import prompt_chain

# The leading tokens of a prompt that are hashed for the record: bounds the work on the
# event loop (a 4,096-token prompt's chain takes well under a millisecond).
RECORDED_TOKENS = 4096


class RecentBlocks:
    """Per worker URL: the block hashes sent there, oldest first, each with the
    id of the latest request that sent it."""

    def __init__(self) -> None:
        self._sent: dict[str, OrderedDict[bytes, int]] = {}

    def record(
        self,
        url: str,
        rid: int,
        fingerprint: str,
        block_size: int,
        num_blocks: int,
        tokens: list[int],
        salt: str | None,
    ) -> None:
        """Request `rid`'s prompt placed on the worker at `url` (a pool of `num_blocks` blocks
        of `block_size` tokens): its blocks are the newest; the oldest beyond `num_blocks` go."""
        if block_size <= 0 or num_blocks <= 0 or not tokens:
            return
        try:
            check_cache_salt(salt)
            hashes = prompt_chain(fingerprint, tokens[: RECORDED_TOKENS + 1], block_size, salt)
        except InvalidArgument:
            # a salt or token id the allocator refuses: the worker answers the error
            return
        sent = self._sent.setdefault(url, OrderedDict())
        for h in hashes:
            sent[h] = rid
            sent.move_to_end(h)
        while len(sent) > num_blocks:
            sent.popitem(last=False)

    def blocks(
        self, url: str, held: Callable[[bytes], bool] | None = None, pending: Container[int] = ()
    ) -> int:
        """How many blocks sent to `url` lately its pool still holds: first the oldest that
        `held` (the view of its cache; None: unknown) says it does not hold go, up to the
        first whose latest request is in `pending` (its blocks may not be computed yet)."""
        sent = self._sent.get(url)
        if not sent:
            return 0
        if held is not None:
            while sent:
                h, rid = next(iter(sent.items()))
                if rid in pending or held(h):
                    break
                sent.popitem(last=False)
        return len(sent)
