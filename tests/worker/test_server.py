"""The worker's OpenAI-style API, as a real process, through the official
`openai` client (and raw HTTP for what the client cannot send)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.http import metric
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model

SYSTEM = "You are a helpful assistant that answers briefly. " * 3


@pytest.fixture(scope="module")
def server(worker_process):
    with worker_process(
        "--model",
        "tiny-random",
        "--num-blocks",
        "256",
        "--block-size",
        "4",
        "--enable-prefix-caching",
        "--max-model-len",
        "512",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-random"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_completion_equals_offline_engine(client):
    r = client.completions.create(
        model="tiny-random",
        prompt="hello paged world",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    engine = LLMEngine(load_model("tiny-random"), EngineConfig(num_blocks=256, block_size=4))
    offline = engine.generate(
        ["hello paged world"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )[0]
    assert r.choices[0].text == offline.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_streamed_equals_non_streamed(client):
    kw = dict(
        model="tiny-random",
        prompt="stream me",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_token_id_prompt(client):
    r = client.completions.create(
        model="tiny-random",
        prompt=[5, 6, 7, 8],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4


def test_chat_and_cached_tokens(client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    r1 = client.chat.completions.create(
        model="tiny-random", messages=msgs, max_tokens=6, temperature=0
    )
    assert r1.choices[0].message.role == "assistant"
    msgs2 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "another question"}]
    r2 = client.chat.completions.create(
        model="tiny-random", messages=msgs2, max_tokens=6, temperature=0
    )
    assert r2.usage.prompt_tokens_details.cached_tokens >= 40  # the shared system prompt
    stream = client.chat.completions.create(
        model="tiny-random", messages=msgs, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r1.choices[0].message.content


def test_cache_salt_isolates(client):
    msgs = [{"role": "system", "content": SYSTEM + " salted"}, {"role": "user", "content": "q"}]
    client.chat.completions.create(
        model="tiny-random", messages=msgs, max_tokens=2, extra_body={"cache_salt": "tenant-a"}
    )
    other = client.chat.completions.create(
        model="tiny-random", messages=msgs, max_tokens=2, extra_body={"cache_salt": "tenant-b"}
    )
    same = client.chat.completions.create(
        model="tiny-random", messages=msgs, max_tokens=2, extra_body={"cache_salt": "tenant-a"}
    )
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
        ({"n": 0}, 400, "n must be"),
        ({"best_of": 3}, 400, "best_of"),
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
    r = httpx.post(
        f"{server}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny-random"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny-random", "messages": "hi"})
    assert r.status_code == 400
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_health_answers_while_a_multi_megabyte_tokenize_is_answered(server):
    """Millions of ids and their strings are built and serialized off the
    event loop: /health keeps answering (on the loop that took ~10 s here)."""
    text = "hello paged world, " * ((3 << 20) // 19)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(
            httpx.post,
            f"{server}/tokenize",
            json={"prompt": text, "return_token_strs": True},
            timeout=600,
        )
        waits = []
        while not big.done():
            t0 = time.perf_counter()
            assert httpx.get(f"{server}/health", timeout=600).status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.05)
        answer = big.result()
    assert answer.status_code == 200
    body = answer.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 3_000_000 // 4
    assert len(waits) > 5 and max(waits) < 3.0, max(waits)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/completions"])
def test_every_route_refuses_a_body_over_the_limit(server, path):
    r = httpx.post(
        f"{server}{path}",
        content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


DEEP = b'{"model": "tiny-random", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
)
def test_json_nested_too_deep_is_an_openai_400(server, path):
    r = httpx.post(
        f"{server}{path}", content=DEEP, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and error["type"] == "invalid_request_error"
    )
    assert "nested too deeply" in error["message"]
    assert httpx.get(f"{server}/health").status_code == 200


def test_disconnect_mid_stream_frees_the_sequence(server):
    labels = {"model": "tiny-random"}
    body = {
        "model": "tiny-random",
        "prompt": "a long one",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            metric(server, "pagedkv_worker_kv_blocks_used", labels) == 0
            and metric(server, "pagedkv_worker_running_sequences", labels) == 0
        ):
            break
        time.sleep(0.2)
    assert metric(server, "pagedkv_worker_kv_blocks_used", labels) == 0
    assert (
        metric(server, "pagedkv_worker_requests_total", {**labels, "finish_reason": "abort"}) >= 1
    )


def test_metrics_exported(server):
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "pagedkv_worker_kv_slot_utilisation_ratio",
        "pagedkv_worker_preemptions_total",
        "pagedkv_worker_time_to_first_token_seconds_bucket",
        "pagedkv_worker_kv_pool_bytes",
    ):
        assert name in text


# -- issue 13: vLLM's sampling API through the official client -----------------------------

GREEDY = dict(model="tiny-random", temperature=0, extra_body={"ignore_eos": True})


def test_n_samples_completions_and_chat(client):
    one = client.completions.create(prompt="fork me", max_tokens=6, **GREEDY).choices[0].text
    r = client.completions.create(prompt="fork me", max_tokens=6, n=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.text for c in r.choices} == {one}
    # the prompt counted once
    assert (
        r.usage.completion_tokens == 18
        and r.usage.prompt_tokens
        == client.completions.create(prompt="fork me", max_tokens=1, **GREEDY).usage.prompt_tokens
    )
    seeded = dict(model="tiny-random", prompt="fork me", max_tokens=8, n=4, temperature=1.0, seed=7)
    a = [c.text for c in client.completions.create(**seeded).choices]
    assert a == [c.text for c in client.completions.create(**seeded).choices] and len(set(a)) > 1
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(messages=msgs, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_n_samples_stream_with_index(client):
    kw = dict(prompt="stream forks", max_tokens=5, n=2, **GREEDY)
    whole = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {c.index: c.text for c in whole.choices}
    msgs = [{"role": "user", "content": "hello"}]
    parts: dict[int, str] = {}
    for c in client.chat.completions.create(
        messages=msgs, max_tokens=4, n=2, stream=True, **GREEDY
    ):
        for ch in c.choices:
            parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(parts) == [0, 1] and parts[0] == parts[1]


def test_batched_prompts_each_get_their_choices(client):
    prompts = ["first prompt", "second one", "third"]
    singles = [
        client.completions.create(prompt=p, max_tokens=4, **GREEDY).choices[0].text for p in prompts
    ]
    r = client.completions.create(prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    # index = prompt * n + sample
    assert [c.text for c in r.choices] == [s for s in singles for _ in range(2)]
    singles.append(
        client.completions.create(prompt=[5, 6, 7], max_tokens=3, **GREEDY).choices[0].text
    )
    streamed: dict[int, str] = {}
    for c in client.completions.create(
        prompt=[[5, 6, 7], [8, 9]], max_tokens=3, stream=True, **GREEDY
    ):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert sorted(streamed) == [0, 1] and streamed[0] == singles[3]


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(prompt="log me", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # the top 3 and the chosen token (tiny-random's byte tokens may share a spelling)
        # greedy
        assert value <= 0 and 1 <= len(top) <= 4 and top[tok] == value == max(top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    echo = client.completions.create(prompt="echo me", max_tokens=3, echo=True, **GREEDY)
    plain = client.completions.create(prompt="echo me", max_tokens=3, **GREEDY)
    assert echo.choices[0].text == "echo me" + plain.choices[0].text


def test_echo_with_logprobs_covers_the_prompt(client):
    """vLLM's echo + logprobs: the prompt's tokens first (the first one's
    logprob null), then the completion's; `text_offset` runs across both; the
    choice carries vLLM's `prompt_logprobs` too, equal to the offline engine's.
    Asked twice with prefix caching on, the second is computed again (no
    cached tokens) and answers the same."""
    prompt = [5, 17, 3, 44, 9, 60, 23, 71, 12, 30]
    plain = client.completions.create(prompt=prompt, max_tokens=4, logprobs=2, **GREEDY).choices[0]
    offline = LLMEngine(
        load_model("tiny-random"), EngineConfig(num_blocks=64, block_size=4)
    ).generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    )[0]
    for _ in range(2):  # the plain request cached this prompt: each is computed again
        r = client.completions.create(prompt=prompt, max_tokens=4, echo=True, logprobs=2, **GREEDY)
        choice, n = r.choices[0], len(prompt) + 4
        lp = choice.logprobs
        assert (
            len(lp.tokens)
            == len(lp.token_logprobs)
            == len(lp.top_logprobs)
            == len(lp.text_offset)
            == n
        )
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[len(prompt) :] == plain.logprobs.tokens
        assert lp.token_logprobs[len(prompt) :] == pytest.approx(
            plain.logprobs.token_logprobs, abs=1e-5
        )
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
        assert choice.text == "".join(lp.tokens[: len(prompt)]) + plain.text
        for pos in range(1, len(prompt)):
            ref = offline.prompt_logprobs[pos]
            assert lp.token_logprobs[pos] == pytest.approx(ref.logprob, abs=1e-5)
            assert (
                1 <= len(lp.top_logprobs[pos]) <= 3
                and lp.top_logprobs[pos][lp.tokens[pos]] == lp.token_logprobs[pos]
            )
        # vLLM's prompt_logprobs: null, then token id -> {logprob, rank, decoded_token}
        plp = choice.model_extra["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            ref = offline.prompt_logprobs[pos]
            entry = plp[pos][str(prompt[pos])]
            assert (
                entry["logprob"] == pytest.approx(ref.logprob, abs=1e-5)
                and entry["rank"] == ref.rank
            )
            assert entry["decoded_token"] == lp.tokens[pos]
            assert [int(t) for t in plp[pos] if int(t) != prompt[pos]] == [
                t for t, _ in ref.top if t != prompt[pos]
            ]
        # never served from the prefix cache
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    # streamed: the first chunk carries the prompt's logprobs, the offsets go on
    tokens, offsets, values = [], [], []
    for c in client.completions.create(
        prompt=prompt, max_tokens=4, echo=True, logprobs=2, stream=True, **GREEDY
    ):
        for ch in c.choices:
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
                values += ch.logprobs.token_logprobs
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_prompt_logprobs_field(client, server):
    """vLLM's `prompt_logprobs` extra field: on each completion choice (with n
    samples, the same on each), on the chat response; refused when streaming."""
    r = client.completions.create(
        prompt="score this prompt",
        max_tokens=2,
        n=2,
        model="tiny-random",
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    assert [c.logprobs for c in r.choices] == [None, None]
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert (
        plp[0] is None
        and len(plp) == r.usage.prompt_tokens
        and plp == r.choices[1].model_extra["prompt_logprobs"]
    )
    assert all(
        1 <= len(d) <= 2 and all(set(v) == {"logprob", "rank", "decoded_token"} for v in d.values())
        for d in plp[1:]
    )
    assert (
        client.completions.create(prompt="x", max_tokens=1, **GREEDY)
        .choices[0]
        .model_extra["prompt_logprobs"]
        is None
    )
    msgs = [{"role": "user", "content": "score me"}]
    chat = client.chat.completions.create(
        messages=msgs,
        max_tokens=2,
        model="tiny-random",
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert (
        plp[0] is None
        and len(plp) == chat.usage.prompt_tokens
        and all(len(d) == 1 for d in plp[1:])
    )
    body = {
        "model": "tiny-random",
        "prompt": "x",
        "max_tokens": 1,
        "stream": True,
        "prompt_logprobs": 1,
    }
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    for bad in (-1, 21, "x"):
        r = httpx.post(
            f"{server}/v1/completions", json={**body, "stream": False, "prompt_logprobs": bad}
        )
        assert r.status_code == 400 and "prompt_logprobs" in r.text


def test_n_above_max_num_seqs_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(prompt="x", max_tokens=1, n=100, **GREEDY)
    assert "max_num_seqs" in exc.value.body["message"] and exc.value.body["param"] == "n"


def test_chat_logprobs(client):
    msgs = [{"role": "user", "content": "logprobs please"}]
    r = client.chat.completions.create(
        messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob
        assert item.bytes == list(item.token.encode())


def test_stop_reason_and_controls(client):
    tokenizer = load_model("tiny-random").tokenizer
    base = client.completions.create(prompt=[5, 6, 7], max_tokens=8, logprobs=0, **GREEDY)
    text = base.choices[0].text
    assert len(text) >= 4
    # a stop string: cut, or kept with include_stop_str_in_output; stop_reason names it
    stop = text[2:4]
    r = client.completions.create(prompt=[5, 6, 7], max_tokens=8, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].logprobs is None
    kept = client.completions.create(
        prompt=[5, 6, 7],
        max_tokens=8,
        stop=[stop],
        model="tiny-random",
        temperature=0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == text[: text.find(stop) + len(stop)]
    # a stop token id (the greedy first token): stop_reason is the id; min_tokens holds it back
    engine = LLMEngine(load_model("tiny-random"), EngineConfig(num_blocks=64, block_size=4))
    first = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[
        0
    ]
    body = dict(prompt=[5, 6, 7], max_tokens=8, model="tiny-random", temperature=0)
    stopped = client.completions.create(
        **body, extra_body={"ignore_eos": True, "stop_token_ids": [first]}
    )
    assert (
        stopped.choices[0].finish_reason == "stop"
        and stopped.choices[0].model_extra["stop_reason"] == first
    )
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].text == ""
    held = client.completions.create(
        **body, extra_body={"ignore_eos": True, "stop_token_ids": [first], "min_tokens": 3}
    )
    assert held.usage.completion_tokens >= 3
    # logit_bias +100 forces a token; the penalties, min_p and skip_special_tokens are honoured
    forced = client.completions.create(
        prompt="x", max_tokens=4, logit_bias={"42": 100}, logprobs=0, **GREEDY
    )
    assert (
        forced.choices[0].logprobs.tokens == [tokenizer.decode([42], skip_special_tokens=False)] * 4
    )
    plain = client.completions.create(prompt="x y z", max_tokens=8, **GREEDY).choices[0].text
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        client.completions.create(prompt="x y z", max_tokens=8, **extra, **GREEDY)
    rep = client.completions.create(
        prompt="x y z",
        max_tokens=8,
        model="tiny-random",
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "repetition_penalty": 1.5,
            "min_p": 0.1,
            "skip_special_tokens": False,
        },
    )
    assert rep.usage.completion_tokens == 8 and isinstance(plain, str)


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("parallel_tool_calls", True),
        ("guided_json", {"type": "object"}),
        ("use_beam_search", True),
    ],
)
def test_unsupported_chat_fields_are_400_naming_them(server, field, value):
    body = {
        "model": "tiny-random",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        field: value,
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert (
        r.status_code == 400
        and r.json()["error"]["param"] == field
        and field in r.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("suffix", "tail"),
        ("best_of", 4),
    ],
)
def test_unsupported_completion_fields_are_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-random", prompt="hi", max_tokens=2, **{field: value})
    assert exc.value.body["param"] == field


def test_non_text_message_parts_are_400(client):
    msgs = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    ]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=2)
    assert "image_url" in exc.value.body["message"]
