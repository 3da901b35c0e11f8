"""The routing cost (router/policy.py) as properties, and the command's
usage errors."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from router.policy import POLICIES, Candidate, rank, score

candidates = st.lists(
    st.builds(Candidate, key=st.sampled_from([f"http://w{i}" for i in range(6)]),
              cached_tokens=st.integers(0, 512), free_blocks=st.integers(0, 64), num_blocks=st.just(64),
              in_flight=st.integers(0, 8)),
    min_size=1, max_size=6, unique_by=lambda c: c.key)


@given(candidates, st.integers(1, 512), st.integers(0, 100), st.sampled_from(POLICIES))
def test_every_policy_orders_every_candidate_once(cands, prompt, turn, policy):
    assert sorted(c.key for c in rank(policy, cands, prompt, turn)) == sorted(c.key for c in cands)


@given(candidates, st.integers(1, 512), st.integers(0, 100))
def test_kv_with_nothing_cached_is_least_load(cands, prompt, turn):
    cold = [Candidate(c.key, 0, c.free_blocks, c.num_blocks, c.in_flight) for c in cands]
    first = rank("kv", cold, prompt, turn)[0]
    most = max(c.in_flight for c in cold)
    assert score(first, prompt, most) == max(score(c, prompt, most) for c in cold)
    if all(c.free_blocks == cold[0].free_blocks for c in cold):  # same usage: the fewest in flight wins
        assert first.in_flight == min(c.in_flight for c in cold)


@given(candidates, st.integers(1, 512), st.integers(0, 100))
def test_with_equal_load_the_most_cached_wins(cands, prompt, turn):
    even = [Candidate(c.key, min(c.cached_tokens, prompt), 32, 64, 2) for c in cands]
    assert rank("kv", even, prompt, turn)[0].cached_tokens == max(c.cached_tokens for c in even)


@given(st.integers(0, 8), st.integers(0, 64))
def test_a_prompt_cached_whole_outweighs_any_load_short_of_full(in_flight, free):
    holder = Candidate("http://holder", 100, free, 64, in_flight)
    idle = Candidate("http://idle", 0, 64, 64, 0)
    first = rank("kv", [holder, idle], 100, 0)[0]
    full = free == 0 and in_flight > 0  # 2 - 1 - 1 = 0 ties with the idle one: least load wins
    assert first.key == ("http://idle" if full else "http://holder")


@given(candidates)
def test_round_robin_takes_each_in_turn(cands):
    firsts = [rank("round-robin", cands, 10, turn)[0].key for turn in range(len(cands))]
    assert sorted(firsts) == sorted(c.key for c in cands)


def test_usage_errors_are_one_line():
    run = [sys.executable, "-m", "router", "--model", "tiny-random"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("pagedkv router: error: give --allocator HOST:PORT (workers found there) "
                                  "or --workers URL,...")
    out = subprocess.run([*run, "--workers", "ftp://x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "expected http:// or https:// URLs" in out.stderr
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, env={"PAGEDKV_ROUTER_LISTEN": "nope",
                                                                                "PATH": ""})
    assert out.returncode == 2 and "PAGEDKV_ROUTER_LISTEN='nope'" in out.stderr
