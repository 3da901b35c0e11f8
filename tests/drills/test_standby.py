"""The hot standby drill (docs/reliability.md): the allocator's leader
SIGSTOPped past its lease while workers serve.

A stack of real processes (`pagedkv up --standby`: a private Redis, two
allocators with `--standby`, two tiny-random workers given both addresses)
under greedy load. The leader is SIGSTOPped; the standby takes over within
the lease and the workers follow it; the old leader is resumed and must not
write: a new step queued at it while it was stopped (sent by hand, with
its pool's credential) is refused UNAVAILABLE: by the fence of the
journal's append script when the old leader still believed it led, or
`not_leader` when it had already stepped down; the new leader then
applies that step once, as the in-process core does, and the journal,
replayed, is sound with every step once. Every
request completes with the text a run with no fault gives.

Figures: `python -m pytest tests/drills/test_standby.py -s` prints a
`DRILL {...}` JSON line.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.transport import error_reason, open_channel
from allocator_service.core import PoolConfig, step_columns
from allocator_service.core.step import Admit, Append
from allocator_service.store.events import EventLog
from allocator_service.store.journal import RedisJournal
from allocator_service.store.leader import DEPOSED
from allocator_service.store.replay import replay
from allocator_service.wire.codec import decode_results, fill_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc
from pagedkv.bench.restart import ALLOCATOR_ENV, WORKER_ARGS, _JournalTap, _leading
from pagedkv.bench.restart_clients import Load, outcome_figures, reference_texts, worker_counters
from tests.support.drills import MODEL, Stack, report, wait_for

pytestmark = pytest.mark.slow

LEASE_S = 1.0
# the whole journal kept: replayed at the end
ENV = {
    **ALLOCATOR_ENV,
    "PAGEDKV_ALLOCATOR_LEADER_LEASE": str(LEASE_S),
    "PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "100000",
}


def test_a_leader_stopped_past_its_lease_is_replaced_and_never_writes_again():
    with Stack(2, worker_args=WORKER_ARGS, env=ENV, redis=True, standby=True) as stack:
        urls = list(stack.worker_urls)
        reference = reference_texts(urls, MODEL)
        old = stack.allocator
        assert _leading(stack.allocator_address) and not _leading(stack.standby_addresses[0])
        # a pool of the drill's own, to queue a step at the stopped leader
        probe = GrpcAllocator(
            f"{stack.allocator_address},{stack.standby_addresses[0]}",
            PoolSpec("drill-probe", PoolConfig(num_blocks=8, block_size=4)),
            auth_token=stack.token,
            heartbeat=True,
        )
        reference_pool = EmbeddedAllocator(probe.spec)
        first_ops, second_ops = (
            [Admit("q", [1, 2, 3, 4, 5])],
            [Append("q", [6, 7]), Admit("r", [9, 8, 7, 6, 5])],
        )
        # step 1, at the leader
        assert list(probe.step(first_ops)) == list(reference_pool.step(first_ops))
        second = pb.StepRequest(pool=probe._ref, step_id=2, prev_step_id=1)
        fill_ops(second.ops, step_columns(second_ops))
        metadata = (("authorization", f"Bearer {stack.token}"),)
        tap = _JournalTap(stack.redis_url).start()
        before = worker_counters(urls)
        load = Load(urls, MODEL, seed=5)
        load.start()
        wait_for(lambda: load.count() >= 4, 120, "requests before the fault")

        old.proc.popen.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        # step 2 of the drill's pool waits in the stopped leader's socket
        queued = pb_grpc.AllocatorStub(open_channel(stack.allocator_address)).Step.future(
            second, timeout=120, metadata=metadata
        )
        wait_for(lambda: _leading(stack.standby_addresses[0]), 30, "the standby to take over")
        took_over_s = time.monotonic() - t0
        served = load.count()
        wait_for(lambda: load.count() > served + 4, 120, "requests served by the new leader")

        # it wakes up believing it leads, with step 2 to apply
        old.proc.popen.send_signal(signal.SIGCONT)
        with pytest.raises(grpc.RpcError) as refused:
            queued.result(timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        fenced = "fenced" in (refused.value.details() or "").lower()
        assert fenced or error_reason(refused.value) == "not_leader", refused.value.details()
        outcome = f"{error_reason(refused.value)}{' (its journal append fenced)' if fenced else ''}"
        # nothing of it was written: the new leader applies step 2 now, once, as the core does
        answer = pb_grpc.AllocatorStub(open_channel(stack.standby_addresses[0])).Step(
            second, timeout=10, metadata=metadata
        )
        assert list(decode_results(answer, len(second_ops))) == list(
            reference_pool.step(second_ops)
        )
        wait_for(lambda: DEPOSED in old.log(), 30, "the resumed leader to step down and follow")
        served = load.count()
        wait_for(lambda: load.count() > served + 4, 120, "requests after the old leader resumed")
        load.stop()
        after = worker_counters(urls)
        journal = tap.stop()
        probe.close()
        figures = outcome_figures(load.outcomes, reference, before, after, t0)
        fenced_lines = [line for line in old.proc.tail if "fenced" in line.lower()]
        report(
            "standby_sigstop",
            {
                "lease_s": LEASE_S,
                "standby_took_over_s": round(took_over_s, 3),
                "resumed_leaders_step": outcome,
                "fenced_log_lines": len(fenced_lines),
                **journal,
                **{k: v for k, v in figures.items() if k not in ("failures", "wrong")},
            },
        )
        assert figures["failures"] == [] and figures["failed_requests"] == 0
        assert figures["wrong"] == [] and figures["wrong_texts"] == 0
        assert (
            journal["steps_applied_twice"] == 0 and journal["steps_not_following_their_last"] == 0
        )
        # the journal the two leaders wrote replays soundly: every record chained, every step once
        stored = RedisJournal(stack.redis_url)
        try:
            loaded = stored.load(take_ownership=False, check_owner=False)
        finally:
            stored.close()
        _, replayed = replay(loaded.snapshot, loaded.entries, loaded.head, EventLog(1))
        assert replayed.sound, replayed.problems
        for w in stack.workers:
            assert "was dropped" not in w.log()  # no worker lost its pool
