"""`pagedkv kv-size`, `simulate`, `bench core` and `--help`, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# fmt: skip
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
# fmt: skip
OPT_13B = {
    "architectures": ["OPTForCausalLM"],
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def pagedkv(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *args], capture_output=True, text=True, check=check
    )


@pytest.mark.parametrize("cfg,expected", [(LLAMA3_8B, 131_072), (OPT_13B, 819_200)])
def test_kv_size_bytes_per_token(tmp_path, cfg, expected):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = json.loads(
        pagedkv("kv-size", str(path), "--json", "--tokens", "1000", "--gib", "16").stdout
    )
    assert out["bytes_per_token"] == expected
    assert out["bytes_for_tokens"] == 1000 * expected
    assert (
        out["full_sequences_in_budget"] == (16 << 30) // expected // cfg["max_position_embeddings"]
    )


def test_kv_size_text_and_dtype_override(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, "head_dim": 64}))
    out = json.loads(pagedkv("kv-size", str(path), "--json", "--dtype", "float32").stdout)
    assert out["bytes_per_token"] == 2 * 32 * 8 * 64 * 4
    text = pagedkv("kv-size", str(path)).stdout
    assert "bytes per token" in text


def test_kv_size_fp8_kv_cache_halves_bf16(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    for flag in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        out = json.loads(pagedkv("kv-size", str(path), "--json", "--kv-cache-dtype", flag).stdout)
        assert out["bytes_per_token"] == 131_072 // 2 and out["bytes_per_element"] == 1
    assert (
        "65,536 bytes per token" in pagedkv("kv-size", str(path), "--kv-cache-dtype", "fp8").stdout
    )
    auto = json.loads(pagedkv("kv-size", str(path), "--json", "--kv-cache-dtype", "auto").stdout)
    assert auto["bytes_per_token"] == 131_072
    proc = pagedkv("kv-size", str(path), "--kv-cache-dtype", "int4", check=False)
    assert (
        proc.returncode == 2
        and proc.stderr.count("\n") == 1
        and "--kv-cache-dtype must be one of" in proc.stderr
    )


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{", "not valid JSON"),
        ('{"num_hidden_layers": 2}', "num_attention_heads must be a positive integer"),
    ],
)
def test_kv_size_bad_config(tmp_path, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    proc = pagedkv("kv-size", str(path), check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_simulate_lands_near_the_article():
    out = json.loads(pagedkv("simulate", "--json").stdout)
    c, p = out["contiguous"], out["paged"]
    assert out["pool_slots"] == 131_072
    assert c["admitted"] == 16  # 131,072 / 8,192 exactly
    assert 0.10 < c["used_fraction"] < 0.17  # the article: 12.9%
    assert 105 <= p["admitted"] <= 135  # the article: 122
    assert p["block_size"] == 16
    assert p["wasted_slots"] < 16 * p["admitted"]  # less than one block per request
    assert p["allocated_slots"] - p["used_slots"] == p["wasted_slots"]
    assert p["wasted_slots"] / p["allocated_slots"] < 0.01  # the article: 0.7%


def test_simulate_fp8_fits_about_twice_the_requests():
    auto = json.loads(pagedkv("simulate", "--json").stdout)
    fp8 = json.loads(pagedkv("simulate", "--json", "--kv-cache-dtype", "fp8").stdout)
    assert (fp8["bytes_per_token"], fp8["pool_slots"], fp8["kv_cache_dtype"]) == (
        65_536,
        262_144,
        "fp8",
    )
    assert fp8["contiguous"]["admitted"] == 2 * auto["contiguous"]["admitted"] == 32
    assert 1.9 <= fp8["paged"]["admitted"] / auto["paged"]["admitted"] <= 2.0
    proc = pagedkv("simulate", "--kv-cache-dtype", "fp4", check=False)
    assert proc.returncode == 2 and "--kv-cache-dtype must be one of" in proc.stderr


def test_simulate_sweep_and_plot(tmp_path):
    png = tmp_path / "capacity.png"
    out = json.loads(pagedkv("simulate", "--json", "--requests", "200", "--plot", str(png)).stdout)
    sweep = out["sweep"]
    assert [r["block_size"] for r in sweep] == list(range(1, 17))
    assert sweep[0]["wasted_slots"] == 0  # block size 1 wastes nothing
    # under a block a request
    assert all(r["wasted_slots"] < r["block_size"] * r["admitted"] for r in sweep)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_core_reports_every_op():
    out = json.loads(pagedkv("bench", "core", "--json", "--workload", "small").stdout)
    assert (out["sequences"], out["decode_rounds"]) == (200, 8)
    assert [r["prefix_caching"] for r in out["results"]] == [False, True]
    for r in out["results"]:
        assert r["admits_per_s"] > 0 and r["appends_per_s"] > 0 and r["frees_per_s"] > 0
    assert out["results"][1]["prefix_hit_rate"] > 0.5
    assert out["against"] == []


def test_bench_core_against_vllm_says_why_it_skipped():
    """Where vLLM is not installed the side-by-side decode steps still run
    this core's side; vLLM's figures are null and the reason is given."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the comparison would run")
    out = json.loads(
        pagedkv("bench", "core", "--json", "--workload", "small", "--against", "vllm").stdout
    )
    (a,) = out["against"]
    assert (a["system"], a["seqs"]) == ("vllm", 256) and a["pagedkv_step_ms_p50"] > 0
    assert a["vllm_step_ms_p50"] is None and a["ratio_p50"] is None
    assert "vLLM is not installed" in a["skipped"] and "--vllm-python" in a["skipped"]


def test_the_vllm_comparison_takes_each_figure_as_the_median_of_its_rounds():
    from pagedkv.bench.core import _figures, combine

    # three alternating rounds, the machine's speed drifting: each ratio is its own round's
    rounds = [
        _figures([0.0002] * 3, [0.0010] * 3),
        _figures([0.0004] * 3, [0.0040] * 3),
        _figures([0.0003] * 3, [0.0035] * 3),
    ]
    a = combine(rounds)
    assert [round(r["ratio_p50"], 3) for r in a["rounds"]] == [0.2, 0.1, 0.086]
    assert round(a["ratio_p50"], 3) == 0.1  # not 0.3 / 3.5 of the medians taken apart
    assert round(a["pagedkv_step_ms_p50"], 3) == 0.3 and round(a["vllm_step_ms_p50"], 3) == 3.5
    # where vLLM did not run, its figures and the ratios are null, never 0
    alone = combine([_figures([0.0003] * 3, None)])
    assert alone["vllm_step_ms_p50"] is None and alone["ratio_p50"] is None
    assert round(alone["pagedkv_step_ms_p50"], 3) == 0.3


def _walk(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_help_explains_every_flag():
    from pagedkv.cli import build_parser

    missing = [(" ".join(path), a.dest) for path, a in _walk(build_parser()) if not a.help]
    assert missing == []


@pytest.mark.parametrize("cmd", [[], ["replay"], ["kv-size"], ["simulate"], ["bench", "core"]])
def test_help_runs(cmd):
    proc = pagedkv(*cmd, "--help")
    assert proc.returncode == 0 and "usage: pagedkv" in proc.stdout
