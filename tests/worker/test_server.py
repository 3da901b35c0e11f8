"""The worker's OpenAI-style API, as a real process, through the official
`openai` client (and raw HTTP for what the client cannot send)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.http import metric
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model

SYSTEM = "You are a helpful assistant that answers briefly. " * 3


@pytest.fixture(scope="module")
def server(worker_process):
    with worker_process("--model", "tiny-random", "--num-blocks", "256", "--block-size", "4",
                        "--enable-prefix-caching", "--max-model-len", "512") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-random"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_completion_equals_offline_engine(client):
    r = client.completions.create(model="tiny-random", prompt="hello paged world", max_tokens=10,
                                  temperature=0, extra_body={"ignore_eos": True})
    engine = LLMEngine(load_model("tiny-random"), EngineConfig(num_blocks=256, block_size=4))
    offline = engine.generate(["hello paged world"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].text == offline.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_streamed_equals_non_streamed(client):
    kw = dict(model="tiny-random", prompt="stream me", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_token_id_prompt(client):
    r = client.completions.create(model="tiny-random", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4


def test_chat_and_cached_tokens(client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    r1 = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=6, temperature=0)
    assert r1.choices[0].message.role == "assistant"
    msgs2 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "another question"}]
    r2 = client.chat.completions.create(model="tiny-random", messages=msgs2, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= 40  # the shared system prompt
    stream = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=6, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r1.choices[0].message.content


def test_cache_salt_isolates(client):
    msgs = [{"role": "system", "content": SYSTEM + " salted"}, {"role": "user", "content": "q"}]
    client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    other = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=2, extra_body={"cache_salt": "tenant-b"})
    same = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "kwargs,status,needle",
    [
        ({"model": "nope"}, 404, "does not exist"),
        ({"max_tokens": -1}, 400, "max_tokens"),
        ({"max_tokens": 10**6}, 400, "exceeds"),
        ({"prompt": "word " * 2000}, 400, "context"),
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 2}, 400, "n=1"),
        # the allocator's salt rule, answered before the request is queued
        ({"extra_body": {"cache_salt": ""}}, 400, "cache_salt"),
        ({"extra_body": {"cache_salt": "s" * 1025}}, 400, "cache_salt"),
    ],
)
def test_bad_requests_get_openai_errors(client, kwargs, status, needle):
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**body)
    assert exc.value.status_code == status
    assert needle in exc.value.body["message"]


def test_malformed_bodies(server):
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny-random"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny-random", "messages": "hi"})
    assert r.status_code == 400
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_the_sequence(server):
    labels = {"model": "tiny-random"}
    body = {"model": "tiny-random", "prompt": "a long one", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server, "pagedkv_worker_kv_blocks_used", labels) == 0 and \
                metric(server, "pagedkv_worker_running_sequences", labels) == 0:
            break
        time.sleep(0.2)
    assert metric(server, "pagedkv_worker_kv_blocks_used", labels) == 0
    assert metric(server, "pagedkv_worker_requests_total", {**labels, "finish_reason": "abort"}) >= 1


def test_metrics_exported(server):
    text = httpx.get(f"{server}/metrics").text
    for name in ("pagedkv_worker_kv_slot_utilisation_ratio", "pagedkv_worker_preemptions_total",
                 "pagedkv_worker_time_to_first_token_seconds_bucket", "pagedkv_worker_kv_pool_bytes"):
        assert name in text
