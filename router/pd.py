"""Prefill/decode disaggregation in the router (docs/architecture.md, "Prefill
and decode on separate workers").

Workers register a role with their pool (`--kv-role`: both, prefill,
decode). A request is split when the workers of its model include a prefill
worker and a decode-side worker (decode, or both) that share a store
namespace (one store group, one KV layout: they load each other's store
entries):

1. the prefill leg: the body with `max_tokens` 1 (one sequence, no stream)
   goes to a prefill worker, ranked by the router's policy among them; its
   answer is dropped. Finished, the sequence's full prompt blocks are freed
   and written through to the store, found once the worker confirms them;
2. the wait: the router asks `MatchPrefix` until a decode-side pool of that
   namespace finds the prompt's whole blocks (before its last token), for
   at most `transfer_timeout` seconds; past it, or when no prefill worker
   answered, the decode worker computes what it does not find;
3. the decode leg: the client's body, unchanged, goes to a decode-side
   worker of that namespace, ranked by the policy (its admission loads the
   blocks from the store: cached tokens, not computed). Its answer is the
   client's, with `x-pagedkv-prefill-worker` naming the prefill worker.

`plan` holds the rules on which workers take what: with no prefill worker
a request is whole, for `both` workers only (a decode-only fleet is a 503
`no_worker_for_role`); prefill and decode workers never take a whole request
through the router.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import NamedTuple

from pagedkv_base.api.errors import ApiError
from router.discovery import Worker
from router.matching import PoolKey, PoolMatch

PREFILL_WORKER_HEADER = "x-pagedkv-prefill-worker"
# Sent with the prefill leg, so a worker's log and a capture tell it from a client's request.
TRANSFER_HEADER = "x-pagedkv-kv-transfer"
# The prefill leg's body drops what would make it longer or stream: one token, one sequence.
_DROPPED = (
    "stream",
    "stream_options",
    "max_completion_tokens",
    "min_tokens",
    "best_of",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "n",
)
# The wait for the transfer asks MatchPrefix every POLL_FIRST_S for its first POLL_FAST_S (a
# transfer takes a few of the prefill worker's steps), then twice as long each time up to
# POLL_MAX_S (seconds).
POLL_FIRST_S, POLL_FAST_S, POLL_MAX_S = 0.002, 0.1, 0.05


class Split(NamedTuple):
    """Where a split request's legs may go: the prefill workers, and for each
    store namespace the decode-side workers (decode and both) sharing it."""

    prefill: list[Worker]
    decode: dict[str, list[Worker]]


def plan(workers: Sequence[Worker]) -> list[Worker] | Split:
    """The workers a whole request may go to, or the legs of a split one:
    a Split when a prefill worker and a decode-side worker share a store
    namespace; else the `both` workers; ApiError 503 when there are none."""
    roles = {w.kv_role for w in workers}
    if roles <= {"both"}:
        return list(workers)
    decode: dict[str, list[Worker]] = {}
    for w in workers:
        if w.kv_role != "prefill" and w.store_namespace:
            decode.setdefault(w.store_namespace, []).append(w)
    prefill = [w for w in workers if w.kv_role == "prefill" and w.store_namespace in decode]
    if prefill:
        return Split(prefill, {ns: decode[ns] for ns in {w.store_namespace for w in prefill}})
    whole = [w for w in workers if w.kv_role == "both"]
    if whole:
        return whole
    have = " and ".join(sorted(roles)) + " workers"
    if "prefill" in roles and "decode" in roles:
        reason = (
            "the prefill and decode workers share no shared store namespace (one store group "
            "and KV layout), so no prefill worker's blocks can reach a decode worker"
        )
    elif "decode" in roles:
        reason = "a decode worker answers only what a prefill worker computed, and there is none"
    else:
        reason = "a prefill worker's blocks need a decode worker to answer, and there is none"
    raise ApiError(
        503,
        f"no worker can answer this model's requests alone: only {have}; {reason}",
        type_="server_error",
        code="no_worker_for_role",
    )


def prefill_body(body: bytes) -> bytes:
    """The prefill leg's body: the client's, computing its prompt and one token."""
    data = json.loads(body)
    for key in _DROPPED:
        data.pop(key, None)
    data["max_tokens"] = 1
    return json.dumps(data, ensure_ascii=False).encode()


def wanted_tokens(tokens: Sequence[int], block_size: int) -> int:
    """The prompt tokens a decode admission can find: its whole blocks before its last token."""
    return (len(tokens) - 1) // block_size * block_size if block_size else 0


def found_tokens(workers: Sequence[Worker], matches: dict[PoolKey, PoolMatch]) -> int:
    """The most of the prompt one of `workers` finds, in its KV pool and tiers."""
    best = 0
    for w in workers:
        m = matches.get((w.allocator, w.pool_id))
        if m is not None:
            best = max(best, m.cached_tokens + m.host_tokens + m.store_tokens)
    return best


async def wait_for_transfer(
    match, workers: Sequence[Worker], want: int, timeout_s: float
) -> tuple[bool, dict[PoolKey, PoolMatch]]:
    """(whether one of `workers` finds `want` tokens, the last matches), asking
    `match(workers)` (MatchPrefix) until it does or `timeout_s` has passed."""
    start = time.monotonic()
    pause = POLL_FIRST_S
    while True:
        matches = await match(workers)
        if found_tokens(workers, matches) >= want:
            return True, matches
        now = time.monotonic()
        left = start + timeout_s - now
        if left <= 0:
            return False, matches
        await asyncio.sleep(min(pause, left))
        if now - start >= POLL_FAST_S:
            pause = min(pause * 2, POLL_MAX_S)
