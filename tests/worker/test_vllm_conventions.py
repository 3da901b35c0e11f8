"""The server conventions a vLLM user relies on, on a real worker process
through the official `openai` client (raw HTTP where the client has no call):

- prefix caching on by default (`--no-enable-prefix-caching` turns it off);
- `--api-key`: every /v1/* route wants the bearer key (401 in OpenAI's error
  shape), and so do /tokenize and /detokenize; /health, /metrics, /version stay open;
- `/tokenize`, `/detokenize`, `/version` in vLLM's shapes; `/v1/models` with
  `root` and `max_model_len`;
- `/health` 503 once the engine thread is dead, and requests a prompt 503;
- the `model_name` label (the served name) on every worker series, and the
  per-request histograms vLLM users chart, read back from /metrics;
- the high-water marks (`*_peak`) and `POST /reset_peaks`.
"""

from __future__ import annotations

import argparse
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedkv_base.settings import cpu_count, parse_threads
from worker.cli import add_arguments
from worker.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from worker.model.loader import load_model
from worker.server.app import create_app

KEY = "sk-test-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
SERVED = "tiny-chat"
SYSTEM = "You are a helpful assistant that answers briefly. " * 3


@pytest.fixture(scope="module")
def server(worker_process):
    # no --enable-prefix-caching: on by default
    with worker_process(
        "--model",
        "tiny-random",
        "--served-model-name",
        SERVED,
        "--api-key",
        KEY,
        "--num-blocks",
        "256",
        "--block-size",
        "4",
        "--max-model-len",
        "512",
        "--threads",
        "1",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _samples(url: str) -> list:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(url: str, name: str, **labels) -> float:
    return sum(
        s.value
        for s in _samples(url)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


# ------------------------------------------------------------------ flags


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_prefix_caching_flag_defaults_on_and_turns_off(monkeypatch):
    monkeypatch.delenv("PAGEDKV_WORKER_ENABLE_PREFIX_CACHING", raising=False)
    assert _parse().enable_prefix_caching is True
    assert _parse("--enable-prefix-caching").enable_prefix_caching is True
    assert _parse("--no-enable-prefix-caching").enable_prefix_caching is False
    monkeypatch.setenv("PAGEDKV_WORKER_ENABLE_PREFIX_CACHING", "false")
    assert _parse().enable_prefix_caching is False
    # a flag wins over its variable
    assert _parse("--enable-prefix-caching").enable_prefix_caching is True
    monkeypatch.setenv("PAGEDKV_WORKER_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(SystemExit):
        _parse()


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDKV_WORKER_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _parse().api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _parse().api_key == "from-vllm"
    monkeypatch.setenv("PAGEDKV_WORKER_API_KEY", "from-pagedkv")
    assert _parse().api_key == "from-pagedkv"
    assert _parse("--api-key", "flag").api_key == "flag"


def test_threads_flag_env_and_share(monkeypatch):
    monkeypatch.delenv("PAGEDKV_WORKER_THREADS", raising=False)
    assert _parse().threads is None  # torch's own default
    assert _parse("--threads", "3").threads == 3
    assert _parse("--threads", "1/1").threads == cpu_count()
    assert _parse("--threads", "1/1000").threads == 1  # a share never rounds down to none
    assert parse_threads("1/2", cores=8) == 4 and parse_threads("2/3", cores=8) == 5
    monkeypatch.setenv("PAGEDKV_WORKER_THREADS", "2")
    assert _parse().threads == 2
    assert _parse("--threads", "1").threads == 1  # a flag wins over its variable
    for bad in ("0", "-1", "two", "3/2", "0/4", "1/0"):
        with pytest.raises(SystemExit):
            _parse("--threads", bad)


def test_worker_computes_with_the_threads_it_was_given(server):
    # `--threads 1` on a machine whose torch would take every core; read back from /metrics
    assert _value(server, "pagedkv_worker_threads") == 1


def test_prefix_caching_is_on_without_the_flag(client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=2, temperature=0)
    msgs[1]["content"] = "another question"
    r = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 40  # the shared system prompt


# ------------------------------------------------------------------ API key


def test_api_key_guards_every_v1_route(server, client):
    anonymous = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    for call in (
        lambda c: c.models.list(),
        lambda c: c.completions.create(model=SERVED, prompt="hi", max_tokens=2),
        lambda c: c.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ),
    ):
        with pytest.raises(openai.AuthenticationError) as exc:
            call(anonymous)
        assert exc.value.status_code == 401
        assert (
            exc.value.body["code"] == "invalid_api_key" and "API key" in exc.value.body["message"]
        )
        call(client)  # the right key passes
    # no header at all
    r = httpx.post(f"{server}/v1/completions", json={"model": SERVED, "prompt": "hi"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # unknown /v1 routes too: nothing leaks
    assert httpx.get(f"{server}/v1/nothing").status_code == 401
    # open, as in vLLM
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server}{path}").status_code == 200, path
    # the tokenizer routes want the key (a long text costs seconds of CPU), unlike vLLM
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [104, 105]})):
        assert httpx.post(f"{server}{path}", json=body).status_code == 401, path
        assert httpx.post(f"{server}{path}", json=body, headers=AUTH).status_code == 200, path


# ------------------------------------------------------------------ utility routes


def test_tokenize_and_detokenize_in_vllm_shapes(server, client):
    text = "hello paged world"
    r = httpx.post(
        f"{server}/tokenize",
        headers=AUTH,
        json={
            "model": SERVED,
            "prompt": text,
            "add_special_tokens": False,
            "return_token_strs": True,
        },
    ).json()
    assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    back = httpx.post(
        f"{server}/detokenize", headers=AUTH, json={"model": SERVED, "tokens": r["tokens"]}
    ).json()
    assert back == {"prompt": text}
    # the counts the completions answer with
    completion = client.completions.create(model=SERVED, prompt=text, max_tokens=1)
    plain = httpx.post(f"{server}/tokenize", headers=AUTH, json={"prompt": text}).json()
    assert plain["count"] == completion.usage.prompt_tokens and plain["token_strs"] is None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=1)
    tokenized = httpx.post(f"{server}/tokenize", headers=AUTH, json={"messages": msgs}).json()
    assert tokenized["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, None),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "y"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_utility_routes_refuse_loudly(server, path, body, status, param):
    r = httpx.post(f"{server}{path}", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_version_and_model_card(server, client):
    from importlib.metadata import version

    assert httpx.get(f"{server}/version").json() == {"version": version("pagedkv")}
    [card] = client.models.list().data
    assert card.id == SERVED and card.owned_by == "pagedkv"
    assert card.model_extra["root"] == "tiny-random"  # what was loaded; the id is the served name
    assert card.model_extra["max_model_len"] == 512
    assert card.model_extra["permission"][0]["object"] == "model_permission"


# ------------------------------------------------------------------ metrics


def test_every_worker_series_carries_model_name(server, client):
    client.completions.create(model=SERVED, prompt="label me", max_tokens=2)
    ours = [s for s in _samples(server) if s.name.startswith("pagedkv_worker_")]
    assert len({s.name for s in ours}) > 20
    assert {s.labels.get("model_name") for s in ours} == {SERVED}
    assert {s.labels.get("model") for s in ours} == {"tiny-random"}


def test_request_histograms_count_what_the_client_saw(server, client):
    hist = "pagedkv_worker_request_{}"
    before = {
        n: _value(server, n, model_name=SERVED)
        for n in (
            hist.format("prompt_tokens_sum"),
            hist.format("generation_tokens_sum"),
            hist.format("generation_tokens_count"),
            "pagedkv_worker_e2e_request_latency_seconds_count",
            "pagedkv_worker_request_queue_time_seconds_count",
            "pagedkv_worker_requests_total",
        )
    }
    t0 = time.monotonic()
    prompts = []
    for i, n in enumerate((3, 5, 7)):
        r = client.completions.create(
            model=SERVED,
            prompt=f"request {i} " * (i + 1),
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == n
        prompts.append(r.usage.prompt_tokens)
    wall = time.monotonic() - t0

    def grew(name: str, **labels) -> float:
        return _value(server, name, model_name=SERVED, **labels) - before.get(name, 0.0)

    assert grew(hist.format("generation_tokens_count")) == 3
    assert grew(hist.format("generation_tokens_sum")) == 3 + 5 + 7
    assert grew(hist.format("prompt_tokens_sum")) == sum(prompts)
    assert grew("pagedkv_worker_e2e_request_latency_seconds_count") == 3
    assert grew("pagedkv_worker_request_queue_time_seconds_count") == 3
    # the phases add up: queue + prefill + decode = e2e (within rounding), all within the wall time
    parts = [
        _value(server, f"pagedkv_worker_request_{p}_time_seconds_sum", model_name=SERVED)
        for p in ("queue", "prefill", "decode")
    ]
    e2e = _value(server, "pagedkv_worker_e2e_request_latency_seconds_sum", model_name=SERVED)
    assert abs(sum(parts) - e2e) < 1e-6 and 0 < e2e
    inference = _value(
        server, "pagedkv_worker_request_inference_time_seconds_sum", model_name=SERVED
    )
    assert abs(inference - parts[1] - parts[2]) < 1e-6
    assert (
        _value(server, "pagedkv_worker_requests_total", model_name=SERVED, finish_reason="length")
        >= 3
    )
    assert wall > 0


PEAKS = {
    "kv_blocks_used": "pagedkv_worker_kv_blocks_used_peak",
    "kv_slots_holding_tokens": "pagedkv_worker_kv_slots_holding_tokens_peak",
    "running_sequences": "pagedkv_worker_running_sequences_peak",
}


def test_peaks_outlast_the_run_and_reset(server, client):
    """The high-water marks are on /metrics after the run, with the pool empty
    again: no poll has to land on the right moment. POST /reset_peaks answers
    them and starts them again; like /metrics it wants no API key."""
    assert httpx.post(f"{server}/reset_peaks").status_code == 200
    client.completions.create(
        model=SERVED,
        prompt=[5, 6, 7],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    peaks = {key: _value(server, name) for key, name in PEAKS.items()}
    # one sequence; it held at least the 22 tokens it computed, in blocks of 4
    assert peaks["running_sequences"] == 1
    assert 3 + 20 - 1 <= peaks["kv_slots_holding_tokens"] <= 4 * peaks["kv_blocks_used"]
    assert httpx.post(f"{server}/reset_peaks").json() == peaks
    assert all(_value(server, name) == 0 for name in PEAKS.values())


# ------------------------------------------------------------------ a dead engine thread


def test_health_is_503_once_the_engine_thread_dies():
    engine = AsyncLLMEngine(
        LLMEngine(load_model("tiny-random"), EngineConfig(num_blocks=64, block_size=4))
    )
    body = {"model": "tiny-random", "prompt": "hello", "max_tokens": 3}
    try:
        with TestClient(create_app(engine, "tiny-random")) as http:
            assert http.get("/health").status_code == 200
            assert http.post("/v1/completions", json=body).status_code == 200

            def broken() -> bool:
                raise MemoryError("injected: the engine thread cannot go on")

            engine.engine.has_unfinished = broken  # the loop's next turn raises outside any step
            engine.abort("wake-up")
            deadline = time.monotonic() + 10
            while engine.dead() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["code"] == "engine_dead"
            assert "MemoryError" in health.json()["reason"]
            t0 = time.monotonic()
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert time.monotonic() - t0 < 5  # refused at once, not left waiting
            streamed = http.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 503
    finally:
        engine.shutdown()


def test_return_token_ids_gives_each_choice_its_ids(client):
    # vLLM's `return_token_ids`, on a model with a tokenizer: the ids decode to the choice's text
    kw = dict(
        model=SERVED,
        prompt="Hello there",
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = client.completions.create(**kw).choices[0].model_dump()
    assert len(choice["token_ids"]) == 6 and choice["prompt_token_ids"]
    streamed = [
        c.choices[0].model_dump() for c in client.completions.create(stream=True, **kw) if c.choices
    ]
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]
    assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    chat = client.chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert len(chat.choices[0].model_dump()["token_ids"]) == 4
    plain = (
        client.completions.create(model=SERVED, prompt="Hello there", max_tokens=2)
        .choices[0]
        .model_dump()
    )
    assert plain.get("token_ids") is None
