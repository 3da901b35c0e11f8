"""Each API key's share of the sequences in flight through the router
(`router/shares.py`): one client streaming as much as it may cannot keep
another client's short request waiting behind its streams. Real processes
(an allocator, a worker whose batch holds 8 sequences, the router with two
keys and a share of 4), driven by the official openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pagedkv.stack import LocalStack
from tests.support.drills import wait_for
from tests.support.http import metric, openai_client

MODEL = "tiny-random"
KEY_A, KEY_B = "sk-flooding-tenant-0123456789", "sk-quiet-tenant-9876543210"
SHARE, STREAMS, LONG = 4, 8, 1500


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    worker = ["--num-blocks", "1024", "--block-size", "16", "--max-num-seqs", str(STREAMS)]
    with LocalStack(
        workers=1,
        model=MODEL,
        worker_args=[*worker, "--api-keys-file", str(keys)],
        router=True,
        router_args=["--api-keys-file", str(keys), "--max-sequences-per-key", str(SHARE)],
        env={"PAGEDKV_WORKER_MAX_MODEL_LEN": "2048"},
        startup_timeout=180,
    ) as s:
        yield s


def _stream(url: str, i: int, running: list[int], ended: list[int]) -> int | str:
    """A long stream under KEY_A: its status, or the refusal's code and Retry-After."""
    client = openai_client(url, api_key=KEY_A)
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Stream {i} goes on and on:",
            max_tokens=LONG,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    except openai.RateLimitError as exc:
        return f"{exc.status_code} {exc.code} retry-after={exc.response.headers['retry-after']}"
    for _ in stream:
        if i not in running:
            running.append(i)  # generating
    ended.append(i)
    return 200


def test_a_flooding_key_gets_its_share_and_another_keys_short_request_is_served(stack):
    router = stack.router_url
    running: list[int] = []
    ended: list[int] = []
    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(_stream, router, i, running, ended) for i in range(STREAMS)]
        wait_for(lambda: len(running) >= SHARE, 120, "the flooding key's streams to generate")
        # The quiet key's 4 tokens, while the flooding key's streams run.
        answer = openai_client(router, api_key=KEY_B).completions.create(
            model=MODEL, prompt="A short question", max_tokens=4, temperature=0
        )
        ended_before_b = list(ended)
        outcomes = [s.result(timeout=600) for s in streams]
    assert answer.usage.completion_tokens == 4
    assert ended_before_b == []  # served beside the streams, not after one of them
    refused = "429 rate_limit_exceeded retry-after=1"
    assert sorted(outcomes, key=str) == [200] * SHARE + [refused] * (STREAMS - SHARE)
    assert metric(router, "pagedkv_router_failed_requests_total", {"reason": "key_share"}) == 4
    # Every stream ended: the key's share is whole again, a request as wide as it is let in.
    again = openai_client(router, api_key=KEY_A).completions.create(
        model=MODEL, prompt=["a", "b"], n=2, max_tokens=2, temperature=0
    )
    assert len(again.choices) == SHARE
