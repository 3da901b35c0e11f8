"""A worker with `--kv-cache-dtype fp8`, as a real process, through the `openai`
client: it answers as a worker with `auto` does (usage, cached tokens), its
prefix-cache hits reuse fp8 blocks, and bad input is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

SYSTEM = "You are a helpful assistant that answers briefly. " * 3
ARGS = (
    "--model",
    "tiny-random",
    "--num-blocks",
    "256",
    "--block-size",
    "4",
    "--enable-prefix-caching",
    "--max-model-len",
    "512",
)


@pytest.fixture(scope="module")
def servers(worker_process):
    with worker_process(*ARGS) as auto, worker_process(*ARGS, "--kv-cache-dtype", "fp8") as fp8:
        yield {"auto": auto, "fp8": fp8}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def usages(url: str) -> list[tuple[int, int, int]]:
    """(prompt, completion, cached) tokens of a fixed run: two
    chats sharing a system prompt, a completion."""
    c, out = client(url), []
    for question in ("first question", "another question"):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        r = c.chat.completions.create(
            model="tiny-random",
            messages=msgs,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        out.append(
            (
                r.usage.prompt_tokens,
                r.usage.completion_tokens,
                r.usage.prompt_tokens_details.cached_tokens,
            )
        )
    r = c.completions.create(
        model="tiny-random",
        prompt="hello paged world",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    out.append(
        (
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            r.usage.prompt_tokens_details.cached_tokens,
        )
    )
    return out


def test_fp8_usage_and_cached_tokens_are_those_of_auto(servers):
    fp8 = usages(servers["fp8"])
    assert fp8 == usages(servers["auto"])
    assert fp8[1][2] >= 40  # the shared system prompt came from the prefix cache
    assert fp8[2][1] == 10


def test_a_prefix_hit_reuses_the_fp8_blocks(servers):
    c = client(servers["fp8"])
    msgs = [{"role": "system", "content": SYSTEM + " hit"}, {"role": "user", "content": "q"}]

    def ask(salt: str):
        return c.chat.completions.create(
            model="tiny-random",
            messages=msgs,
            max_tokens=8,
            temperature=0,
            extra_body={"cache_salt": salt, "ignore_eos": True},
        )

    cold, hit, other = ask("a"), ask("a"), ask("b")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens >= 40
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # read back from fp8 blocks with their (fixed) scales,
    # the prefix gives the tokens computing it gave
    assert (
        hit.choices[0].message.content
        == cold.choices[0].message.content
        == other.choices[0].message.content
    )


def test_the_pool_and_metrics_say_fp8(servers):
    text = httpx.get(f"{servers['fp8']}/metrics").text
    assert 'kv_cache_dtype="float8_e4m3fn"' in text
    assert 'kv_cache_dtype="float32"' in httpx.get(f"{servers['auto']}/metrics").text
    # same blocks (--num-blocks), a quarter of float32's bytes
    pool_bytes = {
        name: next(
            float(line.split()[-1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("pagedkv_worker_kv_pool_bytes{")
        )
        for name, url in servers.items()
    }
    assert pool_bytes["auto"] == 4 * pool_bytes["fp8"]


@pytest.mark.parametrize(
    "args,env",
    [
        (["--kv-cache-dtype", "fp9"], {}),
        ([], {"PAGEDKV_WORKER_KV_CACHE_DTYPE": "int8"}),
    ],
)
def test_an_unknown_kv_cache_dtype_is_one_line_and_exit_2(args, env):
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "--model", "tiny-random", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.count("\n") == 1
        and "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2" in proc.stderr
    )
