"""The routing cost (router/policy.py) as properties, and the command's
usage errors."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

from hypothesis import assume, given
from hypothesis import strategies as st

from router.policy import POLICIES, Balance, Candidate, counted, evicted_blocks, rank

candidates = st.lists(
    st.builds(
        Candidate,
        key=st.sampled_from([f"http://w{i}" for i in range(6)]),
        cached_tokens=st.integers(0, 512),
        free_blocks=st.integers(0, 64),
        num_blocks=st.just(64),
        in_flight=st.integers(0, 24),
        block_size=st.sampled_from([0, 16]),
        clean_free=st.one_of(st.none(), st.integers(0, 64)),
        recent_blocks=st.integers(0, 64),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda c: c.key,
)
balances = st.builds(
    Balance,
    abs_threshold=st.integers(0, 12),
    rel_threshold=st.floats(1.0, 4.0),
    cache_threshold=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
)


def with_(c: Candidate, **changes) -> Candidate:
    return dataclasses.replace(c, **changes)


@given(candidates, st.integers(1, 512), st.integers(0, 100), st.sampled_from(POLICIES))
def test_every_policy_orders_every_candidate_once(cands, prompt, turn, policy):
    assert sorted(c.key for c in rank(policy, cands, prompt, turn)) == sorted(c.key for c in cands)


@given(candidates, st.integers(1, 512), st.integers(0, 100), balances, st.randoms())
def test_kv_is_deterministic_whatever_order_the_workers_come_in(cands, prompt, turn, balance, rnd):
    shuffled = list(cands)
    rnd.shuffle(shuffled)
    assert rank("kv", shuffled, prompt, turn, balance) == rank("kv", cands, prompt, turn, balance)


@given(candidates, st.integers(1, 512), st.integers(0, 100), balances)
def test_kv_never_places_on_a_worker_past_both_thresholds_while_another_is_under(
    cands, prompt, turn, balance
):
    least = min(c.in_flight for c in cands)
    first = rank("kv", cands, prompt, turn, balance)[0]
    # the least loaded is never past them, so one is always under
    assert not (
        first.in_flight - least > balance.abs_threshold
        and first.in_flight > balance.rel_threshold * least
    )


@given(candidates, st.integers(1, 512), st.integers(0, 100), balances)
def test_with_a_balanced_load_the_longest_prefix_wins(cands, prompt, turn, balance):
    """Loads within the thresholds and room to spare everywhere (nothing evicted): the worker
    holding the most of the prompt gets it, whatever the in-flight counts, when that is at least
    the cache threshold's share of the prompt; under it, no match counts: the one sent the fewest
    blocks lately, then the least loaded."""
    cands = [
        with_(
            c, in_flight=c.in_flight % (balance.abs_threshold + 1), free_blocks=free, clean_free=64
        )
        for c, free in zip(cands, range(64, 0, -7), strict=False)
    ]
    first = rank("kv", cands, prompt, turn, balance)[0]
    best = max(min(c.cached_tokens, prompt) for c in cands)
    if best >= balance.cache_threshold * prompt:
        assert min(first.cached_tokens, prompt) == best
    else:
        fewest = [c for c in cands if c.recent_blocks == min(d.recent_blocks for d in cands)]
        assert first in fewest and first.in_flight == min(c.in_flight for c in fewest)


@given(candidates, st.integers(1, 512), st.integers(0, 100), balances, st.data())
def test_loads_under_the_thresholds_move_no_placement(cands, prompt, turn, balance, data):
    """Once the cache decided (one worker gains the most), any in-flight counts within the
    absolute threshold of each other leave the placement where it is."""
    first = rank("kv", cands, prompt, turn, balance)[0]

    def won(c: Candidate) -> tuple[int, bool]:
        m = counted(c, prompt, balance)
        return m.cached_tokens, evicted_blocks(m, prompt) == 0

    # not a tie broken by load
    assume(all(won(c) < won(first) for c in cands if c.key != first.key))
    base = data.draw(st.integers(0, 24))
    loads = data.draw(
        st.lists(
            st.integers(base, base + balance.abs_threshold),
            min_size=len(cands),
            max_size=len(cands),
        )
    )
    spiked = [with_(c, in_flight=n) for c, n in zip(cands, loads, strict=True)]
    assert rank("kv", spiked, prompt, turn, balance)[0].key == first.key


@given(candidates, st.integers(1, 512), st.integers(0, 100))
def test_kv_with_nothing_cached_to_evict_or_sent_lately_is_least_load(cands, prompt, turn):
    cold = [with_(c, cached_tokens=0, block_size=0, recent_blocks=0) for c in cands]
    assert rank("kv", cold, prompt, turn) == rank("least-load", cold, prompt, turn)


@given(candidates, st.integers(1, 512), st.integers(0, 100))
def test_a_new_prefix_goes_to_the_worker_sent_the_fewest_blocks_lately(cands, prompt, turn):
    """Nothing cached, nothing to evict, the load under the thresholds: fewest recent blocks
    first, whatever the requests in flight; the load only among equals."""
    cold = [with_(c, cached_tokens=0, block_size=0, in_flight=min(c.in_flight, 8)) for c in cands]
    order = rank("kv", cold, prompt, turn)
    assert [c.recent_blocks for c in order] == sorted(c.recent_blocks for c in cold)
    for a, b in itertools.pairwise(order):
        if a.recent_blocks == b.recent_blocks:
            assert a.in_flight <= b.in_flight


@given(st.integers(0, 64), st.integers(0, 64), st.integers(1, 512), st.integers(0, 512))
def test_a_placement_evicts_only_cached_free_blocks_beyond_the_clean_ones(
    free, clean, prompt, cached
):
    c = Candidate("http://w", cached, free, 64, 0, 16, clean)
    new = -(-prompt // 16) - min(cached, prompt) // 16
    clean = min(clean, free)
    assert evicted_blocks(c, prompt) == max(0, min(new - clean, free - clean))


@given(st.integers(0, 4), st.integers(0, 100))
def test_with_the_same_match_a_worker_with_room_beats_one_that_would_evict(busier, turn):
    """Equal matches: the worker whose free blocks hold no cached prefix and cover the prompt's
    new blocks wins, though busier (within the thresholds); with room on both, the less loaded."""
    # free blocks: all others' prefixes
    full = Candidate("http://a", 96, 40, 64, 0, 16, clean_free=0)
    roomy = Candidate("http://b", 96, 40, 64, 1 + busier, 16, clean_free=40)
    assert rank("kv", [full, roomy], 160, turn)[0].key == "http://b"
    assert rank("kv", [with_(full, clean_free=4), roomy], 160, turn)[0].key == "http://a"


@given(st.integers(0, 4), st.integers(0, 100))
def test_a_shared_preamble_under_the_cache_threshold_does_not_draw_a_new_prefix(busier, turn):
    """Every prompt starts with the same block, which one worker holds: a new prefix
    (one block of ten matched) goes by load, as if nothing were cached."""
    holder = Candidate("http://a", 16, 64, 64, 1 + busier, 16, clean_free=64)
    other = Candidate("http://b", 0, 64, 64, 0, 16, clean_free=64)
    assert rank("kv", [holder, other], 160, turn)[0].key == "http://b"
    # the prefix itself cached (past the threshold): it stays with its holder
    assert rank("kv", [with_(holder, cached_tokens=144), other], 160, turn)[0].key == "http://a"


@given(st.integers(0, 8), st.integers(0, 64))
def test_a_prompt_cached_whole_outweighs_any_load_under_the_thresholds(in_flight, free):
    holder = Candidate("http://holder", 100, free, 64, in_flight)
    idle = Candidate("http://idle", 0, 64, 64, 0)
    assert rank("kv", [holder, idle], 100, 0, Balance(8, 1.5))[0].key == "http://holder"
    # past both thresholds: the load decides
    assert (
        rank("kv", [with_(holder, in_flight=9), idle], 100, 0, Balance(8, 1.5))[0].key
        == "http://idle"
    )


@given(candidates)
def test_round_robin_takes_each_in_turn(cands):
    firsts = [rank("round-robin", cands, 10, turn)[0].key for turn in range(len(cands))]
    assert sorted(firsts) == sorted(c.key for c in cands)


def test_usage_errors_are_one_line():
    run = [sys.executable, "-m", "router", "--model", "tiny-random"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "pagedkv router: error: give --allocator HOST:PORT (workers found there) "
        "or --workers URL,..."
    )
    out = subprocess.run([*run, "--workers", "ftp://x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "expected http:// or https:// URLs" in out.stderr
    out = subprocess.run(
        run,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PAGEDKV_ROUTER_LISTEN": "nope", "PATH": ""},
    )
    assert out.returncode == 2 and "PAGEDKV_ROUTER_LISTEN='nope'" in out.stderr


@given(st.integers(1, 9), st.integers(0, 3), st.integers(0, 100))
def test_a_hit_in_the_kv_pool_outweighs_one_in_the_host_tier_and_that_one_in_the_store(
    blocks, busier, turn
):
    """The same prompt held whole by three workers, each in another tier: the
    KV pool's holder first, then the host tier's, then the store's, whatever
    their load under the thresholds; a worker holding part in its KV pool and
    the rest in the store beats one holding it all in the store."""
    n = blocks * 16
    kv = Candidate("http://kv", n, 64, 64, 1 + busier, 16)
    host = Candidate("http://host", 0, 64, 64, busier, 16, host_tokens=n)
    store = Candidate("http://store", 0, 64, 64, 0, 16, store_tokens=n)
    assert [c.key for c in rank("kv", [store, host, kv], n, turn)] == [
        "http://kv",
        "http://host",
        "http://store",
    ]
    part = Candidate("http://part", 16, 64, 64, 1 + busier, 16, store_tokens=n - 16)
    assert rank("kv", [store, part], n, turn)[0].key == "http://part"


@given(st.integers(0, 4), st.integers(0, 100))
def test_tiers_count_toward_the_cache_threshold(busier, turn):
    """A prompt of ten blocks, one in the KV pool and the rest in the host tier:
    past the threshold together, so it stays with that worker though busier."""
    holder = Candidate("http://a", 16, 64, 64, 1 + busier, 16, clean_free=64, host_tokens=144)
    other = Candidate("http://b", 0, 64, 64, 0, 16, clean_free=64)
    assert rank("kv", [holder, other], 160, turn)[0].key == "http://a"
    assert rank("kv", [with_(holder, host_tokens=0), other], 160, turn)[0].key == "http://b"
