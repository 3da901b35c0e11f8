"""The router: an OpenAI-style request answered by one of many workers.

`Router.forward`: the body is parsed and validated with the worker's own
request models (`pagedkv_base.api.bodies`: a bad request gets the worker's
exact 400), the prompt tokenized once with the worker's tokenizer and chat
template; `matching` says how much of it each pool holds, `placement` ranks
the workers, `proxy` sends the body to the first that takes it. The router
presents its own key (`worker_api_key`) and the client's tenant id
(`x-pagedkv-tenant`, an HMAC of its key), never the client's key; with
`cache_salt_per_api_key` a prompt is matched under its key's salt. Only
proven workers (`discovery.prove`) or listed ones (`--workers`) are sent
anything. Why: docs/architecture.md, "The router's rules, and why".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask, BackgroundTasks

from allocator_service.core import InvalidArgument, check_cache_salt
from pagedkv_base.api.bodies import off_loop, read_body
from pagedkv_base.api.errors import ApiError
from pagedkv_base.api.tenants import TENANT_HEADER, api_key_of, tenant_of, tenant_salt
from router import pd
from router.discovery import Discovery, MergedDiscovery, Worker
from router.matching import Matcher, prompt_ids, prompt_size
from router.metrics import RouterMetrics
from router.placement import Placement
from router.policy import Balance
from router.proxy import Proxy
from router.shares import KeyShares

log = logging.getLogger(__name__)


class Router:
    """What the routes share: the tokenizer, the workers, and the matching,
    placement and proxy over them."""

    def __init__(
        self,
        tokenizer,
        discovery: Discovery | MergedDiscovery,
        policy: str,
        *,
        allocators: Sequence = (),
        metrics: RouterMetrics | None = None,
        first_byte_timeout: float = 60.0,
        connect_timeout: float = 2.0,
        cooldown_s: float = 5.0,
        max_attempts: int = 3,
        max_answer_bytes: int = 1 << 30,
        worker_api_key: str | None = None,
        cache_salt_per_api_key: bool = True,
        balance: Balance | None = None,
        transfer_timeout: float = 5.0,
        shares: KeyShares | None = None,
    ) -> None:
        """`allocators`: RouterClients, in the order of `Worker.allocator`; none:
        routing by load alone. `transfer_timeout`: the longest a split request waits
        for its prompt's blocks in the store after its prefill leg (seconds)."""
        self.tokenizer = tokenizer
        self.transfer_timeout = transfer_timeout
        # what the router presents to workers for a request let in without a key (never a
        # client's own header)
        self.worker_api_key = worker_api_key
        self.cache_salt_per_api_key = cache_salt_per_api_key
        self.discovery = discovery
        self.policy = policy
        self.metrics = metrics or RouterMetrics()
        self.shares = shares or KeyShares(0, 0)
        self.matching = Matcher(discovery, allocators, policy, self.metrics)
        self.placement = Placement(
            discovery, policy, balance or Balance(), self.metrics, cooldown_s
        )
        self.proxy = Proxy(
            self.placement,
            self.metrics,
            first_byte_timeout=first_byte_timeout,
            connect_timeout=connect_timeout,
            max_attempts=max_attempts,
            max_answer_bytes=max_answer_bytes,
        )

    def worker_auth(self, request: Request) -> list[tuple[str, str]]:
        """The headers the router presents to workers for `request`: its own key
        (`worker_api_key`), never the client's, and behind keys the client's
        tenant id (TENANT_HEADER), under which the worker caches its blocks."""
        headers = (
            [("authorization", f"Bearer {self.worker_api_key}")] if self.worker_api_key else []
        )
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

    async def forward(self, request: Request, kind: str, model_cls) -> Response:
        """A completion (`kind` "text") or chat completion ("chat") request, answered by a
        worker, or split between a prefill and a decode worker (`router.pd`)."""
        t0 = time.perf_counter()
        req = await read_body(request, model_cls)
        asked = req.check_sequences()
        try:
            release = self.shares.admit(api_key_of(request), asked)
        except ApiError:
            self.metrics.failed.labels("key_share").inc()
            raise
        try:
            response = await self._forward(request, kind, req, t0)
        except BaseException:
            release()
            raise
        if isinstance(response, StreamingResponse):  # given back when its answer ends
            response.body_iterator = _then(response.body_iterator, release)
            # (and after it is sent, or the client left, even if it never started)
            response.background = BackgroundTasks(
                [t for t in (response.background, BackgroundTask(release)) if t is not None]
            )
        else:
            release()
        return response

    async def _forward(self, request: Request, kind: str, req, t0: float) -> Response:
        placement = self.placement
        workers = placement.candidates_for(req.model)
        if not workers:
            return self._no_model(req.model)
        try:
            route = pd.plan(workers)
        except ApiError:
            self.metrics.failed.labels("no_worker_for_role").inc()
            raise
        salt = self.cache_salt(request, req.cache_salt)
        if isinstance(route, pd.Split):
            return await self._split(request, kind, req, route, salt, t0)
        tokens = None
        if self.policy == "kv" and self.matching.allocators:
            tokens = await self._prompt(kind, req)
        return await self._send(request, route, tokens, salt, bool(req.stream), t0)

    async def _prompt(self, kind: str, req) -> list[int] | None:
        return await off_loop(prompt_ids, self.tokenizer, kind, req, size=prompt_size(kind, req))

    async def _send(
        self,
        request: Request,
        workers: Sequence[Worker],
        tokens: list[int] | None,
        salt: str | None,
        stream: bool,
        t0: float,
        *,
        matches: dict | None = None,
        body: bytes | None = None,
        extra: Sequence[tuple[str, str]] = (),
        answer_headers: dict[str, str] | None = None,
        prefill_leg: bool = False,
    ) -> Response:
        """The request (or `body`) placed among `workers` and sent to the first that takes
        it; `matches`: the pools' matches when already asked. A `prefill_leg` is not
        counted as a client request (its time is in pagedkv_router_pd_prefill_seconds)."""
        placement = self.placement
        if matches is None:
            matches = await self.matching.cached_tokens(workers, tokens, salt)
        # Compared with every prompt in flight a block at a time: a long prompt's off the loop;
        # `place` then adds the prompts placed meanwhile, and ranks and records with no await.
        seen = dict(placement.computing)
        computing = await off_loop(
            placement.being_computed,
            workers,
            tokens,
            salt,
            list(seen.values()),
            size=len(tokens or ()),
        )
        rid, order = placement.place(workers, matches, tokens, salt, computing, seen)
        routing_s = time.perf_counter() - t0
        if not prefill_leg:
            self.metrics.routing_seconds.labels(self.policy).observe(routing_s)
        return await self.proxy.forward(
            request,
            order,
            rid,
            tokens,
            salt,
            self.worker_auth(request) + list(extra),
            stream,
            routing_s,
            body=body,
            answer_headers=answer_headers,
            prefill_leg=prefill_leg,
        )

    async def _split(
        self, request: Request, kind: str, req, split: pd.Split, salt: str | None, t0: float
    ) -> Response:
        """The prefill leg, the wait for its blocks in the store, then the decode leg
        (`router.pd`). A prefill leg that fails or a transfer not done in time: the
        decode worker computes what it does not find."""
        stream = bool(req.stream)
        tokens = await self._prompt(kind, req)
        decode = [w for ws in split.decode.values() for w in ws]
        if not tokens:  # no prompt to move: the worker answers (the error, if one)
            return await self._send(request, decode, None, salt, stream, t0)
        sent = time.perf_counter()
        prefill = await self._prefill(request, split.prefill, tokens, salt, t0)
        if isinstance(prefill, Response):
            return prefill  # the client left
        self.metrics.pd_prefill_seconds.observe(time.perf_counter() - sent)
        matches = None
        if prefill is None:
            outcome = "prefill_failed"
        else:
            decode = split.decode[prefill.store_namespace]
            waited = time.perf_counter()
            done, matches = await pd.wait_for_transfer(
                lambda ws: self.matching.cached_tokens(ws, tokens, salt, any_policy=True),
                decode,
                pd.wanted_tokens(tokens, decode[0].block_size),
                self.transfer_timeout,
            )
            self.metrics.pd_transfer_wait_seconds.observe(time.perf_counter() - waited)
            outcome = "transferred" if done else "incomplete"
        self.metrics.pd_requests.labels(outcome).inc()
        name = prefill.name if prefill is not None else ""
        return await self._send(
            request,
            decode,
            tokens,
            salt,
            stream,
            time.perf_counter(),
            matches=matches if self.policy == "kv" else None,
            answer_headers={pd.PREFILL_WORKER_HEADER: name},
        )

    async def _prefill(
        self, request: Request, workers: Sequence[Worker], tokens, salt, t0: float
    ) -> Worker | Response | None:
        """The prefill leg: the worker that computed the prompt, None when none did,
        or the answer to give when the client left."""
        body = await request.body()
        body = await off_loop(pd.prefill_body, body, size=len(body))  # a long one off the loop
        try:
            answer = await self._send(
                request,
                workers,
                tokens,
                salt,
                False,
                t0,
                body=body,
                extra=[(pd.TRANSFER_HEADER, "prefill")],
                prefill_leg=True,
            )
        except ApiError as exc:  # no prefill worker answered: the decode worker computes it
            log.warning("prefill leg: %s; the decode worker computes the prompt", exc.message)
            return None
        if answer.status_code == 499:
            return answer
        if isinstance(answer, StreamingResponse):  # a long answer: read to its end, dropped
            async for _ in answer.body_iterator:
                pass
        if answer.status_code != 200:
            return None
        name = answer.headers.get("x-pagedkv-worker")
        return next((w for w in workers if w.name == name), None)

    def _no_model(self, model: str) -> Response:
        served = sorted(
            {w.served_model_name for w in self.discovery.workers.values() if w.served_model_name}
        )
        if not self.discovery.workers:
            self.metrics.failed.labels("no_workers").inc()
            raise ApiError(
                503,
                "no worker is registered with the router's allocator yet",
                type_="server_error",
                code="no_workers",
            )
        raise ApiError(
            404,
            f"the model {model!r} does not exist; the workers serve {served}",
            param="model",
            type_="not_found_error",
            code="model_not_found",
        )

    async def models(self, request: Request) -> dict:
        """Every served model's card, from a worker that serves it."""
        groups: dict[str, list[Worker]] = {}
        for w in self.discovery.workers.values():
            groups.setdefault(w.served_model_name or w.url, []).append(w)
        headers = dict(self.worker_auth(request))

        async def cards(ws: list[Worker]) -> list[dict]:
            for w in ws:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                    async with self.proxy.http.get(
                        f"{w.url}/v1/models",
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=5.0),
                    ) as r:
                        status = r.status
                        data = await r.json(content_type=None) if status == 200 else None
                    if status == 200:
                        return list(data["data"])
                    if status == 401:
                        raise ApiError(
                            401,
                            "invalid or missing API key: send the header "
                            "`Authorization: Bearer KEY`",
                            code="invalid_api_key",
                        )
            name = ws[0].served_model_name
            return (
                [{"id": name, "object": "model", "created": 0, "owned_by": "pagedkv"}]
                if name
                else []
            )

        found = await asyncio.gather(*(cards(ws) for _, ws in sorted(groups.items())))
        data = {card["id"]: card for group in found for card in group}
        return {"object": "list", "data": list(data.values())}

    async def aclose(self) -> None:
        await self.proxy.close()
        for client in self.matching.allocators:
            await client.aclose()


async def _then(chunks: AsyncIterator[bytes], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """`chunks`, then `release()` however they end (done, failed or the client gone)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        release()
