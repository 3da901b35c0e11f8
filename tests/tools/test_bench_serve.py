"""`pagedkv bench serve` on the tiny random model: the
report's shape and sane values, never timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.bench.workloads import SERVE

# the small workload: what every test here runs
REQUESTS, MAX_TOKENS = SERVE["small"].requests, SERVE["small"].max_tokens

TIMING_KEYS = ("tokens_per_s", "wall_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s")
KV_KEYS = (
    "kv_slots_reserved",
    "kv_slots_allocated_peak",
    "kv_slots_holding_tokens_peak",
    "kv_utilisation_mean",
)


def bench(*extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pagedkv",
        "bench",
        "serve",
        "--model",
        "tiny-random",
        "--workload",
        "small",
        "--json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_system(s: dict, pool_slots: int | None = None) -> None:
    # ignore_eos: every request runs to max_tokens
    assert s["tokens_generated"] == REQUESTS * MAX_TOKENS
    for key in TIMING_KEYS:
        assert s[key] > 0, key
    assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["wall_s"]
    assert isinstance(s["preemptions"], int) and s["preemptions"] >= 0
    assert len(s["tokens_per_s_rounds"]) == 1
    if pool_slots is not None:
        assert s["kv_slots_reserved"] == pool_slots
        assert 0 < s["kv_slots_holding_tokens_peak"] <= s["kv_slots_allocated_peak"] <= pool_slots
        assert 0 < s["kv_utilisation_mean"] <= 1


def test_engine_only():
    # prefix caching off once per CPU attention backend: the gather path and the block-wise kernel
    out = bench("--systems", "engine_no_prefix_cache_torch,engine_no_prefix_cache_numba")
    assert out["benchmark"] == "serve" and out["model"] == "tiny-random"
    w = out["workload"]
    assert w["requests"] == REQUESTS and w["max_tokens"] == MAX_TOKENS
    assert (
        0
        < w["shared_prefix_tokens"]
        < w["prompt_tokens_min"]
        <= w["prompt_tokens_mean"]
        <= w["prompt_tokens_max"]
    )
    assert w["prompt_tokens_min"] < w["prompt_tokens_max"]  # mixed lengths
    slots = out["kv_pool"]["slots"]
    assert slots == out["kv_pool"]["num_blocks"] * out["kv_pool"]["block_size"]
    assert set(out["systems"]) == {
        "engine",
        "engine_no_prefix_cache_torch",
        "engine_no_prefix_cache_numba",
    }
    assert out["skipped"] == {}  # nothing asked for was left out
    on, off = out["systems"]["engine"], out["systems"]["engine_no_prefix_cache_torch"]
    for s in out["systems"].values():
        check_system(s, slots)
        # greedy: same tokens with the cache on or off, either backend
        assert s["outputs_match_engine"] == REQUESTS
    # The shared system prompt is served from the prefix cache, and stored once.
    assert on["prefix_cache"] and 0 < on["prefix_hit_tokens"] < on["prefix_queried_tokens"]
    assert off["prefix_hit_tokens"] == 0
    assert on["kv_slots_holding_tokens_peak"] < on["kv_tokens_logical_peak"]
    assert on["kv_slots_allocated_peak"] < off["kv_slots_allocated_peak"]
    r = out["ratios"]
    assert r["engine_vs_hf_static"] is None and r["engine_vs_hf_continuous"] is None
    assert r["engine_vs_engine_no_prefix_cache"] is None  # two prefix-off systems: no single ratio


def test_against_transformers():
    pytest.importorskip("transformers")
    out = bench("--systems", "hf_static,hf_continuous")
    # more than one batch
    assert out["workload"]["hf_static_batch_size"] == SERVE["small"].batch_size < REQUESTS
    assert (
        "engine_no_prefix_cache" not in out["systems"]
        and "engine_no_prefix_cache" not in out["skipped"]
    )
    slots = out["kv_pool"]["slots"]
    check_system(out["systems"]["engine"], slots)
    hf = out["systems"]["hf_static"]
    check_system(hf)
    # A contiguous cache reserves rows x (longest prompt
    # + max_tokens); mixed lengths leave some unused.
    assert hf["kv_slots_allocated_peak"] == hf["kv_slots_reserved"] <= slots
    assert 0 < hf["kv_utilisation_mean"] < 1 and hf["preemptions"] == 0
    assert 0 <= hf["outputs_match_engine"] <= REQUESTS
    assert out["ratios"]["engine_vs_hf_static"] > 0
    assert not any(k.startswith("engine_no_prefix_cache") for k in out["ratios"])
    if "hf_continuous" in out["systems"]:
        cb = out["systems"]["hf_continuous"]
        check_system(cb)
        assert cb["kv_slots_reserved"] == slots
        assert out["ratios"]["engine_vs_hf_continuous"] > 0
    else:
        assert "hf_continuous" in out["skipped"]


def test_through_each_allocator_async_on_and_off():
    """`--allocator embedded,grpc,grpc+redis --compare-async-scheduling`: real
    allocator processes (and a private redis-server), the same greedy tokens
    through each, every figure present; ratios to the embedded run of the
    same scheduling."""
    import shutil

    allocators = "embedded,grpc,grpc+redis" if shutil.which("redis-server") else "embedded,grpc"
    names = allocators.split(",")
    out = bench("--allocator", allocators, "--compare-async-scheduling")
    assert out["benchmark"] == "serve --allocator" and out["kv_pool"]["prefix_caching"] is True
    systems = out["systems"]
    assert list(systems) == names + [f"{n}_sync" for n in names]
    for key, s in systems.items():
        assert s["tokens_generated"] == REQUESTS * MAX_TOKENS
        # the same greedy tokens, whichever allocator and scheduling
        assert s["outputs_match_first"] == REQUESTS
        assert s["async_scheduling"] is not key.endswith("_sync")
        assert s["allocator"] == key.removesuffix("_sync")
        for k in ("tokens_per_s", "mean_step_ms", "tpot_ms", "ratio_to_embedded"):
            assert s[k] > 0, k
        assert s["allocator_wait_ms_per_step"] >= 0
        assert s["prefix_hit_tokens"] > 0  # the shared system prompt, through every allocator
        assert (s["async_vs_sync"] is None) is not s["async_scheduling"]
    assert (
        systems["embedded"]["ratio_to_embedded"]
        == systems["embedded_sync"]["ratio_to_embedded"]
        == 1.0
    )
    assert systems["grpc"]["ratio_to_embedded"] == round(
        systems["grpc"]["tokens_per_s"] / systems["embedded"]["tokens_per_s"], 3
    )
    # one round: the paired median is that round's own ratio
    assert systems["embedded"]["ratio_to_embedded_paired_median"] == 1.0
    assert (
        systems["grpc"]["ratio_to_embedded_paired_median"] == systems["grpc"]["ratio_to_embedded"]
    )


def test_figures_the_allocator_comparison_does_not_measure_are_null():
    """`--allocator` does not read the pool's stats after every step (one more
    allocator call per step on the loop being timed): the figures made from
    those reads are null, never 0; the peaks are the engine's own high-water
    marks, raised at every step, so they are there."""
    out = bench("--allocator", "embedded")
    s = out["systems"]["embedded"]
    for key in ("kv_tokens_logical_peak", "kv_utilisation_mean", "kv_utilisation_peak_alloc"):
        assert s[key] is None, key
    assert (
        0
        < s["kv_slots_holding_tokens_peak"]
        <= s["kv_slots_allocated_peak"]
        <= s["kv_slots_reserved"]
    )
    assert 0 < s["max_running_seqs"] <= REQUESTS
    assert s["prefix_hit_tokens"] > 0 and s["preemptions"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--allocator", "embedded,mars"], "comma-separated list of embedded, grpc, grpc+redis"),
        (["--allocator", "grpc,grpc"], "named twice"),
        (["--compare-async-scheduling"], "give --allocator too"),
        (["--allocator", "grpc", "--systems", "hf_static"], "give one of them"),
        (["--systems", "hf_static,vllm"], "comma-separated list of engine_no_prefix_cache"),
    ],
)
def test_bad_allocator_arguments(args, message):
    cmd = [
        sys.executable,
        "-m",
        "pagedkv",
        "bench",
        "serve",
        "--model",
        "tiny-random",
        "--workload",
        "small",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
