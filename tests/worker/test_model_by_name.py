"""Models by name, as `vllm serve ORG/NAME` takes them: a Hugging Face repo id
resolved from the local Hugging Face cache (offline), the positional MODEL,
and `--dtype auto` (the model's own dtype; float32 on the CPU).

The cache is built here the way huggingface_hub lays it out
(`models--org--name/{blobs,snapshots/<rev>,refs/main}`, snapshot files being
links into blobs/), from a random-weight Llama saved by transformers in
bfloat16, so `auto` has a dtype to read.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedkv.stack import WorkerProcess
from pagedkv_base.model_files import hf_cache_dir
from worker.cli import add_arguments, model_of
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")

REPO = "pagedkv-test/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "t5 t17 t3 t42 t8"


def _save_checkpoint(folder: Path) -> None:
    import tokenizers

    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.to(torch.bfloat16).save_pretrained(folder)  # config.json says bfloat16
    tk = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0")
    )
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece()
    tk.save(str(folder / "tokenizer.json"))


def _into_hf_cache(folder: Path, cache: Path, repo: str, revision: str) -> Path:
    """Lay `folder` out as huggingface_hub caches `repo` at `revision`; the snapshot folder."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the checkpoint folder, the cache folder holding it as REPO)."""
    folder = tmp_path_factory.mktemp("checkpoint")
    _save_checkpoint(folder)
    cache = tmp_path_factory.mktemp("hf-cache")
    _into_hf_cache(folder, cache, REPO, REVISION)
    return folder, cache


@pytest.fixture
def offline_cache(hub, monkeypatch):
    folder, cache = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder, cache


def _greedy(loaded, n: int = 12) -> list[int]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    return list(out.token_ids)


def test_repo_id_loads_the_cached_snapshot_like_the_folder(offline_cache):
    folder, _ = offline_cache
    by_name, by_folder = load_model(REPO), load_model(folder)
    assert by_name.name == REPO
    # the same files: the same fingerprint, so the two share prefix-cache blocks
    assert by_name.fingerprint == by_folder.fingerprint
    assert _greedy(by_name) == _greedy(by_folder)


def test_dtype_auto_is_float32_on_cpu_and_the_config_dtype_on_cuda(offline_cache):
    from worker.model.loader import resolve_dtype

    loaded = load_model(REPO, dtype="auto")
    assert loaded.model.dtype == torch.float32  # the config says bfloat16: slow on a CPU
    assert _greedy(loaded) == _greedy(load_model(REPO, dtype="float32"))
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, declared="bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", cuda, declared="float16") == torch.float16
    # as vLLM serves float32 models
    assert resolve_dtype("auto", cuda, declared="float32") == torch.bfloat16
    assert resolve_dtype("half", torch.device("cpu")) == torch.float16


def test_missing_repo_is_one_line_naming_the_cache(offline_cache, tmp_path, monkeypatch):
    _, cache = offline_cache
    with pytest.raises(ModelLoadError) as exc:
        load_model("pagedkv-test/not-there")
    message = str(exc.value)
    assert "\n" not in message and str(cache) in message and "pagedkv-test/not-there" in message
    assert "HF_HUB_OFFLINE" in message
    # HF_HOME alone: the cache is $HF_HOME/hub
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hf_cache_dir() == tmp_path / "hub"
    with pytest.raises(ModelLoadError, match=str(tmp_path / "hub")):
        load_model(REPO)


def test_positional_model_and_flag_agree():
    import argparse

    from pagedkv_base.settings import CliError

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert model_of(p.parse_args([REPO])) == REPO
    assert model_of(p.parse_args(["--model", REPO])) == REPO
    assert model_of(p.parse_args([REPO, "--model", REPO])) == REPO
    assert model_of(p.parse_args([])) == "smollm2"
    assert p.parse_args([]).dtype == "auto"
    with pytest.raises(CliError, match="given twice"):
        model_of(p.parse_args([REPO, "--model", "tiny-random"]))


def test_worker_serves_a_repo_id_given_positionally(hub):
    """`python -m worker ORG/NAME` with an offline cache: answers as the folder does offline."""
    folder, cache = hub
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    worker = WorkerProcess(
        "by-name",
        args=[REPO, "--num-blocks", "64", "--block-size", "4", "--log-level", "warning"],
        env=env,
    )
    try:
        url = worker.start().wait_healthy(90).url
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        [card] = client.models.list().data
        assert card.id == REPO and card.model_extra["root"] == REPO
        r = client.completions.create(
            model=REPO, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        engine = LLMEngine(load_model(folder), EngineConfig(num_blocks=64, block_size=4))
        offline = engine.generate(
            [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )[0]
        assert r.choices[0].text == offline.text
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
    finally:
        worker.terminate()
