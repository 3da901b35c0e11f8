"""How much of a prompt each pool holds: the prompt's tokens as the worker
computes them, matched in the router's view of the pools' caches
(`prefix_view.py`) where that view is in step and the pool has no tiers,
else asked of each allocator's `MatchPrefix` (pools sharded over several
allocators: each about its own pools, all at once)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NamedTuple

import grpc

from allocator_service.core import InvalidArgument, check_cache_salt
from allocator_service.core.hashing import prompt_chain
from pagedkv_base.api.bodies import off_loop
from pagedkv_base.api.protocol import template_messages
from router.discovery import Discovery, MergedDiscovery, Worker
from router.metrics import RouterMetrics
from router.prefix_view import PrefixView

log = logging.getLogger(__name__)

# A pool by (its allocator's index in `Worker.allocator`'s order, its pool id).
PoolKey = tuple[int, str]


class PoolMatch(NamedTuple):
    """One prompt against one pool, as MatchPrefix answers it."""

    cached_tokens: int  # the prompt's leading tokens in the pool's KV blocks
    free_blocks: int
    host_tokens: int  # the tokens past those in its host tier
    store_tokens: int  # and past those in the shared store


def prompt_ids(tokenizer, kind: str, req) -> list[int] | None:
    """The prompt's token ids as the worker computes them (a batch: its first
    prompt's), or None when they cannot be had (the worker then answers the error)."""
    try:
        if kind == "chat":
            return tokenizer.encode_chat(template_messages(req.messages))
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt places it
        if isinstance(prompt, str):
            return tokenizer.encode(prompt) if prompt else None
        return [int(t) for t in prompt] or None
    except Exception:  # noqa: BLE001 - a template or tokenizer error is the worker's to answer
        return None


def prompt_size(kind: str, req) -> int:
    """How long the prompt that places a request is (a batch's first), in
    characters or ids, measured without copying it (`str` of a million ids
    would take the loop ~0.1 s)."""
    if kind == "chat":
        return sum(len(m.text()) for m in req.messages)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, (str, list)) else 0


class Matcher:
    """Matches prompts against the pools of `discovery`'s workers; `allocators`:
    RouterClients in the order of `Worker.allocator` (none: nothing is matched)."""

    def __init__(
        self,
        discovery: Discovery | MergedDiscovery,
        allocators: Sequence,
        policy: str,
        metrics: RouterMetrics,
    ) -> None:
        self.discovery = discovery
        self.allocators = list(allocators)
        self.policy = policy
        self.metrics = metrics

    async def cached_tokens(
        self,
        workers: Sequence[Worker],
        tokens: list[int] | None,
        salt: str | None,
        any_policy: bool = False,
    ) -> dict[PoolKey, PoolMatch]:
        """Each pool of `workers` against the prompt: matched in the view of each
        allocator whose view is in step, for pools without tiers (the view holds
        KV pools only); from MatchPrefix for the others, one call per allocator
        and model, all at once. Only policy `kv` matches, unless `any_policy`
        (a split request's transfer is waited for under every policy)."""
        if not self.allocators or not tokens or salt == "":
            return {}
        if self.policy != "kv" and not any_policy:
            return {}
        if all(w.block_size and len(tokens) - 1 < w.block_size for w in workers):
            return {}  # not one whole block before the last token: no pool can hold any of it
        # Not an allocator that did not answer its last listing: its workers are
        # ranked last anyway, and a call to it could hold every request up to its deadline.
        answers = self.discovery.allocator_answers
        asks = sorted(
            {
                (w.allocator, w.model_fingerprint)
                for w in workers
                if w.pool_id and answers(w.allocator)
            }
        )
        if not asks:
            return {}

        # Matched here, in the pools' caches as the allocator's own events say: no call to wait for.
        views = synced_views(self.discovery)
        tiered = {(w.allocator, w.model_fingerprint) for w in workers if w.tiered}
        local = [(i, fp) for i, fp in asks if i in views and (i, fp) not in tiered]
        found: dict[PoolKey, PoolMatch] = {}
        if local:
            with self.metrics.view_match_seconds.time():
                # A long prompt's hash chain off the loop, as its tokenizing was (over 4,096
                # tokens: ~0.5 ms of hashing per block size, more than the hop to a thread).
                found = await off_loop(
                    match_in_views, views, local, workers, tokens, salt, size=len(tokens)
                )
            asks = [a for a in asks if a not in local]
            if not asks:
                return found

        async def ask(index: int, fingerprint: str) -> list[tuple[PoolKey, PoolMatch]]:
            try:
                matches = await self.allocators[index].match_prefix_async(fingerprint, tokens, salt)
            except Exception as exc:  # noqa: BLE001 - that allocator away: its pools route by load alone
                self.metrics.match_errors.inc()
                log.warning("MatchPrefix failed (%s): routing by load", type(exc).__name__)
                if _unreachable(exc):
                    # not asked again until it answers a listing (each request would wait)
                    self.discovery.not_answering(index)
                return []
            return [
                (
                    (index, m.pool_id),
                    PoolMatch(m.cached_tokens, m.free_blocks, m.host_tokens, m.store_tokens),
                )
                for m in matches
            ]

        with self.metrics.match_seconds.time():
            if len(asks) == 1:
                answers = [await ask(*asks[0])]
            else:
                answers = await asyncio.gather(*(ask(i, fp) for i, fp in asks))
        return found | {key: value for answer in answers for key, value in answer}


def synced_views(discovery: Discovery | MergedDiscovery) -> dict[int, PrefixView]:
    """Allocator index -> its view of the pools' caches, for the views in step."""
    return {
        i: p.view for i, p in enumerate(discovery.parts) if p.view is not None and p.view.synced
    }


def match_in_views(
    views: dict[int, PrefixView],
    asks: Sequence[tuple[int, str]],
    workers: Sequence[Worker],
    tokens: list[int],
    salt: str | None,
) -> dict[PoolKey, PoolMatch]:
    """What MatchPrefix would answer for the pools among `workers` of each
    (allocator, fingerprint) in `asks`, from that allocator's view: the
    prompt's hash chain per block size (`prompt_chain`), the leading hashes the
    pool holds; free blocks as the view last heard them (its events carry
    them, and listings), else from the last listing. A salt or token id the
    allocator would refuse matches nothing (the worker answers the error)."""
    out: dict[PoolKey, PoolMatch] = {}
    try:
        check_cache_salt(salt)
    except InvalidArgument:
        return out
    chains: dict[tuple[str, int], list[bytes]] = {}
    for index, fingerprint in asks:
        view = views[index]
        for w in workers:
            if (
                w.allocator != index
                or w.model_fingerprint != fingerprint
                or not w.pool_id
                or not w.block_size
            ):
                continue
            size = w.block_size
            hashes = chains.get((fingerprint, size))
            if hashes is None:
                try:
                    hashes = prompt_chain(fingerprint, tokens, size, salt)
                except InvalidArgument:  # a token id no model has: nothing can be cached
                    hashes = []
                chains[(fingerprint, size)] = hashes
            free = view.free_blocks(w.pool_id)
            out[(index, w.pool_id)] = PoolMatch(
                view.cached_blocks(w.pool_id, hashes) * size,
                w.free_blocks if free is None else free,
                0,
                0,
            )
    return out


def _unreachable(exc: BaseException) -> bool:
    """A gRPC error that says the allocator did not answer (as opposed to refusing)."""
    code = getattr(exc, "code", None)
    return callable(code) and code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
