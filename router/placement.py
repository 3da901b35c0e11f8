"""Where a request goes: the candidates for its model, ranked (`policy.rank`)
by what each pool holds of its prompt, the prompts in flight there, the
blocks this router sent there lately (`recent.py`) and the load; and what is
in flight, per worker and per request. A prompt in flight counts as cached
on the worker computing it until `PLACED_LINGER_S` after its answer ends;
ranking and recording a placement are one step (no await between)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence

from router.discovery import Discovery, MergedDiscovery, Worker
from router.matching import PoolKey, PoolMatch, synced_views
from router.metrics import RouterMetrics
from router.policy import Balance, Candidate, rank
from router.recent import RecentBlocks

# Seconds a finished request's placement still counts as cached on its worker: the view
# learns of its blocks by events that may arrive after the answer has ended.
PLACED_LINGER_S = 2.0


class Placement:
    """The ranking, and the state it reads: requests in flight per worker URL
    (`in_flight`), workers in their cool-down (`down_until`), the prompts
    being computed (`computing`: request id -> (url, salt, prompt)) and the
    blocks sent lately (`recent`). All of it this router's own: a restart loses none."""

    def __init__(
        self,
        discovery: Discovery | MergedDiscovery,
        policy: str,
        balance: Balance,
        metrics: RouterMetrics,
        cooldown_s: float,
    ) -> None:
        self.discovery = discovery
        self.policy = policy
        self.balance = balance  # kv: when the load decides instead of the cache
        self.metrics = metrics
        self.cooldown_s = cooldown_s
        self.in_flight: dict[str, int] = {}
        self.down_until: dict[str, float] = {}
        self.computing: dict[int, tuple[str, str | None, list[int]]] = {}
        self.recent = RecentBlocks()  # policy `kv`: where a new prefix goes
        self._turns = itertools.count()
        self._ids = itertools.count()

    def candidates_for(self, model: str) -> list[Worker]:
        workers = list(self.discovery.workers.values())
        self.metrics.workers.set(len(workers))
        return [w for w in workers if w.served_model_name in ("", model)]

    def being_computed(
        self,
        workers: Sequence[Worker],
        tokens: list[int] | None,
        salt: str | None,
        computing: Sequence[tuple[str, str | None, list[int]]] | None = None,
    ) -> dict[str, int]:
        """url -> the most leading tokens of `tokens` (whole blocks, never the
        last token) that a prompt in flight there under the same salt shares.
        `computing`: the prompts in flight (default `self.computing`'s)."""
        out: dict[str, int] = {}
        if not tokens or self.policy != "kv":
            return out
        sizes = {w.url: w.block_size for w in workers if w.block_size}
        for url, other_salt, other in self.computing.values() if computing is None else computing:
            size = sizes.get(url)
            if size is None or other_salt != salt:
                continue
            n = min(len(tokens) - 1, len(other)) // size * size
            k = 0
            while k < n and tokens[k : k + size] == other[k : k + size]:
                k += size
            if k > out.get(url, 0):
                out[url] = k
        return out

    def ranked(
        self,
        workers: Sequence[Worker],
        matches: dict[PoolKey, PoolMatch],
        prompt_tokens: int,
        computing: dict[str, int] | None = None,
    ) -> list[tuple[Worker, int]]:
        """(worker, its cached tokens by MatchPrefix), best first; workers
        whose allocator does not answer the router after the others (with
        pools sharded over allocators: a worker cannot compute while its own
        allocator is away), and workers in their cool-down after those.
        `computing`: tokens being computed there, ranked as if cached."""
        now = time.monotonic()
        by_url = {w.url: w for w in workers}
        views = synced_views(self.discovery)
        exact = {}
        cands = []
        for w in workers:
            cached, free, host, store = matches.get(
                (w.allocator, w.pool_id), (0, w.free_blocks, 0, 0)
            )
            exact[w.url] = cached + host + store  # what its usage will count as cached
            soon = max(cached, (computing or {}).get(w.url, 0))
            # Free blocks holding no cached prefix: at least the free ones beyond every block
            # holding a hash (exact on an idle pool); unknown without a view in step.
            view = views.get(w.allocator) if w.pool_id else None
            held = view.held_blocks(w.pool_id) if view is not None else None
            clean = None if held is None else max(free - held, 0)
            # a prompt being computed there: in its KV pool
            tiers = (host, store) if soon == cached else (0, 0)
            recent = 0  # only kv records what it sends
            if self.policy == "kv":
                holds = functools.partial(view.holds, w.pool_id) if view is not None else None
                recent = self.recent.blocks(w.url, holds, self.computing)
                self.metrics.recent_blocks.labels(w.name).set(recent)
            cands.append(
                Candidate(
                    w.url,
                    soon,
                    free,
                    w.num_blocks,
                    self.in_flight.get(w.url, 0),
                    w.block_size,
                    clean,
                    *tiers,
                    recent_blocks=recent,
                )
            )
        order = rank(self.policy, cands, prompt_tokens, next(self._turns), self.balance)
        reachable = self.discovery.allocator_answers
        order.sort(
            key=lambda c: (
                self.down_until.get(c.key, 0.0) > now,  # stable: keeps the ranking
                not reachable(by_url[c.key].allocator),
            )
        )
        return [(by_url[c.key], exact[c.key]) for c in order]

    def place(
        self,
        workers: Sequence[Worker],
        matches: dict[PoolKey, PoolMatch],
        tokens: list[int] | None,
        salt: str | None,
        computing: dict[str, int] | None = None,
        seen: dict | None = None,
    ) -> tuple[int, list[tuple[Worker, int]]]:
        """(the request's id, `ranked`), the first of the ranking recorded as computing the
        prompt, with no await between: the next request sees it, however late the view.
        `computing`: `being_computed` against the prompts in flight `seen` (by id), taken
        earlier; the prompts placed since are compared here."""
        if computing is None:
            computing = self.being_computed(workers, tokens, salt)
        else:
            newer = [v for k, v in self.computing.items() if seen is None or k not in seen]
            for url, n in self.being_computed(workers, tokens, salt, newer).items():
                computing[url] = max(n, computing.get(url, 0))
        order = self.ranked(workers, matches, len(tokens or ()), computing)
        rid = next(self._ids)
        if tokens and order:
            self.placed(rid, order[0][0], tokens, salt)
        return rid, order

    def placed(self, rid: int, worker: Worker, tokens: list[int], salt: str | None) -> None:
        """Request `rid`'s prompt goes to `worker`: computing
        there, and its blocks the newest sent there."""
        self.computing[rid] = (worker.url, salt, tokens)
        if self.policy == "kv":
            self.recent.record(
                worker.url,
                rid,
                worker.model_fingerprint,
                worker.block_size,
                worker.num_blocks,
                tokens,
                salt,
            )
            self.metrics.recent_blocks.labels(worker.name).set(self.recent.blocks(worker.url))

    def answered(self, rid: int) -> None:
        """Request `rid` answered: its prompt's blocks are cached on its worker, the view
        hears of them by events; its placement counts a while longer."""
        if rid in self.computing:
            asyncio.get_running_loop().call_later(PLACED_LINGER_S, self.computing.pop, rid, None)

    def failed(self, rid: int) -> None:
        """Request `rid` computes nothing where it was placed: its placement goes at once."""
        self.computing.pop(rid, None)

    def enter(self, worker: Worker) -> None:
        self.in_flight[worker.url] = self.in_flight.get(worker.url, 0) + 1
        self.metrics.in_flight.labels(worker.name).set(self.in_flight[worker.url])

    def leave(self, worker: Worker, down: bool = False) -> None:
        """A request to `worker` is done; `down`: it failed, and the worker is
        avoided for `cooldown_s`."""
        self.in_flight[worker.url] = max(self.in_flight.get(worker.url, 1) - 1, 0)
        self.metrics.in_flight.labels(worker.name).set(self.in_flight[worker.url])
        if down:
            self.down_until[worker.url] = time.monotonic() + self.cooldown_s
        else:
            self.down_until.pop(worker.url, None)
