"""The worker tells the truth: unique default ids, allocator failures as a
short 503 (never a gRPC debug string), /health that says when the allocator
refuses the pool, and prompts refused before tokenizing when they can never
fit. The same promises on real processes: tests/drills/test_worker_truth.py."""

from __future__ import annotations

import random
import re

import grpc
import pytest
from fastapi.testclient import TestClient

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.core import PoolConfig
from pagedkv.stack import free_port
from worker.cli import add_arguments, default_worker_id
from worker.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model
from worker.server.app import create_app

LEAKS = ("debug_error_string", "_InactiveRpcError", "StatusCode.", "<_")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_default_worker_ids_are_unique_per_host_and_process():
    import os
    import socket

    ids = {default_worker_id() for _ in range(50)}
    assert len(ids) == 50
    for wid in ids:
        assert 1 <= len(wid) <= 128 and "/" not in wid and wid.isprintable()
        assert re.fullmatch(r".+-\d+-[0-9a-f]{6}", wid)
        assert f"-{os.getpid()}-" in wid
        assert wid.startswith(socket.gethostname().replace("/", "-")[:100])


def test_the_allocator_timeouts_are_variables(monkeypatch, capsys):
    """How long the worker waits on a silent allocator: settings an operator tunes
    through PAGEDKV_WORKER_ALLOCATOR_* (no flags), carried into the engine's config."""
    import argparse

    from pagedkv_base.settings import CliError
    from worker.cli import engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = engine_config(parser.parse_args([]))
    assert (config.allocator_give_up_after_s, config.allocator_unhealthy_after_s) == (120.0, 10.0)
    monkeypatch.setenv("PAGEDKV_WORKER_ALLOCATOR_GIVE_UP_AFTER", "30")
    monkeypatch.setenv("PAGEDKV_WORKER_ALLOCATOR_UNHEALTHY_AFTER", "3")
    config = engine_config(parser.parse_args([]))
    assert (config.allocator_give_up_after_s, config.allocator_unhealthy_after_s) == (30.0, 3.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--allocator-unhealthy-after", "2.5"])
    assert "unrecognized arguments: --allocator-unhealthy-after" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDKV_WORKER_ALLOCATOR_UNHEALTHY_AFTER", "0")
    with pytest.raises(CliError, match="PAGEDKV_WORKER_ALLOCATOR_UNHEALTHY_AFTER='0'"):
        engine_config(parser.parse_args([]))


def test_min_tokens_is_a_lower_bound_and_refuses_without_tokenizing(tiny):
    tok = tiny.tokenizer
    rng = random.Random(1)
    alphabet = " \n\tabcXYZ0123456789éü✓😀<|>[]{}=" + "".join(
        tok.backend.get_vocab(with_added_tokens=True)
    )
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) + rng.choice(
            ["", "=" * 90, " " * 90]
        )
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4, max_model_len=128))
    with pytest.raises(ValueError, match="at least .* tokens; the context length holds 128"):
        engine.encode_prompt("word " * 10**6)
    # what is tokenized is tokenized as before
    assert engine.encode_prompt("hello paged world") == tok.encode("hello paged world")


def _real_rpc_error() -> grpc.RpcError:
    """A real `_InactiveRpcError` (UNAVAILABLE: nothing listens), debug string and all."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as err:
            assert "debug_error_string" in str(err)
            return err
    raise AssertionError("the call should have failed")


class Refusing(EmbeddedAllocator):
    """Raises a real gRPC error on every step while `refuse` is set."""

    refuse = True

    def __init__(self, spec: PoolSpec, error: grpc.RpcError) -> None:
        super().__init__(spec)
        self.error = error

    def step(self, ops):
        if self.refuse:
            raise self.error
        return super().step(ops)


def test_allocator_refusal_is_a_short_503_and_health_says_so(tiny):
    config = EngineConfig(num_blocks=64, block_size=4)
    spec = PoolSpec(
        "w", PoolConfig(num_blocks=64, block_size=4, model_fingerprint=tiny.fingerprint)
    )
    allocator = Refusing(spec, _real_rpc_error())
    engine = AsyncLLMEngine(LLMEngine(tiny, config, allocator=allocator))
    body = {
        "model": "tiny-random",
        "prompt": "hello",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    try:
        with TestClient(create_app(engine, "tiny-random")) as client:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "allocator_refused" and error["type"] == "server_error"
            assert "UNAVAILABLE" in error["message"] and len(error["message"]) < 400
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            assert (
                streamed.status_code == 503
                and streamed.json()["error"]["code"] == "allocator_refused"
            )
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["code"] == "allocator_refused"
            for text in (r.text, streamed.text, health.text):
                assert not any(leak in text for leak in LEAKS), text
            allocator.refuse = False  # the allocator takes the pool again
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200
            offline = LLMEngine(tiny, config).generate(
                ["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            )[0]
            assert r.json()["choices"][0]["text"] == offline.text
            assert client.get("/health").json()["status"] == "ok"
    finally:
        engine.shutdown()
