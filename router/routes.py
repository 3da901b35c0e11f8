"""The router's HTTP app: the worker's OpenAI-style API, answered by a worker.

`/v1/completions`, `/v1/chat/completions`: `Router.forward`; `/v1/models`:
every served model's card (from a worker serving it); `/health`: 200 while
some worker is known, else 503 `no_workers`; `/metrics`: the router's
series (`metrics.py`). With API keys every /v1/* request must carry one
(`ApiKeyCheck`, as a worker checks it); bodies are bounded as a worker's are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedkv_base.api.errors import MAX_BODY_BYTES, ApiKeyCheck, BodyLimit, install_error_handlers
from pagedkv_base.api.protocol import ChatCompletionRequest, CompletionRequest
from router.app import Router


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
        body = {
            "workers": len(d.workers),
            "allocator": "ok" if d.allocator_ok else "unreachable",
            "policy": router.policy,
        }
        if len(d.parts) > 1:
            body["allocators"] = len(d.parts)
            body["allocators_unreachable"] = d.allocators_unreachable
        if not d.workers:
            return JSONResponse(
                status_code=503,
                headers={"Retry-After": "5"},
                content={"status": "unavailable", "code": "no_workers", **body},
            )
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
