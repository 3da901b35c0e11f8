"""The router with a static --workers list (no allocator: routing by load
alone) in front of a worker that wants an API key: the router checks the
key as a worker does and presents its own (the same key here), so the
worker's own check passes; /v1/models is the worker's card."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedkv.stack import RouterProcess

KEY = "sk-router-test"


@pytest.fixture(scope="module")
def routed(worker_process):
    with worker_process("--model", "tiny-random", "--num-blocks", "64", "--api-key", KEY) as worker:
        router = RouterProcess(
            model="tiny-random",
            args=["--workers", f"{worker}/", "--api-key", KEY, "--log-level", "warning"],
        )
        try:
            yield router.start().wait_healthy(120).url, worker
        finally:
            router.terminate()


def test_the_api_key_is_checked_and_forwarded(routed):
    url, worker = routed
    assert httpx.get(f"{url}/health").json() == {
        "status": "ok",
        "workers": 1,
        "allocator": "ok",
        "policy": "kv",
    }
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=f"{worker}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert good.models.list().model_dump()["data"][0]["id"] == "tiny-random"
    assert [m.id for m in good.models.list().data] == [m.id for m in direct.models.list().data]
    raw = good.completions.with_raw_response.create(
        model="tiny-random", prompt="Hello", max_tokens=5, temperature=0
    )
    assert (
        raw.parse().choices[0].text
        == direct.completions.create(
            model="tiny-random", prompt="Hello", max_tokens=5, temperature=0
        )
        .choices[0]
        .text
    )
    assert (
        raw.headers["x-pagedkv-worker"] == worker and raw.headers["x-pagedkv-cached-tokens"] == "0"
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_nested_too_deep_is_an_openai_400(routed, path):
    url, _ = routed
    deep = b'{"model": "tiny-random", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(
        f"{url}{path}",
        content=deep,
        timeout=60,
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and error["type"] == "invalid_request_error"
    )
    assert "nested too deeply" in error["message"]
    assert httpx.get(f"{url}/health").status_code == 200
