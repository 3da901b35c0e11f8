"""`bench pd`'s tables, from its report alone: one run's comparison and targets, or a rate
sweep's goodput per rate and each system's capacity (`pagedkv.bench.pd` says what each
figure is)."""

from __future__ import annotations

from pagedkv.bench.harness import Table, cell, verdict

COLUMNS = (
    ("system", None, ""),
    ("TTFT p50 s", "ttft_p50_s", ".3f"),
    ("TTFT p99 s", "ttft_p99_s", ".3f"),
    ("ITL p50 ms", "itl_p50_ms", ".2f"),
    ("ITL p99 ms", "itl_p99_ms", ".2f"),
    ("tokens/s", "tokens_per_s", ".1f"),
    ("goodput req/s", "goodput_rps", ".3f"),
    ("SLOs met", "slo_met", ""),
    ("TTFT missed", "ttft_missed", ""),
    ("TPOT missed", "tpot_missed", ""),
    ("bytes moved / req", "bytes_moved_per_request", ","),
    ("transfer s / req", "transfer_s_per_request", ".4f"),
    ("errors", "errors", ""),
)


_PROCESSES = ("allocator", "router", "worker-1", "worker-2")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _percent(value: float | None, spec: str = ".0f") -> str:
    return cell(None if value is None else 100 * value, spec)


def _stream_notes(report: dict) -> list[str]:
    st, slo = report["stream"], report["slo"]
    at = (
        f"Poisson arrivals at {st['rate_rps']:g}/s"
        if st.get("rate_rps")
        else "Poisson arrivals at each swept rate (the workload's prompts drawn anew per rate)"
    )
    return [
        f"{report['model']} on {report['device']} ({report['clock']} clock): {report['workload']}",
        f"{st['requests']} requests per stream ({st['documents']} long documents in "
        f"{st.get('streams', 1)} stream(s)), prompts of {st['prompt_tokens_mean']:g} tokens on "
        f"average (at most {st['prompt_tokens_max']}), {st['output_tokens']} output tokens each, "
        f"{at} (seed {st['seed']}).",
        f"goodput: requests with TTFT <= {slo['ttft_s']:g} s and TPOT <= "
        f"{slo['tpot_s'] * 1000:g} ms, per second of the run; bytes moved: the KV tiers' saved "
        "and loaded bytes (the workers' /metrics); transfer: the router's wait after a split "
        "request's prefill leg until the decode worker finds its blocks.",
    ]


def _worker_rows(summary: dict) -> list[list[str]]:
    """A row per worker; the system's client and router figures on its first worker's."""
    rows = []
    for name, s in summary.items():
        for i, (worker, w) in enumerate((s.get("workers") or {}).items()):
            whole = [
                cell(s.get(k) if i == 0 else None, ".4f")
                for k in (
                    "ttft_mean_s",
                    "prefill_leg_s_per_request",
                    "transfer_s_per_request",
                    "routing_s_per_choice",
                )
            ]
            rows.append(
                [
                    name,
                    worker,
                    cell(w.get("role")),
                    _percent(w.get("device_busy")),
                    _percent(w.get("allocator_wait")),
                    cell(w.get("requests")),
                    cell(w.get("queue_s_per_request"), ".4f"),
                    cell(w.get("prefill_s_per_request"), ".4f"),
                    *whole,
                ]
            )
    return rows


def _busy(s: dict, role: str) -> float | None:
    return next(
        (w["device_busy"] for w in (s.get("workers") or {}).values() if w.get("role") == role),
        None,
    )


def _saturation(report: dict) -> str | None:
    """The rate at which the stream's prompts alone fill one prefill device (on `sim:`)."""
    d = report["stream"].get("prefill_device_s_per_request")
    if not d:
        return None
    per = d["compute_s"] + d["saves_s"]
    return (
        f"A prompt of this stream costs a prefill device {1000 * d['compute_s']:.1f} ms of "
        f"roofline compute (alone, in chunks of the worker's token budget) and "
        f"{1000 * d['saves_s']:.1f} ms of store saves over the host link on average, so one "
        f"prefill device is full at {1 / per:.1f} requests/s."
    )


def _why_not(report: dict) -> str | None:
    """Why the goodput target was not met, in the run's own figures: the prefill device's load
    and queue, and colocated's share of requests meeting both SLOs, which bounds the ratio."""
    t, summary = report["targets"], report["summary"]
    co, pd = summary.get("colocated", {}), summary.get("pd", {})
    if (
        not report["device"].startswith("sim:")  # a CPU's times: the targets compare nothing
        or t.get("goodput_ratio_met") is not False
        or not co.get("slo_met")
        or "ttft_missed" not in pd
    ):
        return None
    bound = co["requests"] / co["slo_met"] * co["wall_s"] / pd["wall_s"]
    prefill = next(
        (w for w in (pd.get("workers") or {}).values() if w.get("role") == "prefill"), {}
    )
    d, rate = report["stream"].get("prefill_device_s_per_request"), report["stream"]["rate_rps"]
    need = (
        f"needs {rate * (d['compute_s'] + d['saves_s']):.2f} s of its device per second at "
        f"{rate:g} requests/s, "
        if d and rate
        else ""
    )
    waited = (
        f" (its steps waiting for the allocator {_percent(prefill['allocator_wait'])}% of it)"
        if prefill.get("allocator_wait") is not None
        else ""
    )
    return (
        f"goodput not met: pd's one prefill worker {need}was busy "
        f"{_percent(prefill.get('device_busy'))}% of the run{waited} with requests queued "
        f"{cell(prefill.get('queue_s_per_request'), '.2f')} s on average, so "
        f"{pd['ttft_missed']} of {pd['requests']} missed TTFT (TPOT: {pd['tpot_missed']}); "
        f"colocated spreads the prompts over two devices and met both SLOs for "
        f"{co['slo_met']} of {co['requests']}, which bounds any system's goodput on this "
        f"stream to {bound:.2f}x colocated's."
    )


def _target_rows(name: str, t: dict) -> list[list[str]]:
    return [
        [
            f"ITL p99, {name} / colocated",
            cell(t["itl_p99_ratio"], ".3f"),
            f"<= {t['itl_p99_ratio_target']:g}",
            verdict(t["itl_p99_ratio_met"]),
        ],
        [
            f"goodput, {name} / colocated",
            cell(t["goodput_ratio"], ".3f"),
            f">= {t['goodput_ratio_target']:g}",
            verdict(t["goodput_ratio_met"]),
        ],
        [
            f"{name}: requests whose greedy token ids differ from colocated's (of "
            f"{cell(t['outputs_compared'])} both answered)",
            cell(t["outputs_differing"]),
            "0",
            verdict(t["outputs_identical"]),
        ],
    ]


def _run_tables(report: dict) -> list[Table]:
    summary = report["summary"]
    rows = [
        [name, *(cell(s.get(key), spec) for _, key, spec in COLUMNS[1:])]
        for name, s in summary.items()
    ]
    notes = _stream_notes(report)
    if not report["device"].startswith("sim:"):
        notes.append(
            "Real workers on this machine's CPU: the outputs and the bytes moved are the point "
            "here; the times are a CPU's, not a GPU's, and the targets on them compare nothing."
        )
    notes.append(
        f"The shared store holds {cell(report.get('shared_store_gib'), 'g')} GiB (pd's allocator; "
        "pd-peer's: each worker's bound on the entries it keeps)."
    )
    for name, s in summary.items():
        if s.get("bytes_moved_per_request") is None:
            notes.append(
                f"{name}: bytes moved '-': its workers have no tier below their pools (no shared "
                "store, no host tier), so they export no tier bytes; none move between them."
            )
        if s.get("split_requests"):
            notes.append(
                f"{name}: {s['split_requests']} requests split ({s['transfers']}), "
                f"{cell(s['cached_tokens_per_request'])} cached prompt tokens per request."
            )
        moved = [
            f"{worker} {k.split(':')[0]} {v / s['requests']:,.0f} ({k.split(':')[1]} tier)"
            for worker, got in (s.get("bytes_by_worker") or {}).items()
            for k, v in got.items()
            if v
        ]
        if moved and s["requests"]:
            notes.append(f"{name}: bytes per request, by worker: " + "; ".join(moved) + ".")
        if s.get("first_error"):
            notes.append(f"{name}: first error: {s['first_error']}")
    t = report["targets"]
    target_rows = _target_rows("pd", t)
    if "pd-peer" in t:
        target_rows += _target_rows("pd-peer", t["pd-peer"])
    why = [n for n in (_saturation(report), _why_not(report)) if n]
    return [
        Table(
            "P/D disaggregation: 2 colocated workers vs 1 prefill + 1 decode",
            [c for c, _, _ in COLUMNS],
            rows,
            notes,
        ),
        Table(
            "P/D: where the time goes, per worker",
            [
                "system",
                "worker",
                "role",
                "device busy %",
                "allocator wait %",
                "requests",
                "queue s / req",
                "prefill s / req",
                "TTFT mean s",
                "prefill leg s / req",
                "transfer s / req",
                "routing s / choice",
            ],
            _worker_rows(summary),
            [
                "device busy: the worker's device seconds (pagedkv_worker_device_busy_seconds) "
                "over the run's wall time (a decode step is bound by reading the weights, so a "
                "device with any sequence running is busy: for decode this is not a measure of "
                "spare capacity); allocator wait: the share of the run the worker's steps waited "
                "for their allocator Step calls (pagedkv_worker_step_host_seconds, "
                "allocator_wait: what async scheduling did not hide); queue: arrival at the "
                "worker -> first scheduled; prefill: first "
                "scheduled -> first token (the worker's request histograms, means over the "
                "requests it answered). The system's own figures are on its first row: its "
                "client's mean TTFT; the router's prefill leg (sending the prompt to the prefill "
                "worker -> its answer, so leg - the prefill worker's queue and prefill is the "
                "router's and HTTP's share), the transfer wait after it, and the time to choose "
                "a worker (tokenize, match, rank; a split request chooses twice)."
            ],
        ),
        Table(
            "P/D: the host's work per request",
            ["system", "MatchPrefix calls / req", *(f"{p} CPU ms / req" for p in _PROCESSES)],
            [
                [
                    name,
                    cell(s.get("match_prefix_calls_per_request"), ".1f"),
                    *(
                        cell(_ms((s.get("cpu_s_per_request") or {}).get(p)), ".1f")
                        for p in _PROCESSES
                    ),
                ]
                for name, s in summary.items()
            ],
            [
                "MatchPrefix calls: the router's to the allocator, to rank workers and, for a "
                "split request, to wait for its transfer; CPU: each process's user and system "
                "seconds over the run (psutil), per request. The workers' host loops, the "
                "router, the allocator and the client share this machine's cores: on a wall "
                "clock, CPU one takes can delay another's step."
            ],
        ),
        Table("P/D targets", ["figure", "value", "target", "outcome"], target_rows, why),
    ]


def _sweep_tables(report: dict) -> list[Table]:
    sw = report["sweep"]
    systems = list(sw["systems"])
    columns = ["rate req/s"]
    for name in systems:
        columns += [f"{name} goodput req/s", f"{name} SLOs met %", f"{name} device busy %"]
    rows = []
    for i, rate in enumerate(sw["rates"]):
        row = [cell(rate, "g")]
        for name in systems:
            p = sw["systems"][name][i]
            busy = "/".join(_percent(w["device_busy"]) for w in (p.get("workers") or {}).values())
            row += [
                cell(p["goodput_rps"], ".3f"),
                _percent(p["slo_attainment"], ".1f"),
                busy or "-",
            ]
        rows.append(row)
    notes = _stream_notes(report)
    notes.append(
        "Each system runs every rate in turn on one set of fresh processes, lowest first; "
        "device busy: worker-1/worker-2 (for pd and pd-peer the prefill/decode worker), its "
        "device seconds over the run's wall time."
    )
    saturation = _saturation(report)
    if saturation:
        notes.append(saturation)
    capacity = "; ".join(f"{name} {cell(sw['capacity_rps'][name], 'g')}" for name in systems)
    notes.append(
        f"Capacity (the highest rate swept at which >= {100 * sw['attainment']:.0f}% of the "
        f"requests met both SLOs, error-free), req/s: {capacity}."
    )
    for name in systems:
        differing = [p.get("outputs_differing") for p in sw["systems"][name]]
        errors = sum(p["errors"] for p in sw["systems"][name])
        if name != "colocated":
            notes.append(
                f"{name}: requests whose greedy token ids differ from colocated's at the same "
                f"rate: {cell(differing)}; errors: {errors}."
            )
    return [Table("P/D rate sweep: goodput and SLO attainment per rate", columns, rows, notes)]


def tables(report: dict) -> list[Table]:
    return _sweep_tables(report) if "sweep" in report else _run_tables(report)
