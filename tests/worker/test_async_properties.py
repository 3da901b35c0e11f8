"""Property-based (hypothesis) test of async scheduling's rules: deferred
hashes and deferred frees (docs/architecture.md, "The block contract"). The
workloads and `Run` are tests/support/async_model.py; what lookahead slots may
cost against a call per step: tests/worker/test_async_lookahead.py.

The real `Scheduler` plans against the real allocator core (`EmbeddedAllocator`)
while a model of the forward pass stands in for torch: each scheduled token
"writes" its K/V, modelled as the token prefix it was computed from, into
its flat slot (copies applied first), and each sampled token is a function
of that prefix (a sample of a fork draws its own). Random workloads: prompts
from a tiny alphabet (cache hits), parallel samples (forks), stop tokens and
length limits (frees that follow a finish), aborts, late arrivals, chunked
prefill, pools small enough to preempt; prefix caching on and off; block
sizes 1, 2, 4. Each workload runs with async scheduling on and off.

After every step:
- every position a forward reads (what precedes its new tokens, cache hits
  included) holds the K/V of exactly that sequence's prefix;
- every block the prefix cache could find when a step's call was answered
  holds, once that step has computed, the K/V its hash names;
- no block is held by two sequences unless shared through the cache (it has
  a hash) or a fork (the holders are samples of one request);
- the worker's block tables, held and reserved slot counts are the
  allocator's, for running sequences and finished ones not freed yet, and
  the allocator holds no sequence the worker does not know;
- every operation the worker sends is accepted, and after each call the
  allocator has at least the free blocks the worker planned with (the free
  count is never over-estimated).
Each workload runs synchronously with a call every step (the reference),
pipelined, overlapped (each step launched before the last one's tokens are
processed: a stop is found a step late), and with lookahead slots (steps
that make no call).
At the end both runs give the same tokens, and every block is back.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings

from tests.support.async_model import Run, fits, workload_st


# An admission answered for a request aborted while its call was out (its
# one block hashed at once): computed all the same, then freed.
@example(
    {
        "block_size": 1,
        "slots": 24,
        "caching": True,
        "budget": 3,
        "requests": [
            {"prompt": [0], "n": 1, "max_tokens": 1, "stops": False, "arrive": 0, "abort": None},
            {"prompt": [0], "n": 1, "max_tokens": 1, "stops": False, "arrive": 1, "abort": 2},
        ],
    }
)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(workload_st.filter(fits))
def test_deferred_hashes_and_frees_keep_the_contract(w):
    synchronous = Run(w, async_scheduling=False).run()
    # An abort lands on a step, and the pipelined engine admits a step later:
    # what an aborted request had produced may differ; everything else is equal.
    kept = {f"r{i}" for i, r in enumerate(w["requests"]) if r["abort"] is None}
    for async_scheduling, lookahead, overlapped in (
        (True, 0, False),
        (True, 3, False),
        (False, 2, False),
        (True, 8, False),
        (True, 0, True),
        (True, 8, True),
    ):
        other = Run(w, async_scheduling, lookahead, overlapped).run()
        assert {k: v for k, v in other.items() if k in kept} == {
            k: v for k, v in synchronous.items() if k in kept
        }
        for rid in kept:
            assert all(other[rid]), "a request ended without a token"
