"""Prometheus metrics of the allocator (docs/operations.md, "Observing").

Pool figures are read from the pools at scrape time by a custom collector,
not kept as gauges updated on the hot path: the core already counts
evictions, copies and out-of-blocks answers, so a scrape costs one `stats()`
per pool and a Step costs nothing extra. Counters of a pool restart with each
epoch, which is a new `pool_id` label (a new series), so they never go down.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from allocator_service.service import AllocatorService

PREFIX = "pagedkv_allocator_"
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)


def rpc_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        PREFIX + "rpc_duration_seconds",
        "Server-side latency of unary RPCs, by method and status code.",
        ["method", "code"],
        buckets=RPC_BUCKETS,
        registry=registry,
    )


class PoolCollector:
    """Per-pool occupancy and counters, read at scrape time."""

    def __init__(self, service: AllocatorService) -> None:
        self.service = service

    def describe(self):
        return []  # no auto-describe: collect() needs the live service

    def collect(self):
        labels = ["pool_id", "worker_id"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=labels)

        capacity = gauge("pool_capacity_blocks", "Blocks in the pool.")
        used = gauge("pool_used_blocks", "Blocks named by at least one block table.")
        cached = gauge("pool_cached_blocks", "Free blocks still holding a reusable prefix hash.")
        free = gauge("pool_free_blocks", "Free blocks, cached ones included.")
        seqs = gauge("pool_sequences", "Live sequences in the pool.")
        util = gauge(
            "pool_slot_utilisation_ratio",
            "Token slots holding a token over token slots allocated (1 when none allocated).",
        )
        queried = counter(
            "prefix_queried_tokens", "Prompt tokens admissions looked up in the prefix cache."
        )
        hit = counter(
            "prefix_hit_tokens",
            "Prompt tokens admissions found cached: shared from the KV pool or a tier load "
            'issued (docs/architecture.md, "Tiers", "Counts").',
        )
        evicted = counter("evicted_blocks", "Cached blocks whose hash was dropped to reuse them.")
        copied = counter("cow_copied_blocks", "Copy-on-write block copies ordered.")
        oob = counter("out_of_blocks", "Operations answered 'out of blocks'.")
        recent_cpu = gauge(
            "pool_recent_cpu_seconds",
            "CPU seconds the pool's calls used recently (decaying over the fair-share window): "
            "the one that used more waits for the other when pools contend.",
        )

        fair = self.service.fair
        recent = fair.recent_cpu()
        views = self.service.reads.pool_stats()
        for pool_id, worker_id, s in views:
            key = [pool_id, worker_id]
            capacity.add_metric(key, s.num_blocks)
            used.add_metric(key, s.used_blocks)
            cached.add_metric(key, s.cached_blocks)
            free.add_metric(key, s.free_blocks)
            seqs.add_metric(key, s.num_sequences)
            util.add_metric(key, s.utilisation)
            queried.add_metric(key, s.prefix_queried_tokens)
            hit.add_metric(key, s.prefix_hit_tokens)
            evicted.add_metric(key, s.evictions)
            copied.add_metric(key, s.copies)
            oob.add_metric(key, s.out_of_blocks)
            recent_cpu.add_metric(key, recent.get(pool_id, 0.0))
        pools = GaugeMetricFamily(PREFIX + "pools", "Registered pools.", value=len(views))
        events = GaugeMetricFamily(
            PREFIX + "event_sequence",
            "Sequence number of the last KV event.",
            value=self.service.events.published - 1,
        )
        snapshot_failures = CounterMetricFamily(
            PREFIX + "snapshot_failures",
            "Snapshots that could not be written (each backs off).",
            value=self.service.snapshot_failures,
        )
        serving = GaugeMetricFamily(
            PREFIX + "state_store_serving",
            "1 while the state store is usable (gRPC health SERVING), 0 while it is unreachable, "
            "fenced or lost its data.",
            value=1 if self.service.healthy[0] else 0,
        )
        waits = CounterMetricFamily(
            PREFIX + "fair_share_waits",
            "Times a call waited for a call of a pool that used less CPU.",
            value=fair.waits,
        )
        wait_seconds = CounterMetricFamily(
            PREFIX + "fair_share_wait_seconds",
            "Seconds calls spent waiting for the fair share.",
            value=fair.wait_seconds,
        )
        waiting = GaugeMetricFamily(
            PREFIX + "fair_share_waiting",
            "Calls waiting for the fair share now.",
            value=fair.waiting,
        )
        cpu_seconds = CounterMetricFamily(
            PREFIX + "fair_share_cpu_seconds",
            "CPU seconds of the calls run under the fair share.",
            value=fair.cpu_seconds,
        )
        calls_refused = CounterMetricFamily(
            PREFIX + "pool_calls_refused",
            "Calls refused because their pool already had "
            "as many in flight as one pool may (pool_calls).",
            value=self.service.call_slots.refused,
        )
        yield from (
            pools,
            events,
            snapshot_failures,
            serving,
            capacity,
            used,
            cached,
            free,
            seqs,
            util,
            queried,
            hit,
            evicted,
            copied,
            oob,
            recent_cpu,
            waits,
            wait_seconds,
            waiting,
            cpu_seconds,
            calls_refused,
        )
        yield from self._tiers()

    def _tiers(self):
        """The KV tiers (docs/architecture.md, "Tiers"): per pool and tier
        (`host`, `shared`) as the worker's `pagedkv_worker_kv_tier_*` name
        them, and the shared store's own figures."""
        labels = ["pool_id", "worker_id", "tier"]
        hit = CounterMetricFamily(
            PREFIX + "kv_tier_hit_tokens",
            "Prompt tokens whose loads from the tier admissions issued (a load refused "
            'later included; docs/architecture.md, "Tiers", "Counts").',
            labels=labels,
        )
        saved = CounterMetricFamily(
            PREFIX + "kv_tier_saved_blocks",
            "Blocks saves to the tier were issued for.",
            labels=labels,
        )
        loaded = CounterMetricFamily(
            PREFIX + "kv_tier_loaded_blocks",
            "Blocks loads from the tier were issued for.",
            labels=labels,
        )
        refused = CounterMetricFamily(
            PREFIX + "kv_tier_refused_entries",
            "Store loads the worker reported refused (format, layout, checksum, seal or missing): "
            "computed instead.",
            labels=labels,
        )
        capacity = GaugeMetricFamily(
            PREFIX + "kv_tier_capacity_bytes", "Bytes the pool's host tier holds.", labels=labels
        )
        used = GaugeMetricFamily(
            PREFIX + "kv_tier_used_bytes",
            "Bytes of the pool's host tier holding an entry (pending or present).",
            labels=labels,
        )
        for pool_id, worker_id, t in self.service.reads.tier_stats():
            c = t.stats
            if t.host_blocks:
                key = [pool_id, worker_id, "host"]
                hit.add_metric(key, c.host_hit_tokens)
                saved.add_metric(key, c.host_saves)
                loaded.add_metric(key, c.host_loads)
                capacity.add_metric(key, t.host_blocks * t.block_bytes)
                used.add_metric(key, t.host_used_blocks * t.block_bytes)
            if t.use_shared_store:
                key = [pool_id, worker_id, "shared"]
                hit.add_metric(key, c.store_hit_tokens)
                saved.add_metric(key, c.store_saves)
                loaded.add_metric(key, c.store_loads)
                refused.add_metric(key, c.refused_loads)
        yield from (hit, saved, loaded, refused, capacity, used)
        store = self.service.reads.store_stats()
        if store is None:
            return
        yield GaugeMetricFamily(
            PREFIX + "shared_store_capacity_bytes",
            "Bytes the shared KV store may hold.",
            value=store.capacity_bytes,
        )
        yield GaugeMetricFamily(
            PREFIX + "shared_store_used_bytes",
            "Bytes of the shared KV store's entries (pending ones included).",
            value=store.used_bytes,
        )
        yield GaugeMetricFamily(
            PREFIX + "shared_store_entries",
            "Entries in the shared KV store's index.",
            value=store.entries,
        )
        yield CounterMetricFamily(
            PREFIX + "shared_store_dropped_entries",
            "Store entries dropped to make room (store deletes issued).",
            value=store.stats.evictions,
        )


def make_registry(service: AllocatorService) -> tuple[CollectorRegistry, Histogram]:
    """A registry of our own (not the process-global one), so several
    servers in one process (tests) do not collide."""
    registry = CollectorRegistry()
    histogram = rpc_histogram(registry)
    registry.register(PoolCollector(service))
    return registry, histogram
