"""`pagedkv bench tiers`: the KV tiers on a multi-turn chat workload.

Workload (`workloads.TIERS`, `--workload`; `workloads.multi_turn_chats`):
`conversations` chats of `turns` turns, each turn sending the whole history
(the system prompt, every earlier message and answer) plus a new user
message, as SGLang's multi-turn benchmark does; the conversations taken in
turn (every conversation's first turn, then every second turn, ...), one
request at a time, streamed, greedy, `max_tokens` tokens each (EOS ignored).
The working set is every conversation's final history, in blocks; the KV
pool holds about an eighth of it (never less than one whole request).

Systems (`systems.tiers`), in this order: `no-tier` (a worker as it comes),
`host` (its host tier at 4x the KV pool, `--kv-offloading-size` in GiB from
the KV layout's block bytes), `host+shared` (two such workers behind a
`round-robin` router, so every turn changes worker, and their allocator
holding a shared store of twice the working set) and `unbounded` (a pool
for everything: the ceiling). A system that cannot start is a row of
nulls with the reason under the table. Runs are interleaved: each of
`rounds` rounds runs every system once, in a rotated order, each run under
its own `cache_salt` (no run finds another's blocks).

Figures per system, read as users see them: from the API's `usage`
(`prompt_tokens`, `prompt_tokens_details.cached_tokens`: prefix-hit tokens,
whatever tier they came from; prefill computed = prompt - cached), the
client's clock (TTFT: request sent -> first streamed token, through the
router for `host+shared`; tokens/s: generated tokens / wall time of the
run) and the workers' /metrics (the
tiers' `pagedkv_worker_kv_tier_{saved,loaded}_bytes_total`, deltas over the
run; null where no worker exports them). `outputs_match_first`: every answer
equals the first system's (greedy). For `host+shared`, the turns answered
by the other worker than the conversation's previous turn: the share of
their history (the previous turn's prompt) they computed.

The physics: with the pool at 1/8 and the host tier at 4/8 of the working
set, an LRU over conversations taken in turn cannot keep every history (each
conversation comes back after all the others have passed through); once the
histories outgrow 5/8 of the working set, the host tier holds what the order
leaves it. The bench reports what it measures, against the targets:
host prefix hits >= 0.9x unbounded's, host TTFT p50 <= 0.35x no-tier's,
other-worker turns computing <= 10% of their history, identical outputs.
Not a timed test: compare the figures within one run.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from typing import Any

from allocator_service.core import blocks_for
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.systems.tiers import SHARED, SYSTEMS, Sizes, Target, started
from pagedkv.bench.workloads import TIERS, Chat, TiersWorkload, multi_turn_chats

__all__ = ["SYSTEMS", "add_arguments", "measure", "run", "tables"]

KV_SHARE = 8  # the pool holds 1/KV_SHARE of the working set
HOST_TIMES_KV = 4  # the host tier holds this many pools
STORE_TIMES_WORKING_SET = 2
LOOKAHEAD = 8  # the workers' default lookahead slots, room the pool needs beside a request
FIGURES = (
    "prompt_tokens",
    "prefix_hit_tokens",
    "prefill_tokens_computed",
    "ttft_p50_s",
    "ttft_p90_s",
    "tokens_per_s",
    "bytes_saved",
    "bytes_loaded",
    "outputs_match_first",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, TIERS)
    harness.add_json_option(p)


# -- sizes ------------------------------------------------------------------------------


def _block_bytes(model: str, block_size: int) -> int:
    """One KV block's bytes for `model`, from its KV layout
    (the model built in-process, on the CPU)."""
    import torch

    from worker.model.loader import load_model
    from worker.tiers.layout import KVLayout

    loaded = load_model(model)
    c = loaded.config
    dtype = str(getattr(loaded.model, "dtype", torch.float32)).removeprefix("torch.")
    return KVLayout(
        loaded.fingerprint, block_size, dtype, c.num_kv_heads, c.head_dim, c.num_layers
    ).block_bytes


def _final_history(tokenizer, chat: Chat, max_tokens: int) -> int:
    """Tokens of a chat's last turn and its answer, each answer counted as `max_tokens` tokens."""
    messages = [{"role": "system", "content": chat.system}]
    for user in chat.users:
        messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": "x" * max_tokens},
        ]
    return len(tokenizer.encode_chat(messages[:-1])) + max_tokens


def sizes(
    w: TiersWorkload, chats: list[Chat], tokenizer, block_bytes: int
) -> tuple[Sizes, dict[str, int]]:
    finals = [_final_history(tokenizer, chat, w.max_tokens) for chat in chats]
    working_set = sum(blocks_for(n, w.block_size) for n in finals)
    one_request = blocks_for(max(finals) + LOOKAHEAD, w.block_size) + 1
    kv = max(math.ceil(working_set / KV_SHARE), one_request)
    gib = block_bytes / 2**30
    # half a block over: the tier's GiB -> blocks rounding never loses one
    s = Sizes(
        kv_blocks=kv,
        unbounded_blocks=2 * working_set + one_request,
        host_gib=(HOST_TIMES_KV * kv + 0.5) * gib,
        store_gib=(STORE_TIMES_WORKING_SET * working_set + 0.5) * gib,
    )
    return s, {
        "working_set_blocks": working_set,
        "kv_pool_blocks": kv,
        "host_tier_blocks": HOST_TIMES_KV * kv,
        "shared_store_blocks": STORE_TIMES_WORKING_SET * working_set,
        "unbounded_blocks": s.unbounded_blocks,
        "block_bytes": block_bytes,
        "final_history_tokens_max": max(finals),
    }


# -- one run -----------------------------------------------------------------------------


def _turn(client, url: str, messages: list[dict], w: TiersWorkload, salt: str) -> dict[str, Any]:
    body = {
        "model": w.model,
        "messages": messages,
        "max_tokens": w.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.read()[:200]!r}"}
        worker = r.headers.get("x-pagedkv-worker", url)
        for line in r.iter_lines():
            if (chunk := harness.sse_chunk(line)) is None:
                continue
            if "error" in chunk:
                return {"error": chunk["error"].get("message", "")}
            if chunk.get("choices") and (piece := chunk["choices"][0]["delta"].get("content")):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(piece)
            usage = chunk.get("usage") or usage
    if usage is None:
        return {"error": "no usage in the stream"}
    return {
        "ttft": ttft,
        "text": "".join(text),
        "worker": worker,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def _one_run(target: Target, chats: list[Chat], w: TiersWorkload, salt: str) -> dict[str, Any]:
    """Every conversation's turns through `target`, conversations taken in turn."""
    import httpx

    histories = [[{"role": "system", "content": chat.system}] for chat in chats]
    turns: list[dict] = []
    before = harness.tier_bytes(target.workers)
    with httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        for t in range(w.turns):
            for c, chat in enumerate(chats):
                histories[c].append({"role": "user", "content": chat.users[t]})
                got = _turn(client, target.url, histories[c], w, salt)
                histories[c].append({"role": "assistant", "content": got.get("text", "")})
                turns.append({"conversation": c, "turn": t, **got})
        wall = time.perf_counter() - t0
    after = harness.tier_bytes(target.workers)
    return _figures(turns, wall, {k: v - before.get(k, 0.0) for k, v in after.items()})


def _figures(turns: list[dict], wall: float, tier_bytes: dict[str, float]) -> dict[str, Any]:
    ok = [t for t in turns if "error" not in t]
    prompt = sum(t["prompt_tokens"] for t in ok)
    hit = sum(t["cached_tokens"] for t in ok)

    def tier_sum(what: str) -> int | None:
        values = [v for k, v in tier_bytes.items() if k.startswith(f"{what}:")]
        return round(sum(values)) if values else None

    return {
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "first_error": next((t["error"] for t in turns if "error" in t), None),
        "prompt_tokens": prompt,
        "prefix_hit_tokens": hit,
        "prefill_tokens_computed": prompt - hit,
        "tokens_per_s": round(sum(t["completion_tokens"] for t in ok) / wall, 2)
        if wall > 0
        else None,
        "ttft_s": [None if t.get("ttft") is None else round(t["ttft"], 5) for t in turns],
        "bytes_saved": tier_sum("saved"),
        "bytes_loaded": tier_sum("loaded"),
        "bytes_by_tier": {k: round(v) for k, v in sorted(tier_bytes.items())},
        "other_worker": _other_worker(turns),
        "final_history_tokens": _final_histories(ok),
        "wall_s": round(wall, 3),
        "_texts": [t.get("text") for t in turns],
    }


def _other_worker(turns: list[dict]) -> dict[str, Any]:
    """The turns answered by another worker than their conversation's previous turn: how many, and
    the share of their history (the previous turn's prompt) they computed (not found cached)."""
    previous: dict[int, dict] = {}
    count = history = computed = 0
    for t in turns:
        prev = previous.get(t["conversation"])
        if "error" not in t:
            previous[t["conversation"]] = t
        if prev is None or "error" in t or t["worker"] == prev["worker"]:
            continue
        count += 1
        history += prev["prompt_tokens"]
        computed += max(0, prev["prompt_tokens"] - t["cached_tokens"])
    return {
        "turns": count,
        "history_tokens": history,
        "history_tokens_computed": computed,
        "history_computed_fraction": round(computed / history, 4) if history else None,
    }


def _final_histories(turns: list[dict]) -> list[int]:
    """Each conversation's last prompt and answer, in tokens (what the working set was made of)."""
    last: dict[int, dict] = {}
    for t in turns:
        last[t["conversation"]] = t
    return [last[c]["prompt_tokens"] + last[c]["completion_tokens"] for c in sorted(last)]


# -- the report ----------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv_base.model_files import load_tokenizer

    w = TIERS[args.workload]
    names = list(SYSTEMS)
    tokenizer = load_tokenizer(w.model)
    chats = multi_turn_chats(
        tokenizer, w.conversations, w.turns, w.system_tokens, w.user_tokens, w.seed
    )
    s, layout = sizes(w, chats, tokenizer, _block_bytes(w.model, w.block_size))
    runs: dict[str, list[dict]] = {name: [] for name in names}
    harness.log(
        "tiers",
        f"starting {', '.join(names)}: KV pool {s.kv_blocks} blocks, working set "
        f"{layout['working_set_blocks']}",
    )
    with started(names, w.model, w.block_size, s) as systems:
        for name, why in systems.errors.items():
            harness.log(
                "tiers",
                f"{name} did not start, reported as not measured: {' / '.join(why.splitlines())}",
            )
        up = [name for name in names if name in systems.targets]
        for name in up:  # warm-up: each path once, its own salt
            _one_run(
                systems.targets[name],
                chats[:1],
                replace(w, turns=1, max_tokens=2),
                f"warmup-{name}",
            )
        for rnd, name in harness.interleaved(up, w.rounds):
            harness.log("tiers", f"round {rnd + 1}/{w.rounds}: {name}")
            runs[name].append(_one_run(systems.targets[name], chats, w, f"round{rnd}-{name}"))
        errors = dict(systems.errors)
    return _report(w, names, layout, runs, errors)


def _mean(rows: list[dict], key: str) -> float | None:
    """The mean over the runs; a whole number as an int (every round's count the same)."""
    value = harness.mean(r[key] for r in rows)
    if value is None:
        return None
    return int(value) if value == int(value) else round(value, 2)


def _summary(rows: list[dict], texts: list | None) -> dict[str, Any]:
    if not rows:
        return {key: None for key in FIGURES} | {"errors": None, "other_worker": None}
    ttft = [v for r in rows for v in r["ttft_s"]]
    other = [r["other_worker"] for r in rows]
    history = sum(o["history_tokens"] for o in other)
    return {
        "prompt_tokens": _mean(rows, "prompt_tokens"),
        "prefix_hit_tokens": _mean(rows, "prefix_hit_tokens"),
        "prefill_tokens_computed": _mean(rows, "prefill_tokens_computed"),
        "ttft_p50_s": harness.percentile(ttft, 0.5),
        "ttft_p90_s": harness.percentile(ttft, 0.9),
        "tokens_per_s": _mean(rows, "tokens_per_s"),
        "bytes_saved": _mean(rows, "bytes_saved"),
        "bytes_loaded": _mean(rows, "bytes_loaded"),
        "outputs_match_first": None if texts is None else all(r["_texts"] == texts for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "other_worker": {
            "turns": sum(o["turns"] for o in other),
            "history_tokens": history,
            "history_computed_fraction": round(
                sum(o["history_tokens_computed"] for o in other) / history, 4
            )
            if history
            else None,
        },
    }


def _all_measured(values) -> bool | None:
    """Whether every measured value is true; None when none is measured."""
    measured = [v for v in values if v is not None]
    return all(measured) if measured else None


def _report(
    w: TiersWorkload,
    names: list[str],
    layout: dict[str, int],
    runs: dict[str, list[dict]],
    errors: dict[str, str],
) -> dict[str, Any]:
    first = runs[names[0]]
    texts = first[0]["_texts"] if first and not first[0]["errors"] else None
    summary = {name: _summary(runs[name], texts) for name in names}
    for name in names:
        summary[name]["not_started"] = errors.get(name)
    measured = first[0]["final_history_tokens"] if first else []

    def fig(name: str, key: str) -> float | None:
        return summary.get(name, {}).get(key)

    shared = summary.get(SHARED, {}).get("other_worker") or {}
    return {
        "workload": {
            "model": w.model,
            "conversations": w.conversations,
            "turns": w.turns,
            "system_tokens": w.system_tokens,
            "user_tokens": w.user_tokens,
            "max_tokens": w.max_tokens,
            "block_size": w.block_size,
            "rounds": w.rounds,
            "systems": names,
            **layout,
            "working_set_blocks_measured": sum(blocks_for(n, w.block_size) for n in measured)
            if measured
            else None,
        },
        "summary": summary,
        "targets": {
            "host_prefix_hits_of_unbounded": harness.ratio(
                fig("host", "prefix_hit_tokens"), fig("unbounded", "prefix_hit_tokens")
            ),
            "host_ttft_p50_of_no_tier": harness.ratio(
                fig("host", "ttft_p50_s"), fig("no-tier", "ttft_p50_s")
            ),
            "other_worker_history_computed_fraction": shared.get("history_computed_fraction"),
            "outputs_identical": _all_measured(summary[n]["outputs_match_first"] for n in names),
        },
        "runs": {
            name: [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
            for name, rows in runs.items()
        },
    }


def tables(report: dict) -> list[Table]:
    w, g = report["workload"], report["targets"]
    rows = [
        [
            name,
            *(
                cell(s[key])
                if key != "outputs_match_first"
                else ("-" if s[key] is None else "yes" if s[key] else "no")
                for key in FIGURES
            ),
        ]
        for name, s in report["summary"].items()
    ]
    other = (report["summary"].get(SHARED) or {}).get("other_worker") or {}
    notes = [
        f"KV pool {w['kv_pool_blocks']} blocks of {w['block_size']} tokens ({w['block_bytes']} B "
        f"each), {w['kv_pool_blocks'] / w['working_set_blocks']:.0%} of the working set "
        f"(1/{KV_SHARE}, or one whole request where that is more; {w['working_set_blocks']} blocks "
        f"planned, {cell(w['working_set_blocks_measured'])} measured); host tier "
        f"{w['host_tier_blocks']} blocks; shared store {w['shared_store_blocks']} "
        f"blocks; unbounded pool {w['unbounded_blocks']} blocks",
        f"host prefix-hit tokens / unbounded's: {cell(g['host_prefix_hits_of_unbounded'])} (target "
        ">= 0.9); host TTFT p50 / no-tier's: "
        f"{cell(g['host_ttft_p50_of_no_tier'])} (target <= 0.35)",
        f"{SHARED}: turns on the other worker than their conversation's previous turn: "
        f"{cell(other.get('turns'))}, computing "
        f"{cell(g['other_worker_history_computed_fraction'], '.1%')} of their history (target <= "
        "10%; without the store a worker finds only what "
        "it computed itself, two turns before at best)",
        f"outputs identical to the first system's (greedy), over the systems measured: "
        f"{cell(g['outputs_identical'])} (target: on)",
    ]
    notes += [
        f"{name}: {s['errors']} request(s) failed"
        for name, s in report["summary"].items()
        if s["errors"]
    ]
    notes += [
        f"{name} did not start: {' / '.join(s['not_started'].splitlines())}"
        for name, s in report["summary"].items()
        if s.get("not_started")
    ]
    return [
        Table(
            title=f"pagedkv bench tiers: {w['conversations']} conversations x {w['turns']} turns, "
            f"{w['max_tokens']} tokens generated per turn "
            f"({w['model']}), {w['rounds']} interleaved round(s)",
            columns=[
                "system",
                "prompt tokens",
                "prefix-hit tokens",
                "prefill computed",
                "TTFT p50 s",
                "TTFT p90 s",
                "tokens/s",
                "bytes saved",
                "bytes loaded",
                "outputs = first's",
            ],
            rows=rows,
            notes=notes,
        )
    ]


def run(args: argparse.Namespace) -> int:
    return harness.run("tiers", args, measure, tables)
