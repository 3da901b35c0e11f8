"""The attacks on the shared KV store: prompt reading, store poisoning and store emptying."""

from __future__ import annotations

import contextlib
import random
import uuid
from collections import Counter
from functools import cache

from pagedkv.bench import harness
from pagedkv.bench.attacks.target import (
    ATTACKER,
    BLOCK_SIZE,
    MODEL,
    STORE_MAX_TOKENS,
    Target,
    metric,
    running,
)
from pagedkv.bench.workloads import AttackWorkload


@cache
def _public_model():
    from pagedkv.bench.attackers import PublicModel

    return PublicModel(MODEL, BLOCK_SIZE)


def _complete(
    url: str,
    prompt: str | list[int],
    *,
    salt: str | None = None,
    max_tokens: int = STORE_MAX_TOKENS,
) -> str:
    """A greedy completion's text from the worker at `url` (under `salt`)."""
    import httpx

    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _settle(url: str) -> None:
    """A worker's last frees applied: their blocks written through to the store and confirmed
    (two more requests of its own, under a fresh salt: two more steps at least)."""
    for _ in range(2):
        _complete(url, "settle", salt=uuid.uuid4().hex, max_tokens=2)


def _shared_tier(url: str) -> tuple[float, Counter[str]]:
    """A worker's prompt tokens loaded from the shared store, and its entries refused by reason."""
    hits, refused = 0.0, Counter()
    for sample in harness.metric_samples(url):
        if sample.labels.get("tier") != "shared":
            continue
        if sample.name == "pagedkv_worker_kv_tier_hit_tokens_total":
            hits += sample.value
        elif sample.name == "pagedkv_worker_kv_tier_refused_entries_total":
            refused[sample.labels["reason"]] += int(sample.value)
    return hits, refused


def prompt_reading(t: Target, w: AttackWorkload) -> contextlib.AbstractContextManager[dict]:
    def work() -> dict:
        from pagedkv.bench.attackers import read_entries, text_read_back
        from worker.tiers import StoreSeal

        model = _public_model()
        secret = f"{random.Random().randrange(10**8):08d}"
        # (a token a byte)
        head = f"The vault code is {secret}: tenant A's notes, for nobody else. "
        text = (head + "Nothing more to say here. " * w.prompt_blocks)[
            : max(w.prompt_blocks * BLOCK_SIZE, len(head))
        ]
        _complete(t.worker, text, salt="tenant-a", max_tokens=1)
        _settle(t.worker)
        plain = read_entries(t.store_dir, model)
        own_key = (
            read_entries(t.store_dir, model, StoreSeal(t.attacker_key)) if t.attacker_key else None
        )
        read_back = text_read_back(plain["blocks"], model.loaded.tokenizer, secret)
        return {
            "entries_read": plain["entries"],
            "entries_decoded": plain["decoded"],
            "tokens_recovered": plain["tokens"],
            "secret_read_back": read_back,
            "decoded_with_its_own_groups_key": own_key["decoded"] if own_key is not None else None,
            "refused": plain["refused"],
            "reached": plain["tokens"] > 0 or read_back,
        }

    return running(work)


def _attacker_pool(t: Target, model):
    """The attacker's own pool on the stack's shared store, with its own worker token."""
    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import PoolConfig

    config = PoolConfig(
        num_blocks=256,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        model_fingerprint=model.loaded.fingerprint,
        layout=model.layout.key,
        block_bytes=model.layout.block_bytes,
        use_shared_store=True,
    )
    return GrpcAllocator(
        t.allocator,
        PoolSpec(ATTACKER, config, advertise_url=t.attacker_url, served_model_name=ATTACKER),
        auth_token=t.attacker_token,
        retries=0,
        register_wait_s=0,
    )


def store_emptying(t: Target, w: AttackWorkload) -> contextlib.AbstractContextManager[dict]:
    """Worker-2 computes prompts (their blocks saved to the store); the attacker's own pool
    reports every entry hash it can read off the store's folder as a load it refused; then
    worker-1 is sent those prompts. Succeeded: worker-1 loaded fewer of their tokens from the
    store than worker-2 saved (the entries left the index)."""

    def work() -> dict:
        from pagedkv.bench.attackers import refuse_entries, store_entries

        model = _public_model()
        rng = random.Random(45)
        prompts = [
            [rng.randrange(3, 259) for _ in range(w.prompt_blocks * BLOCK_SIZE + 1)]
            for _ in range(w.poison_prompts)
        ]
        for p in prompts:
            _complete(t.writer, p)
        _settle(t.writer)
        entries = metric(t.stack.allocator_metrics_url, "pagedkv_allocator_shared_store_entries")
        hashes = [h for _, _, h in store_entries(t.store_dir)]
        pool = _attacker_pool(t, model)
        try:
            refuse_entries(pool, hashes)
        finally:
            pool.close()
        left = metric(t.stack.allocator_metrics_url, "pagedkv_allocator_shared_store_entries")
        hits0, _ = _shared_tier(t.worker)
        for p in prompts:
            _complete(t.worker, p)
        hits1, _ = _shared_tier(t.worker)
        expected = len(prompts) * w.prompt_blocks * BLOCK_SIZE
        return {
            "hashes_named": len(hashes),
            "store_entries_before": int(entries),
            "store_entries_after": int(left),
            "victim_tokens_expected": expected,
            "victim_tokens_loaded": int(hits1 - hits0),
            "reached": left < entries or hits1 - hits0 < expected,
        }

    return running(work)


def store_poisoning(t: Target, w: AttackWorkload) -> contextlib.AbstractContextManager[dict]:
    def work() -> dict:
        from pagedkv.bench.attackers import overwrite_entries, plant_entries
        from worker.tiers import open_store

        model = _public_model()
        rng = random.Random(44)
        n = w.poison_prompts
        prompts = [
            [rng.randrange(3, 259) for _ in range(w.prompt_blocks * BLOCK_SIZE + 1)]
            for _ in range(2 * n)
        ]
        planted_for, written_for = prompts[:n], prompts[n:]
        # what worker-1 answers each prompt when it computes it all (a fresh salt: nothing cached)
        want = [_complete(t.worker, p, salt=uuid.uuid4().hex) for p in prompts]
        hits0, refused0 = _shared_tier(t.worker)
        # (a) through the protocol: the attacker's own pool, with its own token
        pool = _attacker_pool(t, model)
        try:
            with open_store(pool.shared_store) as store:
                planted = plant_entries(pool, planted_for, model, store)
        finally:
            pool.close()
        got = [_complete(t.worker, p) for p in planted_for]
        hits1, _ = _shared_tier(t.worker)
        # (b) over the files: worker-2's honest entries first
        for p in written_for:
            _complete(t.writer, p)
        _settle(t.writer)
        overwritten = overwrite_entries(t.store_dir, model)
        got += [_complete(t.worker, p) for p in written_for]
        hits2, refused2 = _shared_tier(t.worker)
        changed = [a != b for a, b in zip(got, want, strict=True)]
        loaded = (hits1 - hits0, hits2 - hits1)
        return {
            "entries_planted": planted,
            "victim_tokens_from_planted": int(loaded[0]),
            "answers_changed_planted": sum(changed[:n]),
            "entries_overwritten": overwritten,
            "victim_tokens_from_overwritten": int(loaded[1]),
            "answers_changed_overwritten": sum(changed[n:]),
            "victim_prompts": 2 * n,
            "refused": dict(refused2 - refused0),
            "reached": any(loaded) or any(changed),
        }

    return running(work)
