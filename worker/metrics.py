"""Prometheus metrics of a worker (docs/operations.md, "Observing").

Names carry their unit, counters end in `_total`; every series has the labels
`worker` (the worker id), `model` (the --model value) and `model_name` (the
served model name: vLLM's label, so its dashboards' `$model_name` filter
works; deploy/prometheus/vllm-recording-rules.yml renames the series to
vLLM's `vllm:` names, docs/operations.md maps each). Pool gauges are read from the allocator
client at scrape time by a custom collector, so they are never stale and the
engine loop does no metric bookkeeping for them.

High-water marks (`*_peak`): the most KV blocks, token slots and running
sequences at once, taken at every engine step (exact, where a scrape only sees
the moment it lands on); `POST /reset_peaks` starts them again for a run.

Registry per worker (not the global default) so tests can run several engines
in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "pagedkv_worker"

# Latency buckets (seconds) fit for CPU and GPU serving alike.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# A request's phases (seconds): vLLM's request-latency
# buckets, with a finer low end for small models.
_REQUEST_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1,
    1.5,
    2,
    2.5,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    120,
    240,
    480,
    960,
    1920,
    7680,
)
# Tokens per request: 1, 2, 5, 10, ... 1,000,000 (vLLM's 1-2-5 series).
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

# Host time per engine step (seconds): from tens of microseconds (a decode step's bookkeeping) up.
_HOST_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1,
)
# The parts of a step's host time, the `part` label of step_host_seconds.
HOST_PARTS = ("schedule", "allocator_wait", "sample", "output")

# Every metric name a worker exports (the dashboard test checks against this).
METRIC_NAMES = (
    f"{PREFIX}_kv_pool_blocks",
    f"{PREFIX}_kv_blocks_used",
    f"{PREFIX}_kv_blocks_cached",
    f"{PREFIX}_kv_blocks_free",
    f"{PREFIX}_kv_pool_bytes",
    f"{PREFIX}_kv_cache_info",
    f"{PREFIX}_kv_usage_ratio",
    f"{PREFIX}_kv_slot_utilisation_ratio",
    f"{PREFIX}_threads",
    f"{PREFIX}_running_sequences",
    f"{PREFIX}_waiting_sequences",
    f"{PREFIX}_kv_slots_ahead",
    f"{PREFIX}_kv_blocks_used_peak",
    f"{PREFIX}_kv_slots_holding_tokens_peak",
    f"{PREFIX}_running_sequences_peak",
    f"{PREFIX}_preemptions_total",
    f"{PREFIX}_prompt_tokens_total",
    f"{PREFIX}_generation_tokens_total",
    f"{PREFIX}_prefix_cache_queried_tokens_total",
    f"{PREFIX}_prefix_cache_hit_tokens_total",
    f"{PREFIX}_requests_total",
    f"{PREFIX}_time_to_first_token_seconds",
    f"{PREFIX}_inter_token_latency_seconds",
    f"{PREFIX}_step_duration_seconds",
    f"{PREFIX}_step_host_seconds",
    f"{PREFIX}_device_busy_ratio",
    f"{PREFIX}_allocator_step_seconds",
    f"{PREFIX}_allocator_steps_ahead_total",
    f"{PREFIX}_allocator_calls_total",
    f"{PREFIX}_allocator_retries_total",
    f"{PREFIX}_allocator_unavailable_seconds_total",
    f"{PREFIX}_step_errors_total",
    f"{PREFIX}_e2e_request_latency_seconds",
    f"{PREFIX}_request_queue_time_seconds",
    f"{PREFIX}_request_prefill_time_seconds",
    f"{PREFIX}_request_decode_time_seconds",
    f"{PREFIX}_request_inference_time_seconds",
    f"{PREFIX}_request_prompt_tokens",
    f"{PREFIX}_request_generation_tokens",
    f"{PREFIX}_kv_tier_capacity_bytes",
    f"{PREFIX}_kv_tier_used_bytes",
    f"{PREFIX}_kv_tier_hit_tokens_total",
    f"{PREFIX}_kv_tier_saved_blocks_total",
    f"{PREFIX}_kv_tier_saved_bytes_total",
    f"{PREFIX}_kv_tier_save_seconds_total",
    f"{PREFIX}_kv_tier_loaded_blocks_total",
    f"{PREFIX}_kv_tier_loaded_bytes_total",
    f"{PREFIX}_kv_tier_load_seconds_total",
    f"{PREFIX}_kv_tier_refused_entries_total",
    f"{PREFIX}_kv_tier_served_blocks_total",
    f"{PREFIX}_kv_tier_served_bytes_total",
    f"{PREFIX}_kv_tier_store_errors_total",
)
# The KV tiers below the KV pool, the `tier` label of the kv_tier_* series.
KV_TIERS = ("host", "shared")


class PeakValues(NamedTuple):
    kv_blocks_used: int
    kv_slots_holding_tokens: int
    running_sequences: int


class Peaks:
    """High-water marks of a worker's KV use, raised at every engine step
    (the engine thread) and reset for a run (any thread).

    Taken from the running sequences' block tables after the step's
    allocator call: blocks they name (a shared block once), the slots of
    those blocks that hold a token (reserved ones included, as the
    allocator's `kv_slot_utilisation_ratio` counts them), and the sequences.
    A finished sequence's blocks, held until its Free goes out with a later
    call, are not counted: a scrape of `kv_blocks_used` can show more."""

    def __init__(self, blocks: Gauge, slots: Gauge, running: Gauge) -> None:
        self._gauges = (blocks, slots, running)
        self._lock = threading.Lock()
        self._values = PeakValues(0, 0, 0)

    def observe(self, blocks: int, slots: int, running: int) -> None:
        old = self._values
        if (
            blocks <= old.kv_blocks_used
            and slots <= old.kv_slots_holding_tokens
            and running <= old.running_sequences
        ):
            return  # the common case: nothing new, no lock
        with self._lock:
            old = self._values
            self._values = PeakValues(
                max(old.kv_blocks_used, blocks),
                max(old.kv_slots_holding_tokens, slots),
                max(old.running_sequences, running),
            )
            for gauge, value in zip(self._gauges, self._values, strict=True):
                gauge.set(value)

    def values(self) -> PeakValues:
        return self._values

    def reset(self) -> PeakValues:
        """Start again from 0 (the next step raises them to what runs then); the peaks until now."""
        with self._lock:
            old, self._values = self._values, PeakValues(0, 0, 0)
            for gauge in self._gauges:
                gauge.set(0)
        return old


class TierMetrics:
    """One KV tier's series (label `tier`): a worker.tiers.TierMeter. Its counters exist
    from the first call of `WorkerMetrics.tier(name)`, so a worker without the tier
    exports none of them; its gauges from their first `set_*`, so a size nobody
    measured is absent, not 0."""

    def __init__(self, families: dict[str, Counter | Gauge], labels: dict[str, str]) -> None:
        self._labels = labels
        self._families = families
        self.hit_tokens = families["hit_tokens"].labels(**labels)
        self.saved_blocks = families["saved_blocks"].labels(**labels)
        self.saved_bytes = families["saved_bytes"].labels(**labels)
        self.save_seconds = families["save_seconds"].labels(**labels)
        self.loaded_blocks = families["loaded_blocks"].labels(**labels)
        self.loaded_bytes = families["loaded_bytes"].labels(**labels)
        self.load_seconds = families["load_seconds"].labels(**labels)
        # a store's failed calls are a count from the start; other tiers have no store
        self.store_errors = (
            families["store_errors"].labels(**labels) if labels["tier"] == "shared" else None
        )

    def set_capacity(self, nbytes: int) -> None:
        self._families["capacity_bytes"].labels(**self._labels).set(nbytes)

    def set_used(self, nbytes: int) -> None:
        self._families["used_bytes"].labels(**self._labels).set(nbytes)

    def saved(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.saved_blocks.inc(blocks)
        self.saved_bytes.inc(nbytes)
        self.save_seconds.inc(seconds)

    def loaded(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.loaded_blocks.inc(blocks)
        self.loaded_bytes.inc(nbytes)
        self.load_seconds.inc(seconds)

    def refused(self, reason: str, blocks: int = 1) -> None:
        self._families["refused_entries"].labels(**self._labels, reason=reason).inc(blocks)

    def served(self, blocks: int, nbytes: int) -> None:
        """A `peer://` store: entries this worker served to another's pull."""
        self._families["served_blocks"].labels(**self._labels).inc(blocks)
        self._families["served_bytes"].labels(**self._labels).inc(nbytes)

    def store_error(self) -> None:
        if self.store_errors is None:
            self.store_errors = self._families["store_errors"].labels(**self._labels)
        self.store_errors.inc()


class _PoolCollector(Collector):
    """Reads the pool's stats (via the allocator client) at scrape time."""

    def __init__(
        self,
        read_stats: Callable[[], object],
        labels: dict[str, str],
        pool_bytes: int,
        kv_dtype: str,
        kv_role: str,
    ) -> None:
        self._read = read_stats
        self._labels = labels
        self._pool_bytes = pool_bytes
        self._kv_dtype = kv_dtype
        self._kv_role = kv_role

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
        yield gauge(
            "kv_blocks_cached", "Free blocks still holding a reusable prefix.", s.cached_blocks
        )
        yield gauge("kv_blocks_free", "Free blocks (cached ones included).", s.free_blocks)
        yield gauge("kv_pool_bytes", "Bytes of K/V memory the pool holds.", self._pool_bytes)
        info = GaugeMetricFamily(
            f"{PREFIX}_kv_cache_info",
            "1, labelled with the element type the KV pool "
            "stores (kv_cache_dtype: float32, bfloat16, float8_e4m3fn, ...) and the worker's "
            "part in prefill/decode disaggregation (kv_role: both, prefill, decode).",
            labels=[*names, "kv_cache_dtype", "kv_role"],
        )
        info.add_metric([*values, self._kv_dtype, self._kv_role], 1)
        yield info
        yield gauge("kv_usage_ratio", "Used blocks over all blocks.", s.used_blocks / s.num_blocks)
        yield gauge(
            "kv_slot_utilisation_ratio",
            "Token slots holding a token over slots allocated (1 = no waste).",
            s.utilisation,
        )


class WorkerMetrics:
    def __init__(
        self,
        worker_id: str,
        model: str,
        registry: CollectorRegistry | None = None,
        model_name: str | None = None,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"worker": worker_id, "model": model, "model_name": model_name or model}
        names = list(self.labels)
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, [*names, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, names, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, names, registry=r)

        lv = self.labels
        # --threads as torch applies it: read at scrape time, so it is what the process runs with
        self.threads = gauge(
            "threads", "Compute threads torch uses in this worker (--threads)."
        ).labels(**lv)
        self.running = gauge("running_sequences", "Sequences in the running batch.").labels(**lv)
        self.waiting = gauge("waiting_sequences", "Requests waiting to be admitted.").labels(**lv)
        self.slots_ahead = gauge(
            "kv_slots_ahead",
            "Token slots the allocator holds for this worker's sequences past "
            "what they computed: tokens being sampled, lookahead slots (--num-lookahead-slots), "
            "finished sequences' until their Free goes out.",
        ).labels(**lv)
        self.peaks = Peaks(
            gauge(
                "kv_blocks_used_peak",
                "Most KV blocks the running sequences' block tables named at once "
                "(a shared block once), at any engine step since the last POST /reset_peaks.",
            ).labels(**lv),
            gauge(
                "kv_slots_holding_tokens_peak",
                "Most token slots of those blocks holding a token at once "
                "(reserved slots included), at any engine step since the last POST /reset_peaks.",
            ).labels(**lv),
            gauge(
                "running_sequences_peak",
                "Most sequences in the running batch at once, at any engine step "
                "since the last POST /reset_peaks.",
            ).labels(**lv),
        )
        self._preemptions = counter(
            "preemptions",
            "Running sequences preempted (blocks given back, recomputed later).",
            ("cause",),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.").labels(**lv)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**lv)
        self.prefix_queried = counter(
            "prefix_cache_queried_tokens", "Prompt tokens admissions looked up in the prefix cache."
        ).labels(**lv)
        self.prefix_hit = counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens admissions did not compute: shared from the KV pool or loaded "
            'from a tier (docs/architecture.md, "Tiers", "Counts").',
        ).labels(**lv)
        self._requests = counter(
            "requests", "Requests finished, by finish reason.", ("finish_reason",)
        )
        self.ttft = hist(
            "time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS
        ).labels(**lv)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between two generated tokens of a request.",
            _ITL_BUCKETS,
        ).labels(**lv)
        self.step_time = hist(
            "step_duration_seconds",
            "Wall time of one engine step (schedule + allocator + forward).",
            _STEP_BUCKETS,
        ).labels(**lv)
        host = Histogram(
            f"{PREFIX}_step_host_seconds",
            "Host time of one engine step by part: schedule (planning the "
            "step and the next one's call), allocator_wait (in allocator calls, what async "
            "scheduling did not hide), sample (drawing tokens from the outputs), output (stop "
            "checks, detokenizing, streaming); the device's own time is not in it.",
            [*names, "part"],
            buckets=_HOST_BUCKETS,
            registry=r,
        )
        self.step_host = {part: host.labels(**lv, part=part) for part in HOST_PARTS}
        self.device_busy = gauge(
            "device_busy_ratio",
            "Share of the last 10 s (of the engine's clock) the device "
            "computed: CUDA events on a GPU, the stream on a sim: device, the forward pass on "
            "the CPU.",
        ).labels(**lv)
        self.device_busy_seconds = gauge(
            "device_busy_seconds",
            "Seconds the device computed since the worker started (the busy ratio's measure, "
            "whole): its change over a span, divided by the span, is the device's utilization "
            "over it.",
        ).labels(**lv)
        self.allocator_step = hist(
            "allocator_step_seconds",
            "Time a step waited for its allocator Step call (with async "
            "scheduling, what the previous forward pass did not hide).",
            _STEP_BUCKETS,
        ).labels(**lv)
        self.allocator_calls = counter(
            "allocator_calls",
            "Allocator Step calls the engine's steps made; a step computed in "
            "slots its sequences hold already (lookahead slots) makes none.",
        ).labels(**lv)
        self.allocator_steps_ahead = counter(
            "allocator_steps_ahead",
            "Allocator Step calls sent ahead, while the previous step computed (async scheduling).",
        ).labels(**lv)
        self.allocator_retries = counter(
            "allocator_retries",
            "Allocator calls that got no answer (UNAVAILABLE, deadline) and were sent again.",
        ).labels(**lv)
        self.allocator_unavailable_seconds = counter(
            "allocator_unavailable_seconds",
            "Seconds spent waiting for an unavailable allocator "
            "(failed attempts and backoff): the worker stalls.",
        ).labels(**lv)
        self.step_errors = counter(
            "step_errors", "Engine steps that raised: every request in flight failed."
        ).labels(**lv)
        # Per request, observed when it finishes by itself
        # (stop or length; vLLM's request histograms).
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Arrival to last token of a finished request.",
            _REQUEST_BUCKETS,
        ).labels(**lv)
        self.queue_time = hist(
            "request_queue_time_seconds", "Arrival to first scheduled (waiting).", _REQUEST_BUCKETS
        ).labels(**lv)
        self.prefill_time = hist(
            "request_prefill_time_seconds",
            "First scheduled to first token (prefill).",
            _REQUEST_BUCKETS,
        ).labels(**lv)
        self.decode_time = hist(
            "request_decode_time_seconds", "First token to last token (decode).", _REQUEST_BUCKETS
        ).labels(**lv)
        self.inference_time = hist(
            "request_inference_time_seconds",
            "First scheduled to last token (prefill + decode).",
            _REQUEST_BUCKETS,
        ).labels(**lv)
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens of a finished request.", _TOKEN_BUCKETS
        ).labels(**lv)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Generated tokens of a finished request.", _TOKEN_BUCKETS
        ).labels(**lv)
        # The KV tiers (worker/tiers/): families now, series from the first `tier(name)`.
        tier = ("tier",)
        self._tier_families: dict[str, Counter | Gauge] = {
            "capacity_bytes": Gauge(
                f"{PREFIX}_kv_tier_capacity_bytes",
                "Bytes of K/V the tier can hold.",
                [*names, *tier],
                registry=r,
            ),
            "used_bytes": Gauge(
                f"{PREFIX}_kv_tier_used_bytes",
                "Bytes of K/V the tier holds now.",
                [*names, *tier],
                registry=r,
            ),
            "hit_tokens": counter(
                "kv_tier_hit_tokens",
                "Prompt tokens of the blocks the tier loaded that stayed cached "
                '(docs/architecture.md, "Counts").',
                tier,
            ),
            "saved_blocks": counter(
                "kv_tier_saved_blocks", "KV blocks written into the tier.", tier
            ),
            "saved_bytes": counter("kv_tier_saved_bytes", "Bytes written into the tier.", tier),
            "save_seconds": counter(
                "kv_tier_save_seconds",
                "Seconds the tier's writes took (copy time on the side stream on CUDA).",
                tier,
            ),
            "loaded_blocks": counter(
                "kv_tier_loaded_blocks", "KV blocks read from the tier into the KV pool.", tier
            ),
            "loaded_bytes": counter(
                "kv_tier_loaded_bytes", "Bytes read from the tier into the KV pool.", tier
            ),
            "load_seconds": counter(
                "kv_tier_load_seconds",
                "Seconds the tier's reads took (copy time on the side stream on CUDA).",
                tier,
            ),
            "refused_entries": counter(
                "kv_tier_refused_entries",
                "Loads from the tier not loaded and reported refused, by reason "
                "(format, layout, checksum, seal, missing): computed instead.",
                ("tier", "reason"),
            ),
            "served_blocks": counter(
                "kv_tier_served_blocks",
                "Entries of a peer:// store this worker sent to other workers' pulls.",
                tier,
            ),
            "served_bytes": counter(
                "kv_tier_served_bytes",
                "Bytes of entries of a peer:// store this worker sent to other workers' pulls.",
                tier,
            ),
            "store_errors": counter(
                "kv_tier_store_errors",
                "Calls to the shared store that failed (unreachable, "
                "I/O): their loads were misses, their saves failed.",
                tier,
            ),
        }
        self._tiers: dict[str, TierMetrics] = {}

    def tier(self, name: str) -> TierMetrics:
        """The series of KV tier `name` (one of KV_TIERS), created on the first call."""
        if name not in KV_TIERS:
            raise ValueError(f"unknown KV tier {name!r}; known: {', '.join(KV_TIERS)}")
        if name not in self._tiers:
            self._tiers[name] = TierMetrics(self._tier_families, {**self.labels, "tier": name})
        return self._tiers[name]

    def preempted(self, cause: str) -> None:
        self._preemptions.labels(**self.labels, cause=cause).inc()

    def finished(self, reason: str) -> None:
        self._requests.labels(**self.labels, finish_reason=reason).inc()

    def request_done(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        arrival: float,
        scheduled: float,
        first_token: float,
        last_token: float,
    ) -> None:
        """A request that finished by itself: its phases (monotonic times) and sizes."""
        self.e2e.observe(last_token - arrival)
        self.queue_time.observe(scheduled - arrival)
        self.prefill_time.observe(first_token - scheduled)
        self.decode_time.observe(last_token - first_token)
        self.inference_time.observe(last_token - scheduled)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def watch_pool(
        self,
        read_stats: Callable[[], object],
        pool_bytes: int,
        kv_dtype: str = "",
        kv_role: str = "both",
    ) -> None:
        """Export the pool gauges, read from `read_stats()` at scrape time; `kv_dtype`:
        the torch name of the pool's element type; `kv_role`: the worker's `--kv-role`."""
        self.registry.register(
            _PoolCollector(read_stats, self.labels, pool_bytes, kv_dtype, kv_role)
        )
