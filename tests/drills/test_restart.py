"""The allocator restarted again and again under load (docs/reliability.md).

`pagedkv bench restart` (pagedkv/bench/restart.py) as a drill: two workers
on pools small enough to preempt, the allocator's state journaled in a
private Redis, client threads sending greedy requests (streamed and not,
completions and chat) while the allocator is restarted at random moments,
by SIGTERM and by SIGKILL, down briefly or for longer than the client's
own retries. No request fails and every text is the one a run with no
restart gives; the workers lose no pool (nothing is recomputed) and no
block leaks. The command runs many more restarts (`--restarts`, 50 by
default); this drill runs RESTARTS.

Figures: `python -m pytest tests/drills/test_restart.py -s` prints a
`DRILL {...}` JSON line.
"""

from __future__ import annotations

import pytest

from pagedkv.bench.restart import ALLOCATOR_ENV, WORKER_ARGS, restart_under_load
from tests.support.drills import MODEL, Stack, check_no_leak, report

pytestmark = pytest.mark.slow

# Seed 3 orders these four as SIGKILL down long, SIGTERM brief, SIGKILL brief, SIGTERM long:
# each signal with a downtime inside the client's retries and one past them.
RESTARTS = 4


def test_no_request_fails_or_changes_across_allocator_restarts():
    with Stack(2, worker_args=WORKER_ARGS, env=ALLOCATOR_ENV, redis=True) as stack:
        pools = sorted(
            stack.allocator_metrics().labels("pagedkv_allocator_pool_capacity_blocks", "pool_id")
        )
        figures = restart_under_load(stack, RESTARTS, MODEL, seed=3)
        report(
            "allocator_restarts",
            {k: v for k, v in figures.items() if k not in ("failures", "wrong")},
        )
        assert figures["restarts"] == RESTARTS and figures["sigterm"] > 0 and figures["sigkill"] > 0
        assert figures["failures"] == [] and figures["failed_requests"] == 0
        assert figures["wrong"] == [] and figures["wrong_texts"] == 0
        assert figures["requests"] > RESTARTS and figures["step_errors"] == 0
        # the same pools throughout: no worker lost its pool and recomputed
        for w in stack.workers:
            assert "was dropped" not in w.log()
        stack.wait_idle()
        assert sorted(check_no_leak(stack.redis_url, pools)) == pools
