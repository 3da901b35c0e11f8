"""`pagedkv bench restart`: the allocator restarted again and again under load.

The topology `pagedkv up --redis` runs, as real processes
(`pagedkv.stack.LocalStack`): a private Redis (append-only), the allocator
with its state journaled there, and two tiny-random workers (pools small
enough to preempt, prefix caching on). Client threads keep each worker
busy with greedy requests (EOS ignored, `MAX_TOKENS` tokens each), streamed
and not, completions and chat, while the allocator is restarted
`--restarts` times at random moments (a seeded pause of 0 to 1 s after it is
back, so restarts land mid-step, mid-stream and between steps): half of them
SIGTERM (a graceful stop, as `docker-compose restart` and Kubernetes do),
half SIGKILL (a crash), in a seeded order, each started again on the same
port after a pause: half of them 0 to 0.3 s, half 2 to 9 s (longer than
the client's own retries, as a container's restart can be).

With `--standby` the same run first measures failover: the stack runs
each allocator with a hot standby (`pagedkv up --standby`: both processes
`--standby`, the workers given both addresses), and `--kills` times the
LEADER is taken out under the same load, in a seeded order, half SIGKILL
(then restarted, to follow the new leader as a standby) and half SIGSTOP
(kept stopped until the standby serves, past its lease, then SIGCONT: it
must step down and follow; its writes are fenced). "Back serving" is then
measured as a client sees it: a probe pool with both addresses sends a
step after the signal, and the time to its answer is the figure. Steps
applied twice are counted from the journal itself (`_JournalTap` reads
every record as it is written: a step id journaled twice for a pool, or a
step that does not follow its pool's last one, is counted). The restarts
without a standby follow in the same run, as before.

Every request must complete with the text a run with no restart gives
(the reference: each prompt answered once before the first restart).
Figures: restarts (each kind), requests, failed requests (any status but
200, or a stream that ended without `[DONE]`), wrong texts, the workers'
stall (allocator unanswered seconds), retries, step errors and preemptions
over the run, the allocator's time from the signal to serving again, and
the latency of the requests. The first failures are kept in the report.
Not a timed test: the figures to read are the counts.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.restart_clients import (
    CLIENTS_PER_WORKER,
    MAX_TOKENS,
    PROMPTS,
    Load,
    outcome_figures,
    reference_texts,
    round_or_none,
    worker_counters,
)

__all__ = ["add_arguments", "measure", "run", "tables"]

# 24 blocks of 4 = 96 token slots per worker for CLIENTS_PER_WORKER requests of ~30 tokens
# at once (and a pipelined step): the schedulers preempt.
WORKER_ARGS = [
    "--num-blocks",
    "24",
    "--block-size",
    "4",
    "--enable-prefix-caching",
    "--max-model-len",
    "64",
    "--log-level",
    "warning",
]
# the allocator's settings no command line sets: its variables
ALLOCATOR_ENV = {"PAGEDKV_ALLOCATOR_LEASE_TTL": "10", "PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "50"}
MODEL = "tiny-random"
WORKERS = 2


# The leader lease of the standby run (the allocator's default).
LEADER_LEASE_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--restarts",
        type=harness.positive,
        default=50,
        help="allocator restarts under load, half SIGTERM and half SIGKILL (default 50)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="first run the allocator with a hot standby and take its leader out --kills times "
        "(SIGKILL and SIGSTOP past the lease), then the restarts without a standby",
    )
    p.add_argument(
        "--kills",
        type=harness.positive,
        default=50,
        help="with --standby: leader kills under load, half SIGKILL, half SIGSTOP (default 50)",
    )
    harness.add_json_option(p)


def restart_under_load(
    stack, restarts: int, model: str, seed: int = 0, on_restart=None
) -> dict[str, Any]:
    """The drill on a started stack (its allocator journaled in Redis):
    the reference texts, then `restarts` restarts under load; the figures."""
    urls = list(stack.worker_urls)
    reference = reference_texts(urls, model)
    rng = random.Random(seed)
    kinds = ["term"] * (restarts // 2) + ["kill"] * (restarts - restarts // 2)
    rng.shuffle(kinds)
    before = worker_counters(urls)
    load = Load(urls, model, seed)
    load.start()
    back_s: list[float] = []
    t_start = time.monotonic()
    allocator = stack.allocator
    for i, how in enumerate(kinds):
        # at least a request under way since the last restart, then a random moment
        served = load.count()
        _wait_until(
            lambda served=served: load.count() > served, 120, "a request to finish between restarts"
        )
        time.sleep(rng.uniform(0.0, 1.0))
        t = time.monotonic()
        if how == "term":
            allocator.terminate(grace=30.0)
        else:
            allocator.kill()
            allocator.proc.popen.wait()
        # down briefly, or long enough that the client's own retries run out
        time.sleep(rng.uniform(0.0, 0.3) if rng.random() < 0.5 else rng.uniform(2.0, 9.0))
        allocator.start().wait_healthy(120)
        back_s.append(time.monotonic() - t)
        if on_restart is not None:
            on_restart(i + 1, how)
    load.stop()
    wall = time.monotonic() - t_start
    after = worker_counters(urls)
    return {
        "restarts": restarts,
        "sigterm": kinds.count("term"),
        "sigkill": kinds.count("kill"),
        "wall_s": round(wall, 1),
        "back_s_p50": round_or_none(harness.percentile(back_s, 0.5)),
        "back_s_max": round_or_none(max(back_s, default=None)),
        **outcome_figures(load.outcomes, reference, before, after, t_start),
    }


class _JournalTap:
    """Reads every journal record as the leader writes it (as a standby
    does: `RedisJournal.tail`) and counts the step records that apply a
    pool's step twice or do not follow its last one."""

    def __init__(self, state: str) -> None:
        from allocator_service.store.journal import RedisJournal

        self._journal = RedisJournal(state)
        self.index = self._journal.tail(0).base  # from the records stored now
        self._last: dict[str, int] = {}
        self.steps = self.twice = self.unchained = self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="journal-tap", daemon=True)

    def start(self) -> _JournalTap:
        self._thread.start()
        return self

    def _run(self) -> None:
        from allocator_service.store.framing import record_bytes
        from allocator_service.wire.errors import StoreUnavailable
        from allocator_service.wire.v1 import journal_pb2 as jpb

        while not self._stop.wait(0.01):
            try:
                tail = self._journal.tail(self.index)
            except StoreUnavailable:
                continue
            if tail.entries is None:  # trimmed by a snapshot before it was read: not checked
                head = tail.head.split(b":", 1)[0]
                index = int(head) if head.isdigit() else self.index
                self.missed += max(index - self.index, 0)
                self.index = index
                self._last.clear()
                continue
            for raw in tail.entries:
                record = jpb.JournalRecord.FromString(record_bytes(raw))
                self.index = record.index
                if record.WhichOneof("change") != "step":
                    continue
                step = record.step
                last = self._last.get(step.pool_id)
                self.steps += 1
                if last is not None and step.step_id <= last:
                    self.twice += 1
                elif last is not None and step.prev_step_id != last:
                    self.unchained += 1
                self._last[step.pool_id] = step.step_id

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(5)
        self._journal.close()
        return {
            "steps_journaled": self.steps,
            "steps_applied_twice": self.twice,
            "steps_not_following_their_last": self.unchained,
            "records_not_read": self.missed,
        }


def _leading(address: str) -> bool:
    from allocator_service.rpc.servicer import SERVICE_NAME
    from pagedkv.stack.probes import grpc_health_ok

    return grpc_health_ok(address, timeout=1.0, service=SERVICE_NAME)


def failover_under_load(
    stack, kills: int, model: str, seed: int = 0, on_kill=None
) -> dict[str, Any]:
    """The failover drill on a started stack with a standby (`standby=True`):
    the reference texts, then `kills` leader kills under load (SIGKILL, or
    SIGSTOP until the standby serves and then SIGCONT); the figures."""
    import signal

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import PoolConfig
    from allocator_service.core.step import Admit, Free
    from allocator_service.store.leader import DEPOSED, TOOK_OVER

    urls = list(stack.worker_urls)
    reference = reference_texts(urls, model)
    processes = [stack.allocator, stack.standbys[0]]
    addresses = [stack.allocator_address, stack.standby_addresses[0]]
    probe = GrpcAllocator(
        ",".join(addresses),
        PoolSpec("bench-probe", PoolConfig(num_blocks=8, block_size=4)),
        auth_token=stack.admin_token,
    )
    held = [False]

    def probe_step() -> None:
        from allocator_service.client import AllocatorUnavailable

        ops = [Free("p")] if held[0] else [Admit("p", [1, 2, 3])]
        while True:
            try:
                probe.step(ops)
                held[0] = not held[0]
                return
            except AllocatorUnavailable:
                continue

    rng = random.Random(seed)
    kinds = ["kill"] * (kills - kills // 2) + ["stop"] * (kills // 2)
    rng.shuffle(kinds)
    tap = _JournalTap(stack.redis_url).start()
    before = worker_counters(urls)
    load = Load(urls, model, seed)
    load.start()
    back: dict[str, list[float]] = {"kill": [], "stop": []}
    t_start = time.monotonic()
    for i, how in enumerate(kinds):
        served = load.count()
        _wait_until(
            lambda served=served: load.count() > served, 120, "a request to finish between kills"
        )
        time.sleep(rng.uniform(0.0, 1.0))
        lead = next((j for j in (0, 1) if _leading(addresses[j])), None)
        if lead is None:
            _wait_until(lambda: any(_leading(a) for a in addresses), 60, "a leader")
            lead = next(j for j in (0, 1) if _leading(addresses[j]))
        leader, popen = processes[lead], processes[lead].proc.popen
        t = time.monotonic()
        if how == "kill":
            leader.kill()
            popen.wait()
        else:
            popen.send_signal(signal.SIGSTOP)
        probe_step()  # answered by the standby once it took over
        back[how].append(time.monotonic() - t)
        if how == "kill":
            leader.start().wait_healthy(120)  # it follows the new leader now
        else:
            time.sleep(rng.uniform(0.0, 0.5))
            deposed = leader.log().count(DEPOSED)
            popen.send_signal(signal.SIGCONT)
            # (it may lead again later: a leader that cannot
            # renew in time on a loaded machine is replaced)
            _wait_until(
                lambda p=leader, n=deposed: p.log().count(DEPOSED) > n,
                30,
                "the resumed leader to step down",
            )
        if on_kill is not None:
            on_kill(i + 1, how)
    load.stop()
    wall = time.monotonic() - t_start
    probe.close()
    time.sleep(0.5)
    journal = tap.stop()
    takeovers = sum(p.log().count(TOOK_OVER) for p in processes)
    after = worker_counters(urls)
    figures = outcome_figures(load.outcomes, reference, before, after, t_start)
    every = back["kill"] + back["stop"]
    return {
        "kills": kills,
        "sigkill": kinds.count("kill"),
        "sigstop": kinds.count("stop"),
        "leader_lease_s": LEADER_LEASE_S,
        "wall_s": round(wall, 1),
        # takeovers beyond one per kill: a leader replaced
        # because it did not renew its lease in time
        "takeovers": takeovers,
        "unforced_takeovers": max(takeovers - kills, 0),
        "back_s_p50": round_or_none(harness.percentile(every, 0.5)),
        "back_s_max": round_or_none(max(every, default=None)),
        "back_s_p50_sigkill": round_or_none(harness.percentile(back["kill"], 0.5)),
        "back_s_max_sigkill": round_or_none(max(back["kill"], default=None)),
        "back_s_p50_sigstop": round_or_none(harness.percentile(back["stop"], 0.5)),
        "back_s_max_sigstop": round_or_none(max(back["stop"], default=None)),
        **journal,
        **figures,
    }


def _wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.stack import LocalStack

    def progress(i: int, how: str) -> None:
        if i % 10 == 0 or i == args.restarts:
            harness.log("restart", f"{i}/{args.restarts} restarts")

    standby = None
    if args.standby:

        def killed(i: int, how: str) -> None:
            if i % 10 == 0 or i == args.kills:
                harness.log("restart", f"{i}/{args.kills} leader kills (standby)")

        env = {**ALLOCATOR_ENV, "PAGEDKV_ALLOCATOR_LEADER_LEASE": str(LEADER_LEASE_S)}
        with LocalStack(
            WORKERS,
            MODEL,
            worker_args=WORKER_ARGS,
            env=env,
            redis=True,
            standby=True,
            startup_timeout=300.0,
            grace=15.0,
        ) as stack:
            standby = failover_under_load(stack, args.kills, MODEL, on_kill=killed)
    with LocalStack(
        WORKERS,
        MODEL,
        worker_args=WORKER_ARGS,
        env=ALLOCATOR_ENV,
        redis=True,
        startup_timeout=300.0,
        grace=15.0,
    ) as stack:
        figures = restart_under_load(stack, args.restarts, MODEL, on_restart=progress)
    return {
        "workload": {
            "model": MODEL,
            "workers": WORKERS,
            "clients_per_worker": CLIENTS_PER_WORKER,
            "prompts": len(PROMPTS),
            "max_tokens": MAX_TOKENS,
            "worker_args": WORKER_ARGS,
            "allocator_env": ALLOCATOR_ENV,
            "state": "redis (append-only)",
        },
        **({"standby": standby} if standby is not None else {}),
        **figures,
    }


def tables(report: dict) -> list[Table]:
    r = report
    rows = [
        [
            cell(r["restarts"]),
            cell(r["sigterm"]),
            cell(r["sigkill"]),
            cell(r["requests"]),
            cell(r["failed_requests"]),
            cell(r["wrong_texts"]),
            cell(r["back_s_p50"]),
            cell(r["back_s_max"]),
            cell(r["stall_s"]),
            cell(r["latency_s_max"]),
            cell(r["preemptions"]),
        ]
    ]
    w = r["workload"]
    notes = [
        f"{w['workers']} workers ({w['model']}), {w['clients_per_worker']} clients each, greedy, "
        f"{w['max_tokens']} tokens a request, streamed and not; the allocator's state in Redis.",
        "failed: any answer but 200, or a stream cut before [DONE]; wrong: a text unlike the "
        "answer before any restart; back: from the signal to serving again.",
    ]
    notes += [f"failed: {json.dumps(f)}" for f in r["failures"]]
    notes += [f"wrong: {json.dumps(f)}" for f in r["wrong"]]
    out = []
    sb = r.get("standby")
    if sb is not None:
        out.append(
            Table(
                "leader kills under load, with a hot standby",
                [
                    "kills",
                    "SIGKILL",
                    "SIGSTOP",
                    "requests",
                    "failed",
                    "wrong texts",
                    "steps applied twice",
                    "back p50 s",
                    "back max s",
                    "SIGKILL p50/max s",
                    "SIGSTOP p50/max s",
                    "latency max s",
                ],
                [
                    [
                        cell(sb["kills"]),
                        cell(sb["sigkill"]),
                        cell(sb["sigstop"]),
                        cell(sb["requests"]),
                        cell(sb["failed_requests"]),
                        cell(sb["wrong_texts"]),
                        cell(sb["steps_applied_twice"]),
                        cell(sb["back_s_p50"]),
                        cell(sb["back_s_max"]),
                        f"{cell(sb['back_s_p50_sigkill'])} / {cell(sb['back_s_max_sigkill'])}",
                        f"{cell(sb['back_s_p50_sigstop'])} / {cell(sb['back_s_max_sigstop'])}",
                        cell(sb["latency_s_max"]),
                    ]
                ],
                [
                    f"leader lease {sb['leader_lease_s']:g} s; back: from the signal to the answer "
                    "of a probe step sent at once with both addresses (the client follows the "
                    "leader); a SIGSTOPped leader is resumed "
                    "once the standby serves and must step down.",
                    f"takeovers: {sb['takeovers']} ({sb['unforced_takeovers']} beyond one per "
                    "kill: a leader that did not renew its lease in time, replaced and fenced).",
                    f"journal: {sb['steps_journaled']} steps read as written, "
                    f"{sb['steps_applied_twice']} applied twice, "
                    f"{sb['steps_not_following_their_last']} not following their pool's last step, "
                    f"{sb['records_not_read']} records trimmed "
                    "before they were read (not checked).",
                ]
                + [f"failed: {json.dumps(f)}" for f in sb["failures"]]
                + [f"wrong: {json.dumps(f)}" for f in sb["wrong"]],
            )
        )
    return out + [
        Table(
            "allocator restarts under load, no standby",
            [
                "restarts",
                "SIGTERM",
                "SIGKILL",
                "requests",
                "failed",
                "wrong texts",
                "back p50 s",
                "back max s",
                "stall s",
                "latency max s",
                "preemptions",
            ],
            rows,
            notes,
        )
    ]


def run(args: argparse.Namespace) -> int:
    return harness.run("restart", args, measure, tables)
