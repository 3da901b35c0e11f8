"""Which worker gets a request: the cost, pure (no I/O, no clock).

`kv` (the default) scores every candidate worker as Dynamo's KV router does:

    score = 2 * overlap - usage - waiting

- `overlap`: the share of the prompt's tokens the worker's pool already holds
  (`MatchPrefix`'s `cached_tokens` / prompt tokens; or, when more, what a
  prompt being prefilled there shares with it): prefill it saves;
- `usage`: the share of its pool's blocks in use (1 - free / total): memory
  pressure, i.e. how soon it would have to evict or preempt;
- `waiting`: its requests in flight through this router over the largest
  such count of any candidate (0 when none has any): its queue.

The highest score wins; ties go to the least loaded (fewest in flight, then
least usage), then in turn. An overlap worth all of a prompt outweighs any
load (2 > 1 + 1 only at full load both ways), so the cache is the stickiness;
with nothing cached anywhere it is plain least-load.

`least-load`: fewest in flight, then least usage, then in turn.
`round-robin`: in turn, ignoring everything else (the baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("kv", "least-load", "round-robin")
OVERLAP_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker a request may go to, as the router sees it right now."""

    key: str  # the worker's URL
    cached_tokens: int = 0  # of this prompt, in its pool (MatchPrefix)
    free_blocks: int = 0
    num_blocks: int = 0  # 0: unknown (no pool known): usage counts as 0
    in_flight: int = 0  # its requests through this router, not yet answered in full


def usage(c: Candidate) -> float:
    return 1.0 - c.free_blocks / c.num_blocks if c.num_blocks > 0 else 0.0


def score(c: Candidate, prompt_tokens: int, most_in_flight: int) -> float:
    overlap = min(c.cached_tokens / prompt_tokens, 1.0) if prompt_tokens > 0 else 0.0
    waiting = c.in_flight / most_in_flight if most_in_flight > 0 else 0.0
    return OVERLAP_WEIGHT * overlap - usage(c) - waiting


def rank(policy: str, candidates: Sequence[Candidate], prompt_tokens: int, turn: int) -> list[Candidate]:
    """`candidates` best first under `policy` (the rest are the retry order).
    `turn`: a counter the caller advances per request (round-robin, ties)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    n = len(candidates)
    if n == 0:
        return []
    # In turn: candidate i's place in the rotation that starts at `turn`.
    rotation = {c.key: (i - turn) % n for i, c in enumerate(sorted(candidates, key=lambda c: c.key))}
    if policy == "round-robin":
        return sorted(candidates, key=lambda c: rotation[c.key])
    most = max(c.in_flight for c in candidates)

    def load(c: Candidate) -> tuple:
        return (c.in_flight, round(usage(c), 9), rotation[c.key])

    if policy == "least-load":
        return sorted(candidates, key=load)
    # kv: the score, rounded so float noise never beats the tie-break.
    return sorted(candidates, key=lambda c: (-round(score(c, prompt_tokens, most), 9), *load(c)))
