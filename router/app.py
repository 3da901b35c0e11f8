"""The router's HTTP app: the worker's OpenAI-style API, answered by a worker.

`/v1/completions` and `/v1/chat/completions`: the body is parsed and
validated with the worker's own request models (`pagedkv_base.api.protocol`, via
`pagedkv_base.api.bodies`), so a bad request gets the worker's exact 400; the
prompt is tokenized once with the worker's tokenizer and chat template
(`Tokenizer.encode_chat`); how much of it each pool holds is matched in
the router's copy of the pools' caches, kept from the allocator's events
(`prefix_view.py`), or, while that copy is not in step (or with
`PAGEDKV_ROUTER_CACHE_VIEW=match-prefix`), asked of the allocator's `MatchPrefix` (with
pools sharded over several allocators, each is asked about its own pools,
all at once); `policy.rank` orders the workers. The body goes unchanged to
the first; its answer (JSON or server-sent events) is passed through chunk
by chunk as it arrives, with the headers `x-pagedkv-worker` naming who
answered, `x-pagedkv-cached-tokens` how much of the prompt its pool held
(by the view or MatchPrefix) when it was chosen and `x-pagedkv-routing-ms` how long the
choice took.

Failure: a worker that refuses the connection (or cannot be connected to
within `first_byte_timeout`) or answers 502/503/504 is skipped (and avoided
for `cooldown_s`), and the request goes to the next in the ranking, before
any byte has reached the client. A worker that took the request (its head
was sent) but sent no answer's status within `first_byte_timeout` may be
computing it: the client gets a 504 (code `worker_timeout`) and no other
worker is asked to compute it again. An answer that is not a stream is
read whole before it is passed on when it is at most 1 MiB, so a worker
failing during it is skipped the same way; a longer one is passed on as it
arrives. After the first byte of a stream a failing worker ends it with an
OpenAI-shaped `{"error": ...}` event and `[DONE]` (what a worker itself
sends when it fails mid-stream). Every worker is bounded, proven or not: an
answer over `max_answer_bytes` is a 502 (`worker_answer_too_large`) when the
worker says its size, else cut there; a worker that keeps the router waiting
`first_byte_timeout` for the rest of a body, or between two events (a byte
at a time counts as nothing), ends its answer: a 504 if nothing reached the
client, else the error event (code `worker_timeout`) or a cut body. With no worker left: 503, code
`no_worker_available`. A request asking for more than `MAX_SEQUENCES`
sequences (prompts times n) is refused with a 400, as a worker refuses it.

`/v1/models`: every served model's card (from a worker serving it);
`/health`: 200 while some worker is known (503 `no_workers` otherwise);
`/metrics`: the router's series (`metrics.py`).

Credentials: a client's `Authorization` header (and any tenant header it
sends) is never forwarded. With API keys the router checks the client's as a
worker does (`ApiKeyCheck`) and presents its own key (`worker_api_key`, the
first of its keys) to the workers, which have the same keys, with the
client's tenant id (`x-pagedkv-tenant`: an HMAC of the client's key, never
the key); without keys it presents none. Behind keys (with
`cache_salt_per_api_key`) a request's prompt is matched under the salt the
worker will cache it under (`pagedkv_base.api.tenants`): its key's, so one
key's cached prefixes neither draw nor show in another key's requests. A worker is sent anything at all only once it has proven
the pool it serves (`discovery.prove`), or when the operator listed it
(`--workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from allocator_service.core import InvalidArgument, check_cache_salt
from allocator_service.core.hashing import prompt_chain
from pagedkv_base.api.bodies import off_loop, read_body
from pagedkv_base.api.disconnect import ClientGone, unless_gone
from pagedkv_base.api.errors import (
    MAX_BODY_BYTES,
    ApiError,
    ApiKeyCheck,
    BodyLimit,
    install_error_handlers,
)
from pagedkv_base.api.protocol import ChatCompletionRequest, CompletionRequest, template_messages
from pagedkv_base.api.tenants import TENANT_HEADER, api_key_of, tenant_of, tenant_salt
from router.discovery import Discovery, MergedDiscovery, Worker
from router.metrics import RouterMetrics
from router.policy import Balance, Candidate, rank
from router.prefix_view import PrefixView
from router.recent import RecentBlocks

log = logging.getLogger(__name__)

# Seconds a finished request's placement still counts as cached on its worker: the view
# learns of its blocks by events that may arrive after the answer has ended.
PLACED_LINGER_S = 2.0
# A pool's match: (tokens of the prompt in its KV pool, its free blocks, tokens past those in its
# host tier, and past those in the shared store).
Match = tuple[int, int, int, int]
# A worker's answer with one of these statuses is retried elsewhere (nothing was sent yet).
RETRY_STATUSES = frozenset((502, 503, 504))
# A whole (non-stream) answer up to this size is read before it is passed on (a worker failing
# during it is skipped); a longer one is passed on as it arrives, so the router holds a chunk of it.
WHOLE_ANSWER_BYTES = 1 << 20
# Not forwarded either way (hop-by-hop, set anew by this hop, or the client's credentials).
_HOP = frozenset((b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                  b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization", b"cookie",
                  TENANT_HEADER.encode()))
_HOP_OUT = frozenset(("connection", "keep-alive", "transfer-encoding", "date", "server", "content-length"))


class Router:
    """What the routes share: the tokenizer, the workers, the allocator, the policy."""

    def __init__(self, tokenizer, discovery: Discovery | MergedDiscovery, policy: str, *,
                 allocators: Sequence = (), metrics: RouterMetrics | None = None, first_byte_timeout: float = 60.0,
                 connect_timeout: float = 2.0, cooldown_s: float = 5.0, max_attempts: int = 3,
                 max_answer_bytes: int = 1 << 30,
                 worker_api_key: str | None = None, cache_salt_per_api_key: bool = True,
                 balance: Balance | None = None) -> None:
        self.tokenizer = tokenizer
        # what the router presents to workers for a request let in without a key (never a client's own header)
        self.worker_api_key = worker_api_key
        self.cache_salt_per_api_key = cache_salt_per_api_key
        self.discovery = discovery
        # RouterClients, in the order of `Worker.allocator`; none: routing by load alone
        self.allocators = list(allocators)
        self.policy = policy
        self.balance = balance or Balance()  # kv: when the load decides instead of the cache
        self.metrics = metrics or RouterMetrics()
        self.first_byte_timeout = first_byte_timeout
        self.max_answer_bytes = max_answer_bytes
        self.cooldown_s = cooldown_s
        self.max_attempts = max_attempts
        self.connect_timeout = connect_timeout
        self._http: aiohttp.ClientSession | None = None  # made in the server's event loop (`http`)
        self.in_flight: dict[str, int] = {}
        self.down_until: dict[str, float] = {}
        self._turns = itertools.count()
        # NOTE: a prompt being prefilled is in no pool's cache yet (a block is hashed
        # once computed), so MatchPrefix cannot see it. Until its answer ends, a
        # prompt sharing its prefix counts that prefix as cached on the worker
        # computing it; else a tenant's first requests, arriving together, would be
        # spread by load over every worker, each caching the prefix again. Requests
        # in flight are this router's own (like `in_flight`): a restart loses none.
        # A placement is recorded before the request is sent (the ranking and the record
        # with no await between them), and kept PLACED_LINGER_S after its answer ends,
        # until the view has heard of its blocks whatever the events' delay.
        self.computing: dict[int, tuple[str, str | None, list[int]]] = {}  # id -> (url, salt, prompt)
        self._ids = itertools.count()
        # The blocks of the prompts placed lately, per worker: where a new prefix goes (policy `kv`).
        self.recent = RecentBlocks()

    def worker_auth(self, request: Request) -> list[tuple[str, str]]:
        """The headers the router presents to workers for `request`: its own key
        (`worker_api_key`), never the client's, and behind keys the client's
        tenant id (TENANT_HEADER), under which the worker caches its blocks."""
        headers = [("authorization", f"Bearer {self.worker_api_key}")] if self.worker_api_key else []
        key = api_key_of(request)
        return headers + [(TENANT_HEADER, tenant_of(key))] if key is not None else headers

    def cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The salt the worker caches `request`'s blocks under (`tenant_salt` of
        its key, behind keys with `cache_salt_per_api_key`), so the match is
        made in the same namespace. A salt the allocator would refuse stays
        as it is: it matches nothing, and the worker answers the error."""
        key = api_key_of(request)
        if key is None or not self.cache_salt_per_api_key:
            return salt
        try:
            check_cache_salt(salt)
        except InvalidArgument:
            return salt
        return tenant_salt(tenant_of(key), salt)

    # ------------------------------------------------------------ choosing
    def candidates_for(self, model: str) -> list[Worker]:
        workers = list(self.discovery.workers.values())
        self.metrics.workers.set(len(workers))
        return [w for w in workers if w.served_model_name in ("", model)]

    def prompt_ids(self, kind: str, req) -> list[int] | None:
        """The prompt's token ids as the worker computes them, or None when
        they cannot be had (the worker then answers the error)."""
        try:
            if kind == "chat":
                return self.tokenizer.encode_chat(template_messages(req.messages))
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch: its first prompt places it
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt) if prompt else None
            return [int(t) for t in prompt] or None
        except Exception:  # noqa: BLE001 - a template or tokenizer error is the worker's to answer
            return None

    async def cached_tokens(self, workers: Sequence[Worker], tokens: list[int] | None,
                            salt: str | None) -> dict[tuple[int, str], Match]:
        """(allocator, pool id) -> `Match` (this prompt's tokens in the KV
        pool, free blocks, tokens in the host tier, in the shared store):
        matched in the view of each allocator whose view is in step, for
        pools without tiers (the view holds KV pools only); from MatchPrefix
        for the others, one call per allocator and model, all at once."""
        if not self.allocators or not tokens or salt == "" or self.policy != "kv":
            return {}
        if all(w.block_size and len(tokens) - 1 < w.block_size for w in workers):
            return {}  # not one whole block before the last token: no pool can hold any of it
        # Not an allocator that did not answer its last listing: its workers are
        # ranked last anyway, and a call to it could hold every request up to its deadline.
        answers = self.discovery.allocator_answers
        asks = sorted({(w.allocator, w.model_fingerprint) for w in workers if w.pool_id and answers(w.allocator)})
        if not asks:
            return {}

        # Matched here, in the pools' caches as the allocator's own events say: no call to wait for.
        views = {i: p.view for i, p in enumerate(self.discovery.parts) if p.view is not None and p.view.synced}
        tiered = {(w.allocator, w.model_fingerprint) for w in workers if w.tiered}
        local = [(i, fp) for i, fp in asks if i in views and (i, fp) not in tiered]
        found: dict[tuple[int, str], Match] = {}
        if local:
            with self.metrics.view_match_seconds.time():
                # A long prompt's hash chain off the loop, as its tokenizing was (over 4,096
                # tokens: ~0.5 ms of hashing per block size, more than the hop to a thread).
                found = await off_loop(self._match_in_views, views, local, workers, tokens, salt,
                                       size=len(tokens))
            asks = [a for a in asks if a not in local]
            if not asks:
                return found

        async def ask(index: int, fingerprint: str) -> list[tuple[tuple[int, str], tuple[int, int]]]:
            try:
                matches = await self.allocators[index].match_prefix_async(fingerprint, tokens, salt)
            except Exception as exc:  # noqa: BLE001 - that allocator away: its pools route by load alone
                self.metrics.match_errors.inc()
                log.warning("MatchPrefix failed (%s): routing by load", type(exc).__name__)
                if _unreachable(exc):  # not asked again until it answers a listing (each request would wait)
                    self.discovery.not_answering(index)
                return []
            return [((index, m.pool_id), (m.cached_tokens, m.free_blocks, m.host_tokens, m.store_tokens))
                    for m in matches]

        with self.metrics.match_seconds.time():
            if len(asks) == 1:
                answers = [await ask(*asks[0])]
            else:
                answers = await asyncio.gather(*(ask(i, fp) for i, fp in asks))
        return found | {key: value for answer in answers for key, value in answer}

    @staticmethod
    def _match_in_views(views: dict[int, PrefixView], asks: Sequence[tuple[int, str]], workers: Sequence[Worker],
                        tokens: list[int], salt: str | None) -> dict[tuple[int, str], Match]:
        """What MatchPrefix would answer for the pools among `workers` of each
        (allocator, fingerprint) in `asks`, from that allocator's view: the
        prompt's hash chain per block size (`prompt_chain`), the leading hashes the
        pool holds; free blocks as the view last heard them (its events carry
        them, and listings), else from the last listing. A salt or token id the
        allocator would refuse matches nothing (the worker answers the error)."""
        out: dict[tuple[int, str], Match] = {}
        try:
            check_cache_salt(salt)
        except InvalidArgument:
            return out
        chains: dict[tuple[str, int], list[bytes]] = {}
        for index, fingerprint in asks:
            view = views[index]
            for w in workers:
                if w.allocator != index or w.model_fingerprint != fingerprint or not w.pool_id or not w.block_size:
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
                out[(index, w.pool_id)] = (view.cached_blocks(w.pool_id, hashes) * size,
                                           w.free_blocks if free is None else free, 0, 0)
        return out

    def being_computed(self, workers: Sequence[Worker], tokens: list[int] | None, salt: str | None,
                       computing: Sequence[tuple[str, str | None, list[int]]] | None = None) -> dict[str, int]:
        """url -> the most leading tokens of `tokens` (whole blocks, never the
        last token) that a prompt in flight there under the same salt shares.
        `computing`: the prompts in flight (default `self.computing`'s)."""
        out: dict[str, int] = {}
        if not tokens or self.policy != "kv":
            return out
        sizes = {w.url: w.block_size for w in workers if w.block_size}
        for url, other_salt, other in (self.computing.values() if computing is None else computing):
            size = sizes.get(url)
            if size is None or other_salt != salt:
                continue
            n = min(len(tokens) - 1, len(other)) // size * size
            k = 0
            while k < n and tokens[k:k + size] == other[k:k + size]:
                k += size
            if k > out.get(url, 0):
                out[url] = k
        return out

    def ranked(self, workers: Sequence[Worker], matches: dict[tuple[int, str], Match],
               prompt_tokens: int, computing: dict[str, int] | None = None) -> list[tuple[Worker, int]]:
        """(worker, its cached tokens by MatchPrefix), best first; workers
        whose allocator does not answer the router after the others (with
        pools sharded over allocators: a worker cannot compute while its own
        allocator is away), and workers in their cool-down after those.
        `computing`: tokens being computed there, ranked as if cached."""
        now = time.monotonic()
        by_url = {w.url: w for w in workers}
        views = {i: p.view for i, p in enumerate(self.discovery.parts) if p.view is not None and p.view.synced}
        exact = {}
        cands = []
        for w in workers:
            cached, free, host, store = matches.get((w.allocator, w.pool_id), (0, w.free_blocks, 0, 0))
            exact[w.url] = cached + host + store  # what its usage will count as cached
            soon = max(cached, (computing or {}).get(w.url, 0))
            # Free blocks holding no cached prefix: at least the free ones beyond every block
            # holding a hash (exact on an idle pool); unknown without a view in step.
            view = views.get(w.allocator) if w.pool_id else None
            held = view.held_blocks(w.pool_id) if view is not None else None
            clean = None if held is None else max(free - held, 0)
            tiers = (host, store) if soon == cached else (0, 0)  # a prompt being computed there: in its KV pool
            recent = 0  # only kv records what it sends
            if self.policy == "kv":
                holds = functools.partial(view.holds, w.pool_id) if view is not None else None
                recent = self.recent.blocks(w.url, holds, self.computing)
                self.metrics.recent_blocks.labels(w.name).set(recent)
            cands.append(Candidate(w.url, soon, free, w.num_blocks, self.in_flight.get(w.url, 0),
                                   w.block_size, clean, *tiers, recent_blocks=recent))
        order = rank(self.policy, cands, prompt_tokens, next(self._turns), self.balance)
        reachable = self.discovery.allocator_answers
        order.sort(key=lambda c: (self.down_until.get(c.key, 0.0) > now,  # stable: keeps the ranking
                                  not reachable(by_url[c.key].allocator)))
        return [(by_url[c.key], exact[c.key]) for c in order]

    def place(self, workers: Sequence[Worker], matches: dict[tuple[int, str], Match],
              tokens: list[int] | None, salt: str | None, computing: dict[str, int] | None = None,
              seen: dict | None = None) -> tuple[int, list[tuple[Worker, int]]]:
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
        """Request `rid`'s prompt goes to `worker`: computing there, and its blocks the newest sent there."""
        self.computing[rid] = (worker.url, salt, tokens)
        if self.policy == "kv":
            self.recent.record(worker.url, rid, worker.model_fingerprint, worker.block_size, worker.num_blocks,
                               tokens, salt)
            self.metrics.recent_blocks.labels(worker.name).set(self.recent.blocks(worker.url))

    # ------------------------------------------------------------ proxying
    async def forward(self, request: Request, kind: str, model_cls) -> Response:
        t0 = time.perf_counter()
        req = await read_body(request, model_cls)
        req.check_sequences()
        workers = self.candidates_for(req.model)
        if not workers:
            return self._no_model(req.model)
        tokens = None
        if self.policy == "kv" and self.allocators:
            size = sum(len(m.text()) for m in req.messages) if kind == "chat" else _prompt_size(req.prompt)
            tokens = await off_loop(self.prompt_ids, kind, req, size=size)
        salt = self.cache_salt(request, req.cache_salt)
        matches = await self.cached_tokens(workers, tokens, salt)
        # Compared with every prompt in flight a block at a time: a long prompt's off the loop;
        # `place` then adds the prompts placed meanwhile, and ranks and records with no await.
        seen = dict(self.computing)
        computing = await off_loop(self.being_computed, workers, tokens, salt,
                                   list(seen.values()), size=len(tokens or ()))
        rid, order = self.place(workers, matches, tokens, salt, computing, seen)
        best = max((c for _, c in order), default=0)
        routing_s = time.perf_counter() - t0
        self.metrics.routing_seconds.labels(self.policy).observe(routing_s)
        body = await request.body()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in _HOP] + self.worker_auth(request)
        why = "no worker answered"
        for worker, cached in order[: self.max_attempts]:
            if tokens and worker is not order[0][0]:  # a retry: placed on the next in the ranking
                self.placed(rid, worker, tokens, salt)
            try:
                upstream, start, whole = await unless_gone(
                    request, self._send(worker, request.url.path, body, headers, bool(req.stream)))
            except ClientGone:  # the worker's connection is closed: it aborts the request
                self.computing.pop(rid, None)
                return Response(status_code=499)  # nobody reads it
            except _Started as started:  # the worker has the request: another would compute it again
                self.computing.pop(rid, None)
                self.metrics.failed.labels("worker_timeout").inc()
                log.warning("worker %s at %s: %s; not retried", worker.name, worker.url, started)
                raise ApiError(504, f"{worker.name} took the request but sent no answer within "
                                    f"{self.first_byte_timeout:g} s; it is not sent to another worker, which "
                                    "would compute it again", type_="server_error", code="worker_timeout") from None
            except _TooLarge as large:  # computed: another worker would compute as much again
                self.computing.pop(rid, None)
                self.metrics.failed.labels("worker_answer_too_large").inc()
                log.warning("worker %s at %s: %s; not retried", worker.name, worker.url, large)
                raise ApiError(502, f"{worker.name}'s answer is larger than the router passes on "
                                    f"({self.max_answer_bytes} bytes: PAGEDKV_ROUTER_MAX_ANSWER_MB): {large}",
                               type_="server_error", code="worker_answer_too_large") from None
            except _Skip as skip:
                self.computing.pop(rid, None)
                why = f"{worker.name}: {skip}"
                self.metrics.retries.labels(skip.reason).inc()
                log.warning("worker %s at %s: %s; trying another", worker.name, worker.url, skip)
                continue
            except BaseException:  # cancelled (the client left): nothing is computed for it
                self.computing.pop(rid, None)
                raise
            self.metrics.routed.labels(worker.name, self.policy).inc()
            self.metrics.prompt_tokens.labels(self.policy).inc(len(tokens or ()))
            self.metrics.cached_chosen.labels(self.policy).inc(cached)
            self.metrics.cached_best.labels(self.policy).inc(best)
            answer_headers = self._answer_headers(worker, upstream, cached, routing_s)
            if whole:  # the whole answer is here: one response, the worker's connection free
                self.answered(rid)
                return Response(start, status_code=upstream.status, headers=answer_headers)
            return self._relay(worker, upstream, answer_headers, rid, start)
        self.metrics.failed.labels("no_worker_available").inc()
        raise ApiError(503, f"no worker could take the request ({why})", type_="server_error",
                       code="no_worker_available")

    @property
    def http(self) -> aiohttp.ClientSession:
        """The connection pool to the workers (aiohttp: a third of httpx's
        time per proxied request here). Bodies pass unchanged both ways: no
        decompression, no headers of its own beyond Host and Content-Length."""
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                trace_configs=[_HEADERS_SENT],
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._http

    async def _send(self, worker: Worker, path: str, body: bytes, headers,
                    stream: bool) -> tuple[aiohttp.ClientResponse, bytes, bool]:
        """The worker's answer, status and headers read, with the start of its body and
        whether that is all of it: a request that did not ask for a stream has its body
        read whole when it is at most WHOLE_ANSWER_BYTES (the connection goes back to
        the pool; a worker failing during it is skipped), else its first bytes (the rest
        is passed on). _Skip when it is not to be used (nothing has reached the client);
        _Started when the worker took the request and did not answer in time;
        _TooLarge for an answer that says it is over `max_answer_bytes`."""
        self._enter(worker)
        upstream = None
        sent: dict[str, bool] = {}  # `_headers_sent` marks it once the request's head is on the wire
        try:
            upstream = await asyncio.wait_for(
                self.http.post(worker.url + path, data=body, headers=headers, trace_request_ctx=sent),
                self.first_byte_timeout)
            if upstream.status in RETRY_STATUSES:
                skip = _Skip("unavailable", f"it answered {upstream.status}")
            elif (upstream.content_length or 0) > self.max_answer_bytes:
                skip = _TooLarge(f"it answered {upstream.content_length} bytes")
            elif stream and upstream.content_type == "text/event-stream":
                return upstream, b"", False  # still in flight: the relay ends it
            else:
                start = await asyncio.wait_for(_read_upto(upstream, WHOLE_ANSWER_BYTES + 1), self.first_byte_timeout)
                if len(start) <= WHOLE_ANSWER_BYTES:
                    self._leave(worker)  # read whole: the connection goes back to the pool
                    return upstream, start, True
                return upstream, start, False
        except aiohttp.ClientError as exc:  # before TimeoutError: a connect timeout is one of these
            skip = _Skip("unreachable", type(exc).__name__)
        except TimeoutError:
            if sent:
                skip = _Started(f"no answer within {self.first_byte_timeout:g} s")
            else:
                skip = _Skip("timeout", f"no connection within {self.first_byte_timeout:g} s")
        except BaseException:
            if upstream is not None:
                upstream.close()
            self._leave(worker)
            raise
        if upstream is not None:
            upstream.close()
        self._leave(worker, down=True)
        raise skip

    @staticmethod
    def _answer_headers(worker: Worker, upstream: aiohttp.ClientResponse, cached: int,
                        routing_s: float) -> dict[str, str]:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_OUT}
        headers["x-pagedkv-worker"] = worker.name
        headers["x-pagedkv-cached-tokens"] = str(cached)  # what MatchPrefix said the worker held
        headers["x-pagedkv-routing-ms"] = f"{routing_s * 1000:.3f}"  # choosing it took
        return headers

    def _relay(self, worker: Worker, upstream: aiohttp.ClientResponse, headers: dict[str, str],
               rid: int, start: bytes = b"") -> Response:
        """The rest of an answer passed on chunk by chunk as it arrives, after `start`:
        a stream of events, or a body too long to hold whole. Bounded: at most
        `max_answer_bytes` in all, and the worker may keep the router waiting at most
        `first_byte_timeout` in all for a body, or between two events of a stream (a
        worker sending a byte at a time is waited for as long as one sending nothing).
        Past either bound the answer ends: a stream with an error event, a body with
        the connection closed before its end (the client sees it cut)."""
        done = False
        events = upstream.content_type == "text/event-stream"

        def close() -> None:
            nonlocal done
            if not done:
                done = True
                self.answered(rid)
                upstream.close()
                self._leave(worker)

        def failed(reason: str, message: str, code: str | None = None) -> bytes:
            self.metrics.failed.labels(reason).inc()
            log.warning("worker %s: %s", worker.name, message)
            if not events:
                raise _Cut(message)  # the body ends unfinished: uvicorn closes the connection
            error = {"error": {"message": message, "type": "server_error", "param": None, "code": code or reason}}
            # (a blank line first ends any event the worker left unfinished)
            return f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

        async def chunks() -> AsyncIterator[bytes]:
            total, waited = len(start), 0.0  # the worker's time so far: for a body, or since the last event
            try:
                if start:
                    yield start
                while True:
                    t0 = time.monotonic()
                    try:
                        chunk = await asyncio.wait_for(upstream.content.readany(),
                                                       max(self.first_byte_timeout - waited, 0.0))
                    except TimeoutError:
                        yield failed("worker_timeout", f"the worker sent no {'event' if events else 'answer'} "
                                                       f"within {self.first_byte_timeout:g} s")
                        return
                    if not chunk:
                        return
                    waited = 0.0 if events and b"\n\n" in chunk else waited + time.monotonic() - t0
                    total += len(chunk)
                    if total > self.max_answer_bytes:
                        yield failed("worker_answer_too_large", f"the worker's answer passed "
                                                                f"{self.max_answer_bytes} bytes")
                        return
                    yield chunk
            except aiohttp.ClientError as exc:
                yield failed("worker_failed_mid_answer", f"the worker failed mid-answer ({type(exc).__name__})",
                             "worker_failed")
            finally:
                close()

        from starlette.background import BackgroundTask

        return StreamingResponse(chunks(), status_code=upstream.status, headers=headers,
                                 background=BackgroundTask(close))

    def answered(self, rid: int) -> None:
        """Request `rid` answered: its prompt's blocks are cached on its worker, the view
        hears of them by events; its placement counts a while longer."""
        if rid in self.computing:
            asyncio.get_running_loop().call_later(PLACED_LINGER_S, self.computing.pop, rid, None)

    def _enter(self, worker: Worker) -> None:
        self.in_flight[worker.url] = self.in_flight.get(worker.url, 0) + 1
        self.metrics.in_flight.labels(worker.name).set(self.in_flight[worker.url])

    def _leave(self, worker: Worker, down: bool = False) -> None:
        self.in_flight[worker.url] = max(self.in_flight.get(worker.url, 1) - 1, 0)
        self.metrics.in_flight.labels(worker.name).set(self.in_flight[worker.url])
        if down:
            self.down_until[worker.url] = time.monotonic() + self.cooldown_s
        else:
            self.down_until.pop(worker.url, None)

    def _no_model(self, model: str) -> Response:
        served = sorted({w.served_model_name for w in self.discovery.workers.values() if w.served_model_name})
        if not self.discovery.workers:
            self.metrics.failed.labels("no_workers").inc()
            raise ApiError(503, "no worker is registered with the router's allocator yet", type_="server_error",
                           code="no_workers")
        raise ApiError(404, f"the model {model!r} does not exist; the workers serve {served}",
                       param="model", type_="not_found_error", code="model_not_found")

    async def models(self, request: Request) -> dict:
        """Every served model's card, from a worker that serves it."""
        groups: dict[str, list[Worker]] = {}
        for w in self.discovery.workers.values():
            groups.setdefault(w.served_model_name or w.url, []).append(w)
        headers = dict(self.worker_auth(request))

        async def cards(ws: list[Worker]) -> list[dict]:
            for w in ws:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                    async with self.http.get(f"{w.url}/v1/models", headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                        status = r.status
                        data = await r.json(content_type=None) if status == 200 else None
                    if status == 200:
                        return list(data["data"])
                    if status == 401:
                        raise ApiError(401, "invalid or missing API key: send the header "
                                            "`Authorization: Bearer KEY`", code="invalid_api_key")
            name = ws[0].served_model_name
            return [{"id": name, "object": "model", "created": 0, "owned_by": "pagedkv"}] if name else []

        found = await asyncio.gather(*(cards(ws) for _, ws in sorted(groups.items())))
        data = {card["id"]: card for group in found for card in group}
        return {"object": "list", "data": list(data.values())}

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
        for client in self.allocators:
            await client.aclose()


def _prompt_size(prompt) -> int:
    """How long the prompt that places a completion is (a batch's first), in
    characters or ids, measured without copying it (`str` of a million ids
    would take the loop ~0.1 s)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, (str, list)) else 0


def _unreachable(exc: BaseException) -> bool:
    """A gRPC error that says the allocator did not answer (as opposed to refusing)."""
    code = getattr(exc, "code", None)
    return callable(code) and code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def _headers_sent(_session, context, _params) -> None:
    if isinstance(context.trace_request_ctx, dict):
        context.trace_request_ctx["sent"] = True


_HEADERS_SENT = aiohttp.TraceConfig()
_HEADERS_SENT.on_request_headers_sent.append(_headers_sent)


class _Started(Exception):
    """The worker took the request (its head was sent) but did not answer in time."""


class _TooLarge(Exception):
    """The worker's answer says it is over the router's bound: not passed on, not retried."""


class _Cut(Exception):
    """A body passed on ends unfinished (the worker broke a bound mid-answer)."""


async def _read_upto(upstream: aiohttp.ClientResponse, n: int) -> bytes:
    """The body's first `n` bytes, or all of it when shorter."""
    parts: list[bytes] = []
    size = 0
    while size < n:
        chunk = await upstream.content.read(n - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


class _Skip(Exception):
    """This worker is not to be used for this request; `reason` is the
    metrics label (`unreachable`, `timeout`, `unavailable`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def create_app(router: Router, api_key: str | Sequence[str] | None = None) -> FastAPI:
    """The router's HTTP app; starts and stops `router.discovery` with the server.
    `api_key`: one key or several, one of which every /v1/* request must carry."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.discovery.start()
        try:
            yield
        finally:
            router.discovery.close()
            await router.aclose()

    app = FastAPI(title="PagedKV router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if api_key:  # added last, so it runs first
        app.add_middleware(ApiKeyCheck, api_keys=api_key)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "text", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.forward(request, "chat", ChatCompletionRequest)

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.models(request)

    @app.get("/health")
    async def health():
        d = router.discovery
        # several allocators: "ok" while every one answers, "unreachable" while one or more does not
        body = {"workers": len(d.workers), "allocator": "ok" if d.allocator_ok else "unreachable",
                "policy": router.policy}
        if len(d.parts) > 1:
            body["allocators"] = len(d.parts)
            body["allocators_unreachable"] = d.allocators_unreachable
        if not d.workers:
            return JSONResponse(status_code=503, headers={"Retry-After": "5"},
                                content={"status": "unavailable", "code": "no_workers", **body})
        return {"status": "ok", **body}

    @app.get("/metrics")
    async def metrics():
        d = router.discovery
        router.metrics.workers.set(len(d.workers))
        router.metrics.unproven_pools.set(d.unproven_pools)
        router.metrics.allocators.set(len(d.parts))
        router.metrics.allocators_unreachable.set(d.allocators_unreachable)
        router.metrics.views_synced.set(sum(p.view is not None and p.view.synced for p in d.parts))
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
