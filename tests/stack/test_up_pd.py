"""`pagedkv up --prefill-workers N --decode-workers M`: a prefill/decode fleet as local
processes, one completion through its router, and the flags' conflicts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai

from tests.stack.test_up import FREE_PORTS, _up
from tests.support.pd import split_story

PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest far away"


def _pagedkv_up(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", "up", *args, "--router-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **FREE_PORTS},
    )


def _story(tmp_path: Path, info: dict) -> str:
    """The router's split outcomes and the stack's logs, for a failed split check."""
    logs = {p.name: p.read_text() for p in sorted(Path(info["log_dir"]).glob("*.log"))}
    workers = {f"worker-{i}": url for i, url in enumerate(info["workers"], 1)}
    return split_story(info["router"], workers, {"up": (tmp_path / "up.log").read_text(), **logs})


def test_up_serves_a_completion_split_between_a_prefill_and_a_decode_worker(tmp_path):
    env = {
        "PAGEDKV_WORKER_BLOCK_SIZE": "4",
        "PAGEDKV_WORKER_MAX_MODEL_LEN": "128",
        # a busy machine may take seconds to confirm the blocks: the router waits for them
        # (past the timeout the decode worker computes them, an answer this test cannot tell)
        "PAGEDKV_ROUTER_PD_TRANSFER_TIMEOUT": "120",
    }
    with _up(
        tmp_path,
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--model",
        "tiny-random",
        "--num-blocks",
        "64",
        env=env,
    ) as (up, info):
        assert {"allocator", "worker-1", "worker-2", "router"} == set(info["pids"])
        key = Path(info["api_keys_file"]).read_text().strip()  # generated, as by default
        client = openai.OpenAI(
            base_url=f"{info['router']}/v1", api_key=key, max_retries=0, timeout=120
        )
        raw = client.completions.with_raw_response.create(
            model="tiny-random", prompt=PROMPT, max_tokens=8, temperature=0
        )
        done = raw.parse()
        # the prompt was computed by the prefill worker (worker-1), the answer by the decode
        # worker (worker-2), which loaded the prompt's blocks from the shared store
        assert raw.headers["x-pagedkv-prefill-worker"] == "worker-1"
        assert raw.headers["x-pagedkv-worker"] == "worker-2"
        assert done.usage.completion_tokens == 8 and done.choices[0].text
        cached = done.usage.prompt_tokens_details.cached_tokens
        assert cached >= (done.usage.prompt_tokens - 1) // 4 * 4 > 0, _story(tmp_path, info)
    out = (tmp_path / "up.log").read_text()
    assert "--kv-role prefill" in out and "--kv-role decode" in out  # the table names the roles


def test_workers_and_a_prefill_decode_fleet_are_one_or_the_other():
    both = _pagedkv_up("--workers", "2", "--prefill-workers", "1", "--decode-workers", "1")
    assert both.returncode == 2
    lines = (both.stdout + both.stderr).strip().splitlines()
    assert len(lines) == 1 and "--workers cannot be combined with --prefill-workers" in lines[0]
    half = _pagedkv_up("--prefill-workers", "1")
    assert half.returncode == 2
    assert "needs --prefill-workers and --decode-workers" in half.stdout + half.stderr
    sharded = _pagedkv_up("--prefill-workers", "1", "--decode-workers", "1", "--allocators", "2")
    assert sharded.returncode == 2
    assert "one allocator's shared store: --allocators must be 1" in sharded.stderr
