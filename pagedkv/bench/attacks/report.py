"""The drill's tables."""

from __future__ import annotations

from pagedkv.bench.attacks.target import METRICS_PROBES, METRICS_TARGET_S
from pagedkv.bench.harness import Table, cell

# their details in tables of their own
OWN_TABLES = ("prompt-reading", "store-poisoning", "evil-worker")


def tables(report: dict) -> list[Table]:
    rows, notes = [], []
    for kind, run in report["stacks"].items():
        for r in run["attacks"]:
            b, d = r["baseline"], r["during"]
            rows.append(
                [
                    kind,
                    r["attack"],
                    cell(b["step_p99_ms"], ".2f"),
                    cell(d["step_p99_ms"], ".2f"),
                    cell(b["request_p99_ms"], ".1f"),
                    cell(d["request_p99_ms"], ".1f"),
                    cell(r["allocator_rss_mib_peak"], ".1f"),
                    cell(r["allocator_threads_peak"]),
                    "yes" if r["succeeded"] else "no",
                    cell(r["victim_errors"]),
                    cell(sum(r["refused"].values())),
                ]
            )
            said = [f"refused {k} {v}" for k, v in sorted(r["refused"].items())]
            if r["attack"] not in OWN_TABLES:
                said += [f"{k} {v}" for k, v in r["details"].items()]
            if said:
                notes.append(f"{kind}, {r['attack']}: " + ", ".join(said))
            notes += [f"{kind}, {r['attack']}: victim error: {e}" for e in r["errors"]]
        v = run["victim"]
        notes.append(
            f"{kind}: the victim sent {v['steps']} Steps and {v['requests']} router requests; "
            f"{v['errors']} failed"
        )
    w = report["workload"]
    head = [
        f"workload {w['name']}: {w['what']}.",
        "p99 before: the victim alone in the seconds before the attack; during: while it ran. "
        "Succeeded: the attack's aim was reached, or the "
        "victim lost a Step or a request, or a process exited.",
    ]
    tables_ = [
        Table(
            "attacks on a stack with credentials and one without",
            [
                "stack",
                "attack",
                "Step p99 before ms",
                "during",
                "router p99 before ms",
                "during",
                "allocator RSS MiB",
                "threads",
                "succeeded",
                "victim errors",
                "refused",
            ],
            rows,
            head + notes,
        )
    ]
    flood = [
        [
            kind,
            cell(d["connections"]),
            cell(d["metrics_p50_ms_before"], ".1f"),
            cell(d["metrics_max_ms_before"], ".1f"),
            cell(d["metrics_p50_ms_during"], ".1f"),
            cell(d["metrics_max_ms_during"], ".1f"),
            cell(d["metrics_failed_during"]),
            cell(d["threads_before"]),
            cell(d["threads_with_them"]),
        ]
        for kind, run in report["stacks"].items()
        for r in run["attacks"]
        if r["attack"] == "idle-connections" and "metrics_probes" in (d := r["details"])
    ]
    if flood:
        tables_.append(
            Table(
                "the allocator's /metrics before and during "
                "the idle-connection flood on its HTTP port",
                [
                    "stack",
                    "idle connections",
                    "/metrics p50 before ms",
                    "max before",
                    "p50 during",
                    "max during",
                    "failed",
                    "allocator threads before",
                    "with them",
                ],
                flood,
                [
                    f"{METRICS_PROBES} GETs of /metrics before the connections open and "
                    f"{METRICS_PROBES} while they are open, a new connection each; failed: not a "
                    f"200 within 10 s; target: every one within {METRICS_TARGET_S:g} s."
                ],
            )
        )
    store = {
        kind: {r["attack"]: r for r in run["attacks"]} for kind, run in report["stacks"].items()
    }
    rows = []
    for kind, got in store.items():
        p, d = got.get("store-poisoning"), got.get("prompt-reading")
        if p is None and d is None:
            continue
        pd, dd = (p or {}).get("details", {}), (d or {}).get("details", {})
        refused = ", ".join(f"{k} {v}" for k, v in sorted(p["refused"].items())) if p else None
        changed = (
            f"{pd['answers_changed_planted'] + pd['answers_changed_overwritten']} "
            f"of {pd['victim_prompts']}"
            if "victim_prompts" in pd
            else None
        )
        rows.append(
            [
                kind,
                cell(pd.get("entries_planted")),
                cell(pd.get("victim_tokens_from_planted")),
                cell(pd.get("entries_overwritten")),
                cell(pd.get("victim_tokens_from_overwritten")),
                cell(changed),
                cell(refused or ("0" if p else None)),
                cell(dd.get("entries_read")),
                cell(dd.get("entries_decoded")),
                cell(dd.get("tokens_recovered")),
                cell(
                    None
                    if "secret_read_back" not in dd
                    else "yes"
                    if dd["secret_read_back"]
                    else "no"
                ),
            ]
        )
    if rows:
        tables_.append(
            Table(
                "the shared store against a worker of another "
                "group and whoever reads or writes its files",
                [
                    "stack",
                    "entries planted",
                    "victim tokens loaded from them",
                    "entries overwritten",
                    "victim tokens loaded from them",
                    "answers changed",
                    "entries refused",
                    "entries read",
                    "decoded",
                    "tokens recovered",
                    "secret read back",
                ],
                rows,
                [
                    "Store poisoning: the attacker's pool plants forged entries for prompts "
                    "worker-1 is then sent (admit, free, forged K/V under a valid header and "
                    "checksum, the save confirmed); then it writes forged entries over every entry "
                    "file once worker-2 has computed other prompts, and worker-1 is sent those. "
                    "Victim tokens: worker-1's prompt tokens loaded from the shared store; answers "
                    "changed: its greedy answers that differ from the same prompt computed under a "
                    "fresh salt; entries refused: what worker-1 refused to load, by reason.",
                    "Prompt reading: worker-1 is sent a salted tenant's prompt holding a secret; "
                    "every entry file of the store is decoded without a key and each decoded "
                    "block's layer-0 V rows mapped back to tokens with the public weights.",
                    "With credentials the attacker is a worker of another store group (its own "
                    "worker token and store key); without, every pool shares one "
                    "unsealed namespace (the documented trust domain).",
                ],
            )
        )
    rows = []
    for kind, got in store.items():
        e = got.get("evil-worker")
        if e is None or "answers" not in (d := e["details"]):
            continue
        rows.append(
            [
                kind,
                f"{d['answers']} x {d['answer_mb']}",
                cell(min(d["mb_passed_each"]), ".1f"),
                cell(d["router_rss_mib_before"], ".1f"),
                cell(d["router_rss_mib_peak"], ".1f"),
                d["trickled_whole"]["ended"],
                cell(d["trickled_whole"]["seconds"], ".2f"),
                d["trickled_stream"]["ended"],
                cell(d["trickled_stream"]["seconds"], ".2f"),
                cell(d["first_byte_timeout_s"], "g"),
            ]
        )
    if rows:
        tables_.append(
            Table(
                "an evil worker behind the router: huge and trickled answers",
                [
                    "stack",
                    "answers x MB at once",
                    "MB passed each (least)",
                    "router RSS MiB before",
                    "peak",
                    "trickled whole answer",
                    "client held s",
                    "trickled stream",
                    "client held s",
                    "first-byte timeout s",
                ],
                rows,
                [
                    "The attacker's pool, proven to the router by a server of its own at its "
                    "address: answers with no end of body (the router passes them on as they come; "
                    "it cuts one at PAGEDKV_ROUTER_MAX_ANSWER_MB, or once it has waited its "
                    "first-byte timeout in all for the body), and a whole answer and a stream "
                    "trickled a byte every 0.1 s after their status (ended by the router's "
                    "first-byte timeout: 504 worker_timeout, or an error event)."
                ],
            )
        )
    return tables_
