"""The router's Prometheus series (its own registry; names carry their unit,
counters end in `_total`). The Grafana dashboard's router row reads them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Routing is sub-millisecond to a few ms (tokenize + match in the view, or one MatchPrefix call).
ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


# A prefill leg computes a prompt and one token, its transfer a few steps: ms to tens of seconds.
PD_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The outcomes of a split request's transfer (router/pd.py), the `outcome` label.
PD_OUTCOMES = ("transferred", "incomplete", "prefill_failed")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.routed = Counter(
            "pagedkv_router_requests",
            "Client requests sent to a worker (the one that answered the client: of a split "
            "request, its decode worker; its prefill leg counts in "
            "pagedkv_router_pd_prefill_legs).",
            ["worker", "policy"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedkv_router_prompt_tokens",
            "Prompt tokens of routed requests.",
            ["policy"],
            registry=r,
        )
        self.cached_chosen = Counter(
            "pagedkv_router_prefix_cached_tokens",
            "Prompt tokens the chosen worker's pool and tiers held cached when the request "
            'was routed: a forecast (docs/architecture.md, "Counts").',
            ["policy"],
            registry=r,
        )
        self.cached_best = Counter(
            "pagedkv_router_prefix_best_cached_tokens",
            "Prompt tokens the best-placed worker's pool and tiers held cached when the "
            "request was routed.",
            ["policy"],
            registry=r,
        )
        self.routing_seconds = Histogram(
            "pagedkv_router_routing_seconds",
            "Time to choose a worker: tokenize, match (view or MatchPrefix), rank.",
            ["policy"],
            buckets=ROUTING_BUCKETS,
            registry=r,
        )
        self.match_seconds = Histogram(
            "pagedkv_router_match_prefix_seconds",
            "Time of the MatchPrefix call (the allocator's share of the routing time).",
            buckets=ROUTING_BUCKETS,
            registry=r,
        )
        self.view_match_seconds = Histogram(
            "pagedkv_router_view_match_seconds",
            "Time to match a prompt in the router's copy of the allocators' prefix caches, kept "
            "from their events (no call; what replaces MatchPrefix while the copy is in step).",
            buckets=ROUTING_BUCKETS,
            registry=r,
        )
        self.views_synced = Gauge(
            "pagedkv_router_prefix_views_synced",
            "Allocators whose prefix caches the router holds in step from their events (the rest "
            "are asked MatchPrefix per request).",
            registry=r,
        )
        self.retries = Counter(
            "pagedkv_router_retries",
            "Requests sent again to another worker before any byte reached the client, by why.",
            ["reason"],
            registry=r,
        )
        self.failed = Counter(
            "pagedkv_router_failed_requests",
            "Requests the router answered with an error of its own, by why.",
            ["reason"],
            registry=r,
        )
        self.match_errors = Counter(
            "pagedkv_router_match_prefix_errors",
            "MatchPrefix calls that failed (the request was routed by load alone).",
            registry=r,
        )
        self.in_flight = Gauge(
            "pagedkv_router_in_flight_requests",
            "Requests a worker is answering through this router.",
            ["worker"],
            registry=r,
        )
        self.recent_blocks = Gauge(
            "pagedkv_router_recent_blocks",
            "Blocks of the prompts this router sent the worker lately that its pool still holds, "
            "as of the last request ranked (kv: a prompt no "
            "pool holds goes to the worker with the fewest).",
            ["worker"],
            registry=r,
        )
        self.pd_requests = Counter(
            "pagedkv_router_pd_requests",
            "Requests split between a prefill and a decode worker, by what the transfer became: "
            "transferred (the decode worker finds the prompt's whole blocks), incomplete (not "
            "all found within PAGEDKV_ROUTER_PD_TRANSFER_TIMEOUT: it computes the rest), "
            "prefill_failed (no prefill worker answered: it computes the prompt).",
            ["outcome"],
            registry=r,
        )
        self.pd_prefill_legs = Counter(
            "pagedkv_router_pd_prefill_legs",
            "Prefill legs of split requests a prefill worker answered.",
            ["worker"],
            registry=r,
        )
        self.pd_prefill_seconds = Histogram(
            "pagedkv_router_pd_prefill_seconds",
            "A split request's prefill leg: from sending it until its answer.",
            buckets=PD_BUCKETS,
            registry=r,
        )
        self.pd_transfer_wait_seconds = Histogram(
            "pagedkv_router_pd_transfer_wait_seconds",
            "A split request's wait, after its prefill leg, until a decode worker finds its "
            "blocks in the shared store (or the wait ends).",
            buckets=PD_BUCKETS,
            registry=r,
        )
        for outcome in PD_OUTCOMES:
            self.pd_requests.labels(outcome)
        self.workers = Gauge(
            "pagedkv_router_workers", "Workers the router may send requests to.", registry=r
        )
        self.unproven_pools = Gauge(
            "pagedkv_router_unproven_pools",
            "Listed pools never sent a request: the worker at the advertised address has not "
            "proven it serves that pool (GET /pagedkv/identity).",
            registry=r,
        )
        self.allocators = Gauge(
            "pagedkv_router_allocators",
            "Allocators the router follows (pools sharded over them).",
            registry=r,
        )
        self.allocators_unreachable = Gauge(
            "pagedkv_router_allocators_unreachable",
            "Allocators whose last listing or MatchPrefix "
            "went unanswered (their workers rank last).",
            registry=r,
        )
