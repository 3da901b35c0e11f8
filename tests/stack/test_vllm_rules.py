"""deploy/prometheus/vllm-recording-rules.yml: a vLLM Grafana dashboard works
unchanged on PagedKV workers.

`promtool check rules` parses the file; `promtool test rules` runs it over the
series a real engine exported after serving requests, and every `vllm:`
series that vLLM's own dashboard queries (filtered on `model_name`, the
served name) comes out with the worker's values.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.metrics import METRIC_NAMES
from worker.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "vllm-recording-rules.yml"
SERVED = "tiny-chat"

# Every series vLLM's Grafana dashboard (examples/observability/prometheus_grafana/
# grafana.json) queries, and the worker series (with a label filter) it must equal.
DASHBOARD = {
    "vllm:e2e_request_latency_seconds_count": (
        "pagedkv_worker_e2e_request_latency_seconds_count",
        {},
    ),
    "vllm:e2e_request_latency_seconds_bucket": (
        "pagedkv_worker_e2e_request_latency_seconds_bucket",
        {},
    ),
    "vllm:prompt_tokens_total": ("pagedkv_worker_prompt_tokens_total", {}),
    "vllm:generation_tokens_total": ("pagedkv_worker_generation_tokens_total", {}),
    "vllm:inter_token_latency_seconds_count": (
        "pagedkv_worker_inter_token_latency_seconds_count",
        {},
    ),
    "vllm:num_requests_running": ("pagedkv_worker_running_sequences", {}),
    "vllm:num_requests_waiting": ("pagedkv_worker_waiting_sequences", {}),
    "vllm:time_to_first_token_seconds_count": (
        "pagedkv_worker_time_to_first_token_seconds_count",
        {},
    ),
    "vllm:time_to_first_token_seconds_bucket": (
        "pagedkv_worker_time_to_first_token_seconds_bucket",
        {},
    ),
    "vllm:kv_cache_usage_perc": ("pagedkv_worker_kv_usage_ratio", {}),
    "vllm:request_prompt_tokens_sum": ("pagedkv_worker_request_prompt_tokens_sum", {}),
    "vllm:request_prompt_tokens_bucket": ("pagedkv_worker_request_prompt_tokens_bucket", {}),
    "vllm:request_generation_tokens_sum": ("pagedkv_worker_request_generation_tokens_sum", {}),
    "vllm:request_success_total": ("pagedkv_worker_requests_total", {"finish_reason": "length"}),
    "vllm:request_queue_time_seconds_count": (
        "pagedkv_worker_request_queue_time_seconds_count",
        {},
    ),
    "vllm:request_prefill_time_seconds_count": (
        "pagedkv_worker_request_prefill_time_seconds_count",
        {},
    ),
    "vllm:request_decode_time_seconds_count": (
        "pagedkv_worker_request_decode_time_seconds_count",
        {},
    ),
    "vllm:request_max_num_generation_tokens_sum": (
        "pagedkv_worker_request_generation_tokens_sum",
        {},
    ),
    "vllm:num_preemptions_total": ("pagedkv_worker_preemptions_total", {}),
}


def need_promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "skipped: no `promtool` on PATH (Debian package `prometheus`; .ci/run installs it)"
        )
    return path


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_rules_pass_promtool_check():
    proc = subprocess.run(
        [need_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rules_name_only_exported_series_and_cover_the_dashboard():
    exported = set(METRIC_NAMES)
    recorded = {r["record"] for r in _rules()}
    for rule in _rules():
        for name in re.findall(r"pagedkv_worker_[a-z0-9_]+", rule["expr"]):
            assert re.sub(r"_(bucket|sum|count)$", "", name) in exported, (rule["record"], name)
    assert set(DASHBOARD) <= recorded
    assert all(r.startswith("vllm:") for r in recorded)


def _scrape() -> tuple[str, list]:
    """The /metrics text of an engine that served requests (one finished by length, one by stop)."""
    config = EngineConfig(
        model="tiny-random", served_model_name=SERVED, num_blocks=64, block_size=4, worker_id="w-1"
    )
    engine = LLMEngine(load_model("tiny-random"), config)
    engine.generate(
        ["hello paged world", "a second prompt"],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )
    text = generate_latest(engine.metrics.registry).decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return text, samples


def _series(name: str, labels: dict) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def test_a_vllm_dashboard_reads_the_workers_values(tmp_path):
    exe = need_promtool()
    _, samples = _scrape()
    ours = [
        s
        for s in samples
        if s.name.startswith("pagedkv_worker_") and not s.name.endswith("_created")
    ]
    assert {s.labels["model_name"] for s in ours} == {SERVED}
    inputs = [{"series": _series(s.name, s.labels), "values": f"{s.value!r}+0x10"} for s in ours]
    tests = []
    for vllm_name, (source, match) in DASHBOARD.items():
        want = sum(
            s.value
            for s in ours
            if s.name == source and all(s.labels.get(k) == v for k, v in match.items())
        )
        # the dashboard's own filter; sum() so a histogram's buckets add up too
        tests.append(
            {
                "expr": f'sum({vllm_name}{{model_name="{SERVED}"}})',
                "eval_time": "5m",
                "exp_samples": [{"labels": "{}", "value": want}],
            }
        )
    spec = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": tests}],
    }
    path = tmp_path / "vllm-rules-test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = subprocess.run(
        [exe, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the values were not all zero: requests were served and counted
    assert (
        next(t for t in tests if "generation_tokens_total" in t["expr"])["exp_samples"][0]["value"]
        == 12
    )
