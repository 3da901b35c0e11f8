"""Behind API keys each key caches apart (`pagedkv_base.api.tenants`): what
one key sent never shows in another key's cached tokens, neither in the
worker's `usage.prompt_tokens_details.cached_tokens` nor in the router's
`x-pagedkv-cached-tokens`, while one key's repeats hit its own cache, and
the router's match is the worker's. `PAGEDKV_WORKER_CACHE_SALT_PER_API_KEY=0` shares
the cache between keys again. Real processes (an allocator with generated
credentials, a worker, the router), driven by the official openai client."""

from __future__ import annotations

import pytest

from pagedkv.stack import LocalStack
from tests.support.http import openai_client

MODEL = "tiny-random"
BLOCK = 16
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
# Byte-level tokenizer: ~230 tokens, 14 whole blocks; a secret after a shared start.
PROMPT = "Support desk notes. " * 8 + "The caller's PIN is 4817 and the account is locked. "


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# two tenants\n{KEY_A}\n\n{KEY_B}\n")
    return path


@pytest.fixture(scope="module")
def stack(keys_file):
    args = ["--num-blocks", "256", "--block-size", str(BLOCK), "--api-keys-file", str(keys_file)]
    with LocalStack(
        workers=1,
        model=MODEL,
        worker_args=args,
        router=True,
        startup_timeout=180,
        router_args=["--api-keys-file", str(keys_file)],
    ) as s:
        yield s


def _cached(url: str, key: str, prompt: str, salt: str | None = None) -> tuple[int, int | None]:
    """(the usage's cached tokens, the router's x-pagedkv-cached-tokens or None at a worker)."""
    raw = openai_client(url, api_key=key).completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": salt} if salt is not None else None,
    )
    header = raw.headers.get("x-pagedkv-cached-tokens")
    return raw.parse().usage.prompt_tokens_details.cached_tokens, None if header is None else int(
        header
    )


def test_two_keys_do_not_share_cached_tokens_at_the_worker_and_one_key_does(stack):
    worker = stack.worker_urls[0]
    prompt = "worker " + PROMPT
    assert _cached(worker, KEY_A, prompt) == (0, None)
    own, _ = _cached(worker, KEY_A, prompt)
    # the key's own repeat: every whole block but the last
    assert own >= (len(prompt) // BLOCK - 1) * BLOCK
    assert _cached(worker, KEY_B, prompt) == (0, None)  # another key: nothing of A's shows
    # A request's own salt is combined with its key's, never a way into another key's cache.
    assert _cached(worker, KEY_B, prompt, salt="shared") == (0, None)
    assert _cached(worker, KEY_A, prompt, salt="shared") == (0, None)
    assert _cached(worker, KEY_A, prompt, salt="shared")[0] == own


def test_the_router_matches_under_the_salt_the_worker_caches_under(stack):
    router = stack.router_url
    prompt = "router " + PROMPT
    assert _cached(router, KEY_A, prompt) == (0, 0)
    for _ in range(50):  # the router's view hears of the blocks by the allocator's events
        usage, header = _cached(router, KEY_A, prompt)
        if header == usage:
            break
    assert header == usage >= (len(prompt) // BLOCK - 1) * BLOCK
    # Key B sees none of it, from the worker or from the router's match.
    assert _cached(router, KEY_B, prompt) == (0, 0)


def test_the_router_never_passes_a_clients_key_on(keys_file):
    """The worker sees the router's own key (its first) and the client's tenant id,
    never the client's key, nor a tenant header the client sent."""
    from pagedkv.bench.attackers import BadWorker
    from pagedkv.stack import RouterProcess
    from pagedkv_base.api.tenants import TENANT_HEADER, tenant_of

    with BadWorker("record") as worker:
        router = (
            RouterProcess(
                model=MODEL,
                args=[
                    "--workers",
                    worker.url,
                    "--api-keys-file",
                    str(keys_file),
                    "--log-level",
                    "warning",
                ],
            )
            .start()
            .wait_healthy(120)
        )
        try:
            client = openai_client(router.url, api_key=KEY_B)
            # no: the router sets it
            client.completions.create(
                model=MODEL,
                prompt="hi",
                max_tokens=1,
                extra_headers={TENANT_HEADER: tenant_of(KEY_A)},
            )
            [head] = worker.heads
            assert head["authorization"] == f"Bearer {KEY_A}" and head[TENANT_HEADER] == tenant_of(
                KEY_B
            )
            assert not any(KEY_B in v for v in head.values())
        finally:
            router.terminate()


def test_through_the_router_a_key_caches_under_its_own_tenant(stack):
    """The router presents its own key, yet the worker caches a request under the
    client's tenant: what key B sent through the router is cached for key B's direct
    requests, and not for key A's (the key the router presents)."""
    worker, prompt = stack.worker_urls[0], "tenant " + PROMPT
    assert _cached(stack.router_url, KEY_B, prompt)[0] == 0
    assert _cached(worker, KEY_B, prompt)[0] >= (len(prompt) // BLOCK - 1) * BLOCK
    assert _cached(worker, KEY_A, prompt)[0] == 0


def test_one_key_still_shares_across_its_requests_and_the_setting_turns_salts_off(
    worker_process, keys_file
):
    with worker_process(
        "--model",
        MODEL,
        "--num-blocks",
        "128",
        "--block-size",
        str(BLOCK),
        "--api-keys-file",
        str(keys_file),
        env={"PAGEDKV_WORKER_CACHE_SALT_PER_API_KEY": "0"},
    ) as url:
        assert _cached(url, KEY_A, PROMPT) == (0, None)
        shared, _ = _cached(url, KEY_B, PROMPT)
        # one namespace for every key, as without keys
        assert shared >= (len(PROMPT) // BLOCK - 1) * BLOCK
