"""Simulated workers (`--device sim:h100`) in processes: the allocator service,
two workers of Llama-3-8B's config alone, the router, driven by the openai
client with token-id prompts."""

from __future__ import annotations

import concurrent.futures

import pytest

from pagedkv.stack import LocalStack
from tests.support.http import metric, openai_client
from worker.sim import write_config

PROMPTS = [list(range(10, 300)), [42] * 100, list(range(1000, 1600, 3))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_config("llama-3-8b", tmp_path_factory.mktemp("llama-3-8b")))


def start(model: str) -> LocalStack:
    args = ["--device", "sim:h100", "--enable-prefix-caching", "--max-num-seqs", "32"]
    return LocalStack(workers=2, model=model, worker_args=args, router=True)


def ask(url: str, model: str, prompt: list[int], stream: bool = False) -> list[int]:
    client = openai_client(url)
    kw = dict(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True}
    )
    if stream:
        return [
            t
            for c in client.completions.create(stream=True, **kw)
            for ch in c.choices
            for t in ch.model_dump().get("token_ids") or []
        ]
    choice = client.completions.create(**kw).choices[0]
    # no tokenizer: ids only, never an eos
    assert choice.text == "" and choice.finish_reason == "length"
    return choice.model_dump()["token_ids"]


def run_all(stack: LocalStack, model: str) -> dict:
    urls = [stack.router_url, *stack.worker_urls]
    jobs = [
        (url, i, stream) for url in urls for i in range(len(PROMPTS)) for stream in (False, True)
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda j: (j, ask(j[0], model, PROMPTS[j[1]], j[2])), jobs))
    return {job: ids for job, ids in answers}


def test_simulated_workers_serve_the_same_tokens_everywhere_and_every_run(model):
    with start(model) as stack:
        first = run_all(stack, model)
        for url in stack.worker_urls:
            labels = {"model": model}
            assert 0 < metric(url, "pagedkv_worker_device_busy_ratio", labels) <= 1
            for part in ("schedule", "allocator_wait", "sample", "output"):
                assert metric(url, "pagedkv_worker_step_host_seconds_count", {"part": part}) > 0
            assert (
                metric(url, "pagedkv_worker_generation_tokens_total")
                >= len(PROMPTS) * 2 * MAX_TOKENS
            )
    with start(model) as stack:
        again = run_all(stack, model)
    by_prompt: dict[int, set] = {}
    for (_url, i, _stream), ids in [*first.items(), *again.items()]:
        assert len(ids) == MAX_TOKENS
        by_prompt.setdefault(i, set()).add(tuple(ids))
    # one answer per prompt, whichever worker, router or run, streamed or not
    assert all(len(answers) == 1 for answers in by_prompt.values())
    assert len({a for answers in by_prompt.values() for a in answers}) == len(PROMPTS)
