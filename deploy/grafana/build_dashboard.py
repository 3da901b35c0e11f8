"""Writes deploy/grafana/dashboards/pagedkv.json, the provisioned Grafana dashboard.

    python deploy/grafana/build_dashboard.py          # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check  # exit 1 when the JSON is stale

The panels are declared here (one line of PromQL each) rather than edited in
the JSON, so the file stays reviewable; tests/stack/test_deploy.py checks that the
committed JSON is this script's output and names only exported metrics.
Every query filters on the `$worker` variable (worker id = the allocator's
`worker_id` label) and uses the `pagedkv-*` scrape jobs of
deploy/prometheus/prometheus.yml and `pagedkv up --prometheus` implicitly
(no `job` matcher), so it also works with any other scrape config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "pagedkv.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
W = 'worker=~"$worker"'
WID = 'worker_id=~"$worker"'
RATE = "[$__rate_interval]"


def rate(metric: str, by: str, sel: str = W) -> str:
    return f"sum by ({by}) (rate({metric}{{{sel}}}{RATE}))"


def quantiles(
    metric: str, by: str = "le", sel: str = W, qs=(0.5, 0.9, 0.99), prefix: str = ""
) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{sel}}}{RATE})))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in qs
    ]


# (title, unit, [(expr, legend)], extra options) per panel, grouped in rows.
ROWS: list[tuple[str, list[tuple]]] = [
    (
        "KV cache",
        [
            (
                "KV blocks in use per pool",
                "percentunit",
                [(f"pagedkv_worker_kv_usage_ratio{{{W}}}", "{{worker}}")],
                {"max": 1},
            ),
            (
                "KV slots holding a token (of slots allocated)",
                "percentunit",
                [(f"pagedkv_worker_kv_slot_utilisation_ratio{{{W}}}", "{{worker}}")],
                {"max": 1},
            ),
            (
                "Blocks: used / cached / free",
                "short",
                [
                    (f"sum by (worker) (pagedkv_worker_kv_blocks_used{{{W}}})", "{{worker}} used"),
                    (
                        f"sum by (worker) (pagedkv_worker_kv_blocks_cached{{{W}}})",
                        "{{worker}} cached (reusable prefix)",
                    ),
                    (
                        f"sum by (worker) (pagedkv_worker_kv_blocks_free{{{W}}})"
                        f" - sum by (worker) (pagedkv_worker_kv_blocks_cached{{{W}}})",
                        "{{worker}} free (empty)",
                    ),
                ],
                {"stack": True},
            ),
            (
                "KV slots held ahead of the computed tokens (lookahead)",
                "short",
                [(f"sum by (worker) (pagedkv_worker_kv_slots_ahead{{{W}}})", "{{worker}}")],
                {},
            ),
            (
                "Prefix-cache hit rate (prompt tokens)",
                "percentunit",
                [
                    (
                        f"{rate('pagedkv_worker_prefix_cache_hit_tokens_total', 'worker')} / "
                        f"{rate('pagedkv_worker_prefix_cache_queried_tokens_total', 'worker')}",
                        "{{worker}}",
                    ),
                ],
                {"max": 1},
            ),
            (
                "Peaks at any engine step since the last POST /reset_peaks",
                "short",
                [
                    (
                        f"sum by (worker) (pagedkv_worker_kv_blocks_used_peak{{{W}}})",
                        "{{worker}} blocks used",
                    ),
                    (
                        f"sum by (worker) (pagedkv_worker_kv_slots_holding_tokens_peak{{{W}}})",
                        "{{worker}} slots holding a token",
                    ),
                    (
                        f"sum by (worker) (pagedkv_worker_running_sequences_peak{{{W}}})",
                        "{{worker}} running sequences",
                    ),
                ],
                {},
            ),
        ],
    ),
    (
        "Scheduling and throughput",
        [
            (
                "Running / waiting sequences",
                "short",
                [
                    (
                        f"sum by (worker) (pagedkv_worker_running_sequences{{{W}}})",
                        "{{worker}} running",
                    ),
                    (
                        f"sum by (worker) (pagedkv_worker_waiting_sequences{{{W}}})",
                        "{{worker}} waiting",
                    ),
                ],
                {},
            ),
            (
                "Preemptions / s by cause",
                "ops",
                [
                    (
                        rate("pagedkv_worker_preemptions_total", "worker, cause"),
                        "{{worker}} {{cause}}",
                    )
                ],
                {},
            ),
            (
                "Tokens / s",
                "short",
                [
                    (rate("pagedkv_worker_prompt_tokens_total", "worker"), "{{worker}} prompt"),
                    (
                        rate("pagedkv_worker_generation_tokens_total", "worker"),
                        "{{worker}} generated",
                    ),
                ],
                {},
            ),
            (
                "Requests finished / s by reason",
                "reqps",
                [
                    (
                        rate("pagedkv_worker_requests_total", "worker, finish_reason"),
                        "{{worker}} {{finish_reason}}",
                    )
                ],
                {},
            ),
            (
                "Allocator calls per engine step (lookahead slots: steps without one)",
                "percentunit",
                [
                    (
                        rate("pagedkv_worker_allocator_calls_total", "worker")
                        + " / "
                        + rate("pagedkv_worker_step_duration_seconds_count", "worker"),
                        "{{worker}}",
                    ),
                ],
                {"max": 1},
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "Time to first token",
                "s",
                quantiles("pagedkv_worker_time_to_first_token_seconds"),
                {},
            ),
            (
                "Inter-token latency",
                "s",
                quantiles("pagedkv_worker_inter_token_latency_seconds"),
                {},
            ),
            (
                "Engine step time",
                "s",
                quantiles("pagedkv_worker_step_duration_seconds", prefix="step ")
                + quantiles(
                    "pagedkv_worker_allocator_step_seconds",
                    qs=(0.5, 0.99),
                    prefix="allocator Step (worker side) ",
                ),
                {},
            ),
            (
                "Allocator RPC latency by method",
                "s",
                quantiles(
                    "pagedkv_allocator_rpc_duration_seconds",
                    by="le, method",
                    sel="",
                    qs=(0.5, 0.99),
                    prefix="{{method}} ",
                ),
                {},
            ),
        ],
    ),
    (
        "KV tiers (host tier, shared store)",
        [
            (
                "Tier used / capacity",
                "percentunit",
                [
                    (
                        f"pagedkv_worker_kv_tier_used_bytes{{{W}}}"
                        f" / pagedkv_worker_kv_tier_capacity_bytes{{{W}}}",
                        "{{worker}} {{tier}}",
                    ),
                ],
                {"max": 1},
            ),
            (
                "Prompt tokens loaded from a tier / s (cached, not computed)",
                "short",
                [
                    (
                        rate("pagedkv_worker_kv_tier_hit_tokens_total", "worker, tier"),
                        "{{worker}} {{tier}}",
                    )
                ],
                {},
            ),
            (
                "Saves and loads (bytes / s)",
                "Bps",
                [
                    (
                        rate("pagedkv_worker_kv_tier_saved_bytes_total", "worker, tier"),
                        "{{worker}} {{tier}} saved",
                    ),
                    (
                        rate("pagedkv_worker_kv_tier_loaded_bytes_total", "worker, tier"),
                        "{{worker}} {{tier}} loaded",
                    ),
                ],
                {},
            ),
            (
                "Time moving blocks (s / s)",
                "percentunit",
                [
                    (
                        rate("pagedkv_worker_kv_tier_save_seconds_total", "worker, tier"),
                        "{{worker}} {{tier}} saving",
                    ),
                    (
                        rate("pagedkv_worker_kv_tier_load_seconds_total", "worker, tier"),
                        "{{worker}} {{tier}} loading",
                    ),
                ],
                {},
            ),
            (
                "Entries refused (layout, checksum) and store errors / s",
                "ops",
                [
                    (
                        rate("pagedkv_worker_kv_tier_refused_entries_total", "worker, tier"),
                        "{{worker}} {{tier}} refused",
                    ),
                    (
                        rate("pagedkv_worker_kv_tier_store_errors_total", "worker, tier"),
                        "{{worker}} {{tier}} store errors",
                    ),
                ],
                {},
            ),
        ],
    ),
    (
        "Allocator",
        [
            (
                "KV blocks in use per pool (allocator view)",
                "percentunit",
                [
                    (
                        f"pagedkv_allocator_pool_used_blocks{{{WID}}}"
                        f" / pagedkv_allocator_pool_capacity_blocks{{{WID}}}",
                        "{{worker_id}} pool {{pool_id}}",
                    ),
                ],
                {"max": 1},
            ),
            (
                "Evictions, copy-on-write copies, out-of-blocks answers / s",
                "ops",
                [
                    (
                        rate("pagedkv_allocator_evicted_blocks_total", "worker_id", WID),
                        "{{worker_id}} evicted blocks",
                    ),
                    (
                        rate("pagedkv_allocator_cow_copied_blocks_total", "worker_id", WID),
                        "{{worker_id}} CoW copies",
                    ),
                    (
                        rate("pagedkv_allocator_out_of_blocks_total", "worker_id", WID),
                        "{{worker_id}} out of blocks",
                    ),
                ],
                {},
            ),
            (
                "Allocator RPCs / s by method and code",
                "ops",
                [
                    (
                        "sum by (method, code) (rate(pagedkv_allocator_rpc_duration_seconds_count"
                        + RATE
                        + "))",
                        "{{method}} {{code}}",
                    ),
                ],
                {},
            ),
            (
                "Pools and live sequences",
                "short",
                [
                    ("pagedkv_allocator_pools", "registered pools"),
                    (
                        f"sum by (worker_id) (pagedkv_allocator_pool_sequences{{{WID}}})",
                        "{{worker_id}} sequences",
                    ),
                ],
                {},
            ),
        ],
    ),
    (
        "Router",
        [
            (
                "Router: requests / s per worker and policy",
                "reqps",
                [
                    (
                        rate("pagedkv_router_requests_total", "worker, policy"),
                        "{{worker}} {{policy}}",
                    )
                ],
                {},
            ),
            (
                "Router: prefix tokens cached where sent "
                "(of the best any worker had, of the prompt)",
                "percentunit",
                [
                    (
                        f"{rate('pagedkv_router_prefix_cached_tokens_total', 'policy', '')} / "
                        f"{rate('pagedkv_router_prefix_best_cached_tokens_total', 'policy', '')}",
                        "{{policy}} of the best",
                    ),
                    (
                        f"{rate('pagedkv_router_prefix_cached_tokens_total', 'policy', '')} / "
                        f"{rate('pagedkv_router_prompt_tokens_total', 'policy', '')}",
                        "{{policy}} of the prompt",
                    ),
                ],
                {"max": 1},
            ),
            (
                "Router: routing latency (tokenize + match "
                "in the cache view, or MatchPrefix + rank)",
                "s",
                quantiles("pagedkv_router_routing_seconds", sel="")
                + quantiles(
                    "pagedkv_router_view_match_seconds",
                    sel="",
                    qs=(0.5, 0.99),
                    prefix="view match ",
                )
                + quantiles(
                    "pagedkv_router_match_prefix_seconds",
                    sel="",
                    qs=(0.5, 0.99),
                    prefix="MatchPrefix ",
                ),
                {},
            ),
            (
                "Router: blocks sent lately that each pool still "
                "holds (kv: a new prefix goes to the fewest)",
                "short",
                [(f"max by (worker) (pagedkv_router_recent_blocks{{{W}}})", "{{worker}}")],
                {},
            ),
            (
                "Router: retries and failed requests / s",
                "ops",
                [
                    (rate("pagedkv_router_retries_total", "reason", ""), "retry: {{reason}}"),
                    (
                        rate("pagedkv_router_failed_requests_total", "reason", ""),
                        "failed: {{reason}}",
                    ),
                    (
                        f"sum by (worker) (pagedkv_router_in_flight_requests{{{W}}})",
                        "{{worker}} in flight",
                    ),
                    ("max(pagedkv_router_allocators_unreachable)", "allocators unreachable"),
                    (
                        "pagedkv_router_prefix_views_synced",
                        "{{instance}}: allocators whose cache view is in step",
                    ),
                ],
                {},
            ),
        ],
    ),
]


def panel(pid: int, x: int, y: int, title: str, unit: str, targets, opts: dict) -> dict:
    defaults: dict = {
        "unit": unit,
        "min": 0,
        "custom": {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never"},
    }
    if "max" in opts:
        defaults["max"] = opts["max"]
    if opts.get("stack"):
        defaults["custom"].update({"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 40})
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, spec in enumerate(row_panels):
            panels.append(panel(pid, 12 * (i % 2), y + 8 * (i // 2), *spec))
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "pagedkv",
        "title": "PagedKV",
        "tags": ["pagedkv"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "graphTooltip": 1,
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "worker",
                    "label": "worker",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(pagedkv_worker_running_sequences, worker)",
                        "refId": "worker",
                    },
                    "definition": "label_values(pagedkv_worker_running_sequences, worker)",
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "refresh": 2,
                    "sort": 1,
                    "current": {"text": "All", "value": "$__all"},
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
