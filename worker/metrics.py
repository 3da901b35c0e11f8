"""Prometheus metrics of a worker (docs/ARCHITECTURE.md, "Observability").

Names carry their unit, counters end in `_total`; every series has the labels
`worker` (the worker id) and `model`. Pool gauges are read from the allocator
client at scrape time by a custom collector, so they are never stale and the
engine loop does no metric bookkeeping for them.

Registry per worker (not the global default) so tests can run several engines
in one process.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "pagedkv_worker"

# Latency buckets (seconds) fit for CPU and GPU serving alike.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# Every metric name a worker exports (the dashboard test checks against this).
METRIC_NAMES = (
    f"{PREFIX}_kv_pool_blocks",
    f"{PREFIX}_kv_blocks_used",
    f"{PREFIX}_kv_blocks_cached",
    f"{PREFIX}_kv_blocks_free",
    f"{PREFIX}_kv_pool_bytes",
    f"{PREFIX}_kv_usage_ratio",
    f"{PREFIX}_kv_slot_utilisation_ratio",
    f"{PREFIX}_running_sequences",
    f"{PREFIX}_waiting_sequences",
    f"{PREFIX}_preemptions_total",
    f"{PREFIX}_prompt_tokens_total",
    f"{PREFIX}_generation_tokens_total",
    f"{PREFIX}_prefix_cache_queried_tokens_total",
    f"{PREFIX}_prefix_cache_hit_tokens_total",
    f"{PREFIX}_requests_total",
    f"{PREFIX}_time_to_first_token_seconds",
    f"{PREFIX}_inter_token_latency_seconds",
    f"{PREFIX}_step_duration_seconds",
    f"{PREFIX}_allocator_step_seconds",
    f"{PREFIX}_allocator_retries_total",
    f"{PREFIX}_allocator_unavailable_seconds_total",
    f"{PREFIX}_step_errors_total",
)


class _PoolCollector(Collector):
    """Reads the pool's stats (via the allocator client) at scrape time."""

    def __init__(self, read_stats: Callable[[], object], labels: dict[str, str], pool_bytes: int) -> None:
        self._read = read_stats
        self._labels = labels
        self._pool_bytes = pool_bytes

    def describe(self):  # static description; avoids a collect() at registration
        return []

    def collect(self):
        try:
            s = self._read()
        except Exception:  # noqa: BLE001 - an unreachable allocator must not break /metrics
            return
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge("kv_pool_blocks", "Blocks in this worker's KV pool.", s.num_blocks)
        yield gauge("kv_blocks_used", "Blocks named by at least one block table.", s.used_blocks)
        yield gauge("kv_blocks_cached", "Free blocks still holding a reusable prefix.", s.cached_blocks)
        yield gauge("kv_blocks_free", "Free blocks (cached ones included).", s.free_blocks)
        yield gauge("kv_pool_bytes", "Bytes of K/V memory the pool holds.", self._pool_bytes)
        yield gauge("kv_usage_ratio", "Used blocks over all blocks.", s.used_blocks / s.num_blocks)
        yield gauge(
            "kv_slot_utilisation_ratio",
            "Token slots holding a token over slots allocated (1 = no waste).",
            s.utilisation,
        )


class WorkerMetrics:
    def __init__(self, worker_id: str, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"worker": worker_id, "model": model}
        names = list(self.labels)
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, [*names, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, names, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, names, registry=r)

        lv = self.labels
        self.running = gauge("running_sequences", "Sequences in the running batch.").labels(**lv)
        self.waiting = gauge("waiting_sequences", "Requests waiting to be admitted.").labels(**lv)
        self._preemptions = counter("preemptions", "Running sequences preempted (blocks given back, recomputed later).", ("cause",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.").labels(**lv)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**lv)
        self.prefix_queried = counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.").labels(**lv)
        self.prefix_hit = counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.").labels(**lv)
        self._requests = counter("requests", "Requests finished, by finish reason.", ("finish_reason",))
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS).labels(**lv)
        self.itl = hist("inter_token_latency_seconds", "Time between two generated tokens of a request.", _ITL_BUCKETS).labels(**lv)
        self.step_time = hist("step_duration_seconds", "Wall time of one engine step (schedule + allocator + forward).", _STEP_BUCKETS).labels(**lv)
        self.allocator_step = hist("allocator_step_seconds", "Latency of the allocator Step call seen by the worker.", _STEP_BUCKETS).labels(**lv)
        self.allocator_retries = counter("allocator_retries", "Allocator calls that got no answer (UNAVAILABLE, deadline) and were sent again.").labels(**lv)
        self.allocator_unavailable_seconds = counter("allocator_unavailable_seconds", "Seconds spent waiting for an unavailable allocator (failed attempts and backoff): the worker stalls.").labels(**lv)
        self.step_errors = counter("step_errors", "Engine steps that raised: every request in flight failed.").labels(**lv)

    def preempted(self, cause: str) -> None:
        self._preemptions.labels(**self.labels, cause=cause).inc()

    def finished(self, reason: str) -> None:
        self._requests.labels(**self.labels, finish_reason=reason).inc()

    def watch_pool(self, read_stats: Callable[[], object], pool_bytes: int) -> None:
        """Export the pool gauges, read from `read_stats()` at scrape time."""
        self.registry.register(_PoolCollector(read_stats, self.labels, pool_bytes))
