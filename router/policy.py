"""Which worker gets a request: the cost, pure (no I/O, no clock).

`kv` (the default) ranks, in this order:
1. a worker is overloaded when its requests in flight exceed the least loaded
   candidate's by more than `Balance.abs_threshold` AND are more than
   `Balance.rel_threshold` times them; overloaded workers go last, least
   loaded first;
2. the most prompt tokens held, weighed by tier: KV pool (`cached_tokens`)
   1, host tier (`host_tokens`) 0.5, store (`store_tokens`) 0.25; a match
   under `Balance.cache_threshold` of the prompt counts as none;
3. a worker whose clean free blocks (`clean_free`) cover the prompt's new
   blocks (`blocks(prompt) - cached_tokens // block_size`; a tier hit takes a
   fresh block) before one where the placement evicts a cached prefix;
4. the fewest blocks this router sent lately (`recent_blocks`, `router.recent`);
5. the least loaded (fewest in flight, then least usage), then in turn.
`least-load`: fewest in flight, then least usage, then in turn.
`round-robin`: in turn, ignoring everything else (the baseline).

The reasons: docs/architecture.md, "The router's rules, and why".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from allocator_service.core import blocks_for

POLICIES = ("kv", "least-load", "round-robin")
TIER_WEIGHTS = (1.0, 0.5, 0.25)  # a cached token in the KV pool, the host tier, the shared store


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker a request may go to, as the router sees it right now."""

    key: str  # the worker's URL
    cached_tokens: int = 0  # of this prompt, in its pool (MatchPrefix)
    free_blocks: int = 0
    num_blocks: int = 0  # 0: unknown (no pool known): usage counts as 0
    in_flight: int = 0  # its requests through this router, not yet answered in full
    block_size: int = 0  # 0: unknown: no eviction is counted
    # free blocks holding no cached prefix; None: unknown (all free ones)
    clean_free: int | None = None
    host_tokens: int = 0  # of this prompt past `cached_tokens`, in its host tier
    store_tokens: int = 0  # ... past those, in the shared store
    recent_blocks: int = 0  # blocks of the prompts this router sent it lately (`RecentBlocks`)


@dataclass(frozen=True, slots=True)
class Balance:
    """When the load is too uneven for the cache to decide (in requests in flight)."""

    abs_threshold: int = 8
    rel_threshold: float = 1.5
    cache_threshold: float = 0.5  # the least share of the prompt a match needs to count


def usage(c: Candidate) -> float:
    return 1.0 - c.free_blocks / c.num_blocks if c.num_blocks > 0 else 0.0


def counted(c: Candidate, prompt_tokens: int, balance: Balance) -> Candidate:
    """`c` with its match as the ranking counts it: none when its tiers
    together hold less than the cache threshold of the prompt."""
    cached = min(c.cached_tokens, max(prompt_tokens, 0))
    host = min(c.host_tokens, max(prompt_tokens - cached, 0))
    store = min(c.store_tokens, max(prompt_tokens - cached - host, 0))
    if cached + host + store < balance.cache_threshold * prompt_tokens:
        cached = host = store = 0
    if (cached, host, store) == (c.cached_tokens, c.host_tokens, c.store_tokens):
        return c
    return replace(c, cached_tokens=cached, host_tokens=host, store_tokens=store)


def weighed(c: Candidate) -> float:
    """The tokens `c` holds, each tier weighed (`TIER_WEIGHTS`)."""
    kv, host, store = TIER_WEIGHTS
    return kv * c.cached_tokens + host * c.host_tokens + store * c.store_tokens


def evicted_blocks(c: Candidate, prompt_tokens: int) -> int:
    """Cached blocks of the pool that placing the prompt there would reuse for its new blocks."""
    if c.block_size <= 0 or prompt_tokens <= 0:
        return 0
    new = (
        blocks_for(prompt_tokens, c.block_size)
        - min(c.cached_tokens, prompt_tokens) // c.block_size
    )
    clean = c.free_blocks if c.clean_free is None else min(c.clean_free, c.free_blocks)
    return min(max(new - clean, 0), max(c.free_blocks - clean, 0))


def overloaded(c: Candidate, least_in_flight: int, balance: Balance) -> bool:
    return (
        c.in_flight - least_in_flight > balance.abs_threshold
        and c.in_flight > balance.rel_threshold * least_in_flight
    )


def rank(
    policy: str,
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    turn: int,
    balance: Balance = Balance(),
) -> list[Candidate]:
    """`candidates` best first under `policy` (the rest are the retry order).
    `turn`: a counter the caller advances per request (round-robin, ties)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    n = len(candidates)
    if n == 0:
        return []
    # In turn: candidate i's place in the rotation that starts at `turn`.
    rotation = {
        c.key: (i - turn) % n for i, c in enumerate(sorted(candidates, key=lambda c: c.key))
    }
    if policy == "round-robin":
        return sorted(candidates, key=lambda c: rotation[c.key])

    def load(c: Candidate) -> tuple:
        return (c.in_flight, round(usage(c), 9), rotation[c.key])

    if policy == "least-load":
        return sorted(candidates, key=load)
    least = min(c.in_flight for c in candidates)

    def kv(c: Candidate) -> tuple:
        if overloaded(c, least, balance):
            return (1, 0, 0, *load(c))
        m = counted(c, prompt_tokens, balance)
        return (0, -weighed(m), evicted_blocks(m, prompt_tokens) > 0, c.recent_blocks, *load(c))

    return sorted(candidates, key=kv)
