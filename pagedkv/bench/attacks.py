"""`pagedkv bench attacks`: the trust-boundary attacks against a stack with
credentials and one without, and what the victim and the allocator felt.

Each stack is what `pagedkv up --redis` runs, as real processes
(`pagedkv.stack.LocalStack`): a private Redis holding the allocator's
journal, the allocator with a file:// shared KV store, two tiny-random
workers and the router. One has the credentials `pagedkv up` generates (a
token per worker bound to its id and address, the workers one store group
with its key, the router's token, an admin's, a journal key) and one more
worker token, an attacker's: a worker of another store group (`ATTACKER`,
bound to an address the bench holds); the other none (any caller may
register a pool, every pool shares the store unsealed: a development setup).

The victim runs in a process of its own for the whole run: a pool's decode
loop of Steps (`decode_steps`, one Step every 20 ms; with credentials it
registers with the admin token, the operator's) and a loop of greedy
completions through the router, each checked for the worker's text and the
`x-pagedkv-worker` header naming the real worker. The attacks run one after
the other (`pagedkv.bench.attackers`, the code the drills run), each after
`baseline_s` of the victim alone, from a caller with no token (and, for the
rogue pool, with worker-1's token too):

- rogue pool: pools advertising an attacker's server (whose identity route
  forges a proof, or relays the real worker's) and the real worker's
  address (under the real model's name and another's). Succeeded: the
  attacker's server was sent a completion or a credential.
- idle connections: to the allocator's HTTP port, sending nothing; its
  /metrics timed before they open and while they are open (`METRICS_PROBES`
  GETs, a new connection each). Succeeded: they took a thread each, or a
  /metrics GET failed or took over `METRICS_TARGET_S`.
- slow clients: heads and bodies on the router that never end. Succeeded:
  one was still open past its deadline (measured when the attack lasts that
  long), or /health failed.
- big /tokenize: one multi-megabyte text with its token strings at the
  worker. Succeeded: /health failed while it was answered.
- slow-read flood: many large pools keeping integrity checks in flight
  (its own process).
- snapshot amplification: one pool forked into thousands of sequences with
  the longest ids, while the allocator snapshots every `snapshot_every`
  records.
- snapshot watchers: `WatchEvents` streams each asking for the snapshot of a
  pool's cached blocks, read slowly.
- prompt reading: worker-1 is sent a salted tenant's prompt holding a
  secret; whoever reads the store's folder (the attacker) decodes every
  entry it finds without a key (and with its own group's key) and maps each
  decoded block's layer-0 V rows back to tokens with the public weights.
  Succeeded: a prompt token was recovered.
- store poisoning: the attacker's own pool plants forged entries for
  prompts worker-1 is then sent (admit, free, forged K/V under a valid
  header and checksum, the save confirmed), and, once worker-2 has computed
  other prompts, writes forged entries over every entry file of the store;
  worker-1 is then sent those. Succeeded: worker-1 loaded a forged entry
  (its shared-tier hit tokens) or answered other text than the same prompt
  computed under a fresh salt.
- evil worker: the attacker's pool at its address, proven to the router by a
  server of its own (`BadWorker`) serving a model of its own name (only the
  attack's requests go to it): `evil_answers` answers of `evil_answer_mb`
  at once, and a whole answer and a stream trickled a byte at a time after
  their status. Succeeded: the router's RSS grew by an answer's size, or a
  trickled answer was not ended (504, or an error event) within the
  router's first-byte timeout and `TRICKLE_SLACK_S`.

Every attack also succeeded if the victim lost a Step or a request while it
ran, or a process of the stack exited. Figures per attack and stack: the
victim's Step p99 and its router request p99 during the attack and in the
baseline before it, the allocator's peak RSS and thread count (psutil, read
every 50 ms), what was refused (for the store attacks: the entries worker-1
or the reader refused, by reason), and the attack's own details.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import random
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import ATTACKS, AttackWorkload

__all__ = ["add_arguments", "measure", "run", "tables"]

MODEL = "tiny-random"
WORKER_ARGS = ["--num-blocks", "64", "--block-size", "16", "--max-num-seqs", "4", "--log-level", "warning"]
PROMPT = "Hello there"
STEP_PAUSE_S = 0.02  # between the victim's Steps, as a worker's decode steps come
REQUEST_PAUSE_S = 0.05  # between the victim's router requests
SAMPLE_S = 0.05  # the allocator's RSS and threads read this often
KEPT_ERRORS = 5
METRICS_PROBES = 20  # GETs of the allocator's /metrics before the idle connections and with them
METRICS_PAUSE_S = 0.05
METRICS_TARGET_S = 1.0  # /metrics answers within this with the idle connections open
STACKS = ("credentials", "none")
BLOCK_SIZE = 16  # WORKER_ARGS'
STORE_GIB = "0.0625"  # the stack's shared store (64 MiB; an entry of the tiny model is 8 KiB)
ATTACKER = "attacker"  # the attacker's worker id: with credentials its own token, a store group of its own
EVIL_MODEL = "evil-model"  # the model the evil worker serves: only the attack's requests are routed to it
STORE_MAX_TOKENS = 8  # per completion of the store attacks
TRICKLE_SLACK_S = 5.0  # a trickled answer ended within the router's first-byte timeout and this
OWN_TABLES = ("prompt-reading", "store-poisoning", "evil-worker")  # their details in tables of their own


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, ATTACKS)
    p.add_argument("--attacks", type=harness.comma_list(list(ATTACK_NAMES)), default=list(ATTACK_NAMES),
                   metavar="NAMES", help=f"the attacks to run, in this order (default all: "
                                         f"{','.join(ATTACK_NAMES)})")
    harness.add_json_option(p)


# -- the target, as each attack sees it -----------------------------------------------------------


@dataclass
class Target:
    stack: Any  # a started LocalStack
    credentials: bool
    worker_token: str | None  # worker-1's (with credentials)
    admin_token: str | None
    attacker_token: str | None  # ATTACKER's worker token (with credentials)
    attacker_key: bytes | None  # ATTACKER's own store group's key (with credentials)
    attacker_socket: socket.socket  # listening at the address ATTACKER's token is bound to
    store_dir: Path  # the shared store's folder (file://), which the attacker can read and write

    @property
    def allocator(self) -> str:
        return self.stack.allocator_address

    @property
    def router(self) -> str:
        return self.stack.router_url

    @property
    def worker(self) -> str:
        return self.stack.worker_urls[0]

    @property
    def writer(self) -> str:  # the worker whose store entries the attacker writes over
        return self.stack.worker_urls[1]

    @property
    def attacker_url(self) -> str:
        return f"http://127.0.0.1:{self.attacker_socket.getsockname()[1]}"


def _refused(err) -> str:
    return err.code().name


@contextlib.contextmanager
def rogue_pool(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import grpc

    from pagedkv.bench.attackers import Attacker, rogue_pool

    out: dict[str, Any] = {}
    refused: Counter[str] = Counter()
    pools = []
    with Attacker(MODEL, relay=t.worker) as relay, Attacker(MODEL) as forger:
        if t.credentials:  # an outsider, then worker-1's token: every one must be refused
            attempts = [("evil", forger.url, MODEL, None), ("worker-1", forger.url, MODEL, None),
                        ("evil", relay.url, MODEL, t.worker_token), ("worker-1", forger.url, MODEL, t.worker_token),
                        ("evil", t.worker, MODEL, t.worker_token)]
        else:  # registered: the router must not route to any
            attempts = [("evil-1", t.worker, "other-model", None), ("evil-2", t.worker, MODEL, None),
                        ("evil-3", relay.url, MODEL, None), ("evil-4", forger.url, MODEL, None)]
        for worker_id, url, model, token in attempts:
            try:
                pool = rogue_pool(t.allocator, worker_id, url, model, token)
            except grpc.RpcError as err:
                refused[_refused(err)] += 1
                continue
            pools.append(pool)
            if url == forger.url:
                forger.pool_id = pool.pool_id
        try:
            deadline = time.monotonic() + 30
            while pools and _metric(t.router, "pagedkv_router_unproven_pools") < len(pools):
                if time.monotonic() > deadline:
                    out["note"] = "the router did not list every rogue pool within 30 s"
                    break
                time.sleep(0.1)
            yield out
            unproven = _metric(t.router, "pagedkv_router_unproven_pools")
        finally:
            for pool in pools:
                pool.close()
        sent = relay.posts + forger.posts
        seen = relay.credentials_seen + forger.credentials_seen
    out.update(refused=dict(refused), registered=len(pools), unproven_pools=unproven,
               completions_sent_to_the_attacker=sent, credentials_sent_to_the_attacker=seen,
               reached=sent > 0 or seen > 0)


@contextlib.contextmanager
def idle_connections(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import psutil

    from pagedkv.bench.attackers import TooFewFiles, idle_connections

    proc = psutil.Process(t.stack.allocator.pid)
    url = t.stack.allocator_metrics_url
    before = proc.num_threads()
    metrics_before = _metrics_waits(url)
    out: dict[str, Any] = {}
    try:
        socks = idle_connections(url, w.idle_connections)
    except TooFewFiles as exc:
        out["note"] = str(exc)
        socks = []
    try:
        time.sleep(0.5)
        during = proc.num_threads()
        metrics_during = _metrics_waits(url)
        yield out
    finally:
        for sock in socks:
            sock.close()
    failed = metrics_during.count(None)
    slowest = max((s for s in metrics_during if s is not None), default=None)
    out.update(connections=len(socks), threads_before=before, threads_with_them=during,
               metrics_probes=len(metrics_during),
               metrics_p50_ms_before=_ms(harness.percentile(metrics_before, 0.5)),
               metrics_max_ms_before=_ms(max((s for s in metrics_before if s is not None), default=None)),
               metrics_p50_ms_during=_ms(harness.percentile(metrics_during, 0.5)), metrics_max_ms_during=_ms(slowest),
               metrics_failed_during=failed,
               # a thread each, or /metrics not answered within METRICS_TARGET_S
               reached=during - before > 16 or failed > 0 or slowest is None or slowest > METRICS_TARGET_S)


def _metrics_waits(url: str, probes: int = METRICS_PROBES) -> list[float | None]:
    """Seconds each of `probes` GETs of `url` took, a new connection each
    (None: not a 200 within 10 s), METRICS_PAUSE_S apart."""
    import httpx

    waits: list[float | None] = []
    for _ in range(probes):
        t0 = time.perf_counter()
        try:
            ok = httpx.get(url, timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        waits.append(time.perf_counter() - t0 if ok else None)
        time.sleep(METRICS_PAUSE_S)
    return waits


@contextlib.contextmanager
def slow_clients(t: Target, w: AttackWorkload) -> Iterator[dict]:
    from pagedkv.bench.attackers import closed_by_peer, slow_clients

    t0 = time.monotonic()
    heads, bodies = slow_clients(t.router, w.slow_clients, w.slow_clients)
    out: dict[str, Any] = {}
    health = _Prober(t.router + "/health").start()
    try:
        yield out
        # the bodies' deadline checked too when it is near (each open past its deadline and a second)
        body_check = w.router_header_timeout_s + w.router_body_timeout_s + 1.0
        if body_check <= 3 * w.attack_s:
            time.sleep(max(0.0, t0 + body_check + 0.1 - time.monotonic()))
        waited = time.monotonic() - t0

        def still_open(socks, deadline_s: float) -> int | None:  # None: the attack ended before the deadline
            return sum(not closed_by_peer(s) for s in socks) if waited > deadline_s + 1.0 else None

        open_heads = still_open(heads, w.router_header_timeout_s)
        open_bodies = still_open(bodies, w.router_header_timeout_s + w.router_body_timeout_s)
    finally:
        probes = health.stop()
        for sock in heads + bodies:
            sock.close()
    out.update(heads=len(heads), bodies=len(bodies), heads_open_past_deadline=open_heads,
               bodies_open_past_deadline=open_bodies, **probes,
               reached=bool(open_heads) or bool(open_bodies) or probes["health_failed"] > 0)


@contextlib.contextmanager
def big_tokenize(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import httpx

    from pagedkv.bench.attackers import big_text

    answer: dict[str, Any] = {}
    text = big_text(w.tokenize_bytes)

    def post() -> None:
        try:
            r = httpx.post(t.worker + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=600)
            answer.update(status=r.status_code, tokens=r.json().get("count") if r.status_code == 200 else None)
        except httpx.HTTPError as exc:
            answer.update(status=None, error=repr(exc)[:200])

    health = _Prober(t.worker + "/health").start()
    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        thread.join(600)
        probes = health.stop()
    out.update(text_bytes=len(text), tokenize_status=answer.get("status"), tokens=answer.get("tokens"),
               **probes, reached=probes["health_failed"] > 0)


@contextlib.contextmanager
def slow_read_flood(t: Target, w: AttackWorkload) -> Iterator[dict]:
    from pagedkv.bench.attackers import slow_read_flood

    ctx = mp.get_context("spawn")
    stop, ready, outcome = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=slow_read_flood, args=(t.allocator, stop, ready), daemon=True,
                       kwargs={"pools": w.flood_pools, "in_flight": w.flood_in_flight, "blocks": w.flood_blocks,
                               "tokens": w.flood_tokens, "outcome": outcome})
    proc.start()
    out: dict[str, Any] = {}
    try:
        ready.wait(300)
        yield out
    finally:
        stop.set()
        try:
            got = outcome.get(timeout=120)
        except Exception:  # noqa: BLE001 - the flood's process died: say so
            got = {"registered": None, "codes": {"no outcome": 1}}
        proc.join(60)
    codes = got["codes"]
    out.update(pools=got["registered"], checks_answered=codes.get("OK", 0),
               checks_refused=sum(v for k, v in codes.items() if k not in ("OK",) and " " not in k),
               refused={k.removeprefix("RegisterPool "): v for k, v in codes.items() if k.startswith("RegisterPool")},
               reached=False)


@contextlib.contextmanager
def snapshot_amplification(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import grpc

    from allocator_service.client import PoolLost
    from allocator_service.core import Append
    from pagedkv.bench.attackers import snapshot_amplifier

    out: dict[str, Any] = {}
    refused: Counter[str] = Counter()
    pool = None
    try:
        pool, outcomes = snapshot_amplifier(t.allocator, steps=w.snapshot_steps, forks=w.snapshot_forks)
        out["operations"] = dict(outcomes)
    except grpc.RpcError as err:
        refused[_refused(err)] += 1
    try:
        yield out
    finally:
        if pool is not None:
            try:  # a pool over its snapshot share is dropped: its next call finds it gone
                pool.step([Append("x" * 256, [1])])
                out["dropped"] = False
            except PoolLost:
                out["dropped"] = True
            pool.close()
    out.update(refused=dict(refused), reached=False)


@contextlib.contextmanager
def snapshot_watchers(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import grpc

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import Admit, PoolConfig
    from pagedkv.bench.attackers import SnapshotWatchers

    out: dict[str, Any] = {}
    bait = None
    try:  # the cached blocks the watchers' snapshots carry
        blocks = w.watched_tokens // 16 + 16
        bait = GrpcAllocator(t.allocator, PoolSpec("watched", PoolConfig(blocks, 16, True, "m")), retries=0)
        bait.step([Admit("w", list(range(1, w.watched_tokens + 1)))])
        out["cached_blocks"] = w.watched_tokens // 16
    except grpc.RpcError as err:
        out["pool_refused"] = _refused(err)
    watchers = SnapshotWatchers(t.allocator, w.watchers).start()
    try:
        yield out
    finally:
        got = watchers.stop()
        if bait is not None:
            bait.close()
    codes = got["codes"]
    out.update(watchers=w.watchers, messages=got["messages"], snapshots_read=got["snapshots_ended"],
               refused={k: v for k, v in codes.items() if k != "OK"}, reached=False)


@contextlib.contextmanager
def _running(work: Callable[[], dict]) -> Iterator[dict]:
    """An attack that is `work` in a thread while its window lasts (and until it is done);
    its figures, or its exception raised here."""
    out: dict[str, Any] = {}
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["figures"] = work()
        except Exception as exc:  # noqa: BLE001 - raised again in the bench's thread
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        thread.join()
    if "error" in done:
        raise done["error"]
    out.update(done["figures"])


@cache
def _public_model():
    from pagedkv.bench.attackers import PublicModel

    return PublicModel(MODEL, BLOCK_SIZE)


def _complete(url: str, prompt: str | list[int], *, salt: str | None = None,
              max_tokens: int = STORE_MAX_TOKENS) -> str:
    """A greedy completion's text from the worker at `url` (under `salt`)."""
    import httpx

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
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
        head = f"The vault code is {secret}: tenant A's notes, for nobody else. "  # (a token a byte)
        text = (head + "Nothing more to say here. " * w.prompt_blocks)[:max(w.prompt_blocks * BLOCK_SIZE, len(head))]
        _complete(t.worker, text, salt="tenant-a", max_tokens=1)
        _settle(t.worker)
        plain = read_entries(t.store_dir, model)
        own_key = read_entries(t.store_dir, model, StoreSeal(t.attacker_key)) if t.attacker_key else None
        read_back = text_read_back(plain["blocks"], model.loaded.tokenizer, secret)
        return {"entries_read": plain["entries"], "entries_decoded": plain["decoded"],
                "tokens_recovered": plain["tokens"], "secret_read_back": read_back,
                "decoded_with_its_own_groups_key": own_key["decoded"] if own_key is not None else None,
                "refused": plain["refused"], "reached": plain["tokens"] > 0 or read_back}

    return _running(work)


def store_poisoning(t: Target, w: AttackWorkload) -> contextlib.AbstractContextManager[dict]:
    def work() -> dict:
        from allocator_service.client import PoolSpec
        from allocator_service.client.grpc_client import GrpcAllocator
        from allocator_service.core import PoolConfig
        from pagedkv.bench.attackers import overwrite_entries, plant_entries
        from worker.tiers import open_store

        model = _public_model()
        rng = random.Random(44)
        n = w.poison_prompts
        prompts = [[rng.randrange(3, 259) for _ in range(w.prompt_blocks * BLOCK_SIZE + 1)] for _ in range(2 * n)]
        planted_for, written_for = prompts[:n], prompts[n:]
        # what worker-1 answers each prompt when it computes it all (a fresh salt: nothing cached)
        want = [_complete(t.worker, p, salt=uuid.uuid4().hex) for p in prompts]
        hits0, refused0 = _shared_tier(t.worker)
        # (a) through the protocol: the attacker's own pool, with its own token
        config = PoolConfig(num_blocks=256, block_size=BLOCK_SIZE, enable_prefix_caching=True,
                            model_fingerprint=model.loaded.fingerprint, layout=model.layout.key,
                            block_bytes=model.layout.block_bytes, use_shared_store=True)
        pool = GrpcAllocator(t.allocator, PoolSpec(ATTACKER, config, advertise_url=t.attacker_url,
                                                   served_model_name=ATTACKER),
                             auth_token=t.attacker_token, retries=0, register_wait_s=0)
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
        return {"entries_planted": planted, "victim_tokens_from_planted": int(loaded[0]),
                "answers_changed_planted": sum(changed[:n]), "entries_overwritten": overwritten,
                "victim_tokens_from_overwritten": int(loaded[1]), "answers_changed_overwritten": sum(changed[n:]),
                "victim_prompts": 2 * n, "refused": dict(refused2 - refused0),
                "reached": any(loaded) or any(changed)}

    return _running(work)


def evil_worker(t: Target, w: AttackWorkload) -> contextlib.AbstractContextManager[dict]:
    def work() -> dict:
        import concurrent.futures

        import psutil

        from pagedkv.bench.attackers import BadWorker, rogue_pool

        timeout = w.router_first_byte_timeout_s
        sampler = _Sampler(t.stack.router.pid)
        workers = len(t.stack.worker_urls)
        try:
            with BadWorker("by-prompt", sock=t.attacker_socket.dup(), huge_bytes=w.evil_answer_mb << 20,
                           model=EVIL_MODEL) as evil:
                pool = rogue_pool(t.allocator, ATTACKER, t.attacker_url, EVIL_MODEL, t.attacker_token)
                evil.identity = pool.identity
                try:
                    deadline = time.monotonic() + 30
                    while _metric(t.router, "pagedkv_router_workers") < workers + 1:
                        if time.monotonic() > deadline:
                            raise RuntimeError("the router did not prove the evil worker's pool within 30 s")
                        time.sleep(0.1)
                    rss_before = psutil.Process(t.stack.router.pid).memory_info().rss / 2**20
                    t0 = time.monotonic()
                    with concurrent.futures.ThreadPoolExecutor(w.evil_answers) as ex:
                        passed = list(ex.map(lambda _: _evil_answer(t.router), range(w.evil_answers)))
                    rss_peak, _ = sampler.peak(t0, time.monotonic())
                    with concurrent.futures.ThreadPoolExecutor(2) as ex:
                        whole, stream = ex.map(lambda s: _trickled(t.router, s, 3 * timeout + 30), (False, True))
                finally:
                    pool.close()
        finally:
            sampler.stop()
        held = timeout + TRICKLE_SLACK_S
        return {"answers": w.evil_answers, "answer_mb": w.evil_answer_mb,
                "mb_passed_each": [round(b / 2**20, 1) for b in passed], "router_rss_mib_before": round(rss_before, 1),
                "router_rss_mib_peak": rss_peak, "first_byte_timeout_s": timeout,
                "trickled_whole": whole, "trickled_stream": stream,
                "reached": (rss_peak or 0) - rss_before >= w.evil_answer_mb
                or whole["seconds"] > held or whole["ended"] != "504 worker_timeout"
                or stream["seconds"] > held or stream["ended"] != "worker_timeout"}

    return _running(work)


def _evil_answer(router: str) -> int:
    """Bytes of an evil worker's huge answer that reached the client through the router."""
    import httpx

    got = 0
    with contextlib.suppress(httpx.HTTPError), httpx.stream(
            "POST", f"{router}/v1/completions", timeout=120, json={"model": EVIL_MODEL, "prompt": "huge"}) as r:
        for chunk in r.iter_raw():
            got += len(chunk)
    return got


def _trickled(router: str, stream: bool, limit_s: float) -> dict:
    """An evil worker's answer trickled a byte at a time after its status, through the
    router: how long the client was held and how it ended (a whole answer's status and
    error code; a stream's last error event's code, or "cut", "done", "timeout")."""
    import httpx

    body = {"model": EVIL_MODEL, "prompt": "trickle-stream" if stream else "trickle", "stream": stream}
    t0 = time.monotonic()
    try:
        if not stream:
            r = httpx.post(f"{router}/v1/completions", json=body, timeout=limit_s)
            code = r.json().get("error", {}).get("code") if r.headers.get("content-type", "").startswith(
                "application/json") else None
            ended = f"{r.status_code} {code}"
        else:
            ended = "cut"
            with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=limit_s) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        ended = "done" if ended == "cut" else ended
                    elif line.startswith("data: {") and '"error"' in line:
                        ended = str(json.loads(line[len("data: "):])["error"].get("code"))
    except httpx.TimeoutException:
        ended = "timeout"
    except (httpx.HTTPError, ValueError) as exc:
        ended = f"error: {exc!r}"[:120]
    return {"seconds": round(time.monotonic() - t0, 2), "ended": ended}


ATTACK_NAMES: dict[str, Callable[[Target, AttackWorkload], contextlib.AbstractContextManager[dict]]] = {
    "rogue-pool": rogue_pool,
    "idle-connections": idle_connections,
    "slow-clients": slow_clients,
    "big-tokenize": big_tokenize,
    "slow-read-flood": slow_read_flood,
    "snapshot-amplification": snapshot_amplification,
    "snapshot-watchers": snapshot_watchers,
    "prompt-reading": prompt_reading,
    "store-poisoning": store_poisoning,
    "evil-worker": evil_worker,
}


# -- what every attack shares: probes, the victim, the allocator's figures -------------------------


def _metric(url: str, name: str) -> float:
    return sum(s.value for s in harness.metric_samples(url) if s.name == name)


class _Prober:
    """GET `url` every 50 ms in a thread: failures and the longest wait."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.waits: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Prober:
        self._thread.start()
        return self

    def _run(self) -> None:
        import httpx

        with httpx.Client() as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get(self.url, timeout=30).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.waits.append(time.perf_counter() - t0)
                self.failed += not ok
                self._stop.wait(0.05)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(60)
        return {"health_probes": len(self.waits), "health_failed": self.failed,
                "health_max_wait_ms": _ms(max(self.waits, default=None))}


def _victim(allocator: str, token: str | None, router: str, worker: str, seqs: int, max_tokens: int,
            stop, ready, conn) -> None:
    """The victim's process: a pool's decode loop of Steps and a loop of
    router requests, until `stop`; then every sample through `conn`:
    steps and requests as (start, seconds, error or "", and for requests
    the worker that answered)."""
    import httpx

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import PoolConfig, blocks_for
    from pagedkv.bench.workloads import MAX_GEN, PROMPT_LEN, decode_steps

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    want = httpx.post(worker + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    steps: list[tuple[float, float, str]] = []
    requests: list[tuple[float, float, str, str]] = []

    def step_loop() -> None:
        config = PoolConfig(seqs * (blocks_for(PROMPT_LEN + MAX_GEN, 16) + 2) + 64, 16, True, "bench")
        pool = GrpcAllocator(allocator, PoolSpec("victim", config), auth_token=token)
        gen = decode_steps(seqs, seed=1)
        pool.step(next(gen))
        ready.set()
        while not stop.is_set():
            ops = next(gen)
            t0 = time.monotonic()
            try:
                results = pool.step(ops)
                error = "" if results.all_ok else f"refused: {next(r for r in results if not r.ok)}"[:200]
            except Exception as exc:  # noqa: BLE001 - a lost Step is a figure
                error = repr(exc)[:200]
                gen = decode_steps(seqs, seed=int(t0))  # the pool may be a fresh one: start over
            steps.append((t0, time.monotonic() - t0, error))
            time.sleep(STEP_PAUSE_S)
        pool.close()

    def request_loop() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                t0 = time.monotonic()
                answered_by, error = "", ""
                try:
                    r = client.post(router + "/v1/completions", json=body, timeout=60)
                    answered_by = r.headers.get("x-pagedkv-worker", "")
                    if r.status_code != 200:
                        error = f"{r.status_code}: {r.text[:150]}"
                    elif (text := r.json()["choices"][0]["text"]) != want:
                        error = f"answered {text!r}, not the worker's {want!r}"
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    error = repr(exc)[:200]
                requests.append((t0, time.monotonic() - t0, error, answered_by))
                stop.wait(REQUEST_PAUSE_S)

    threads = [threading.Thread(target=step_loop), threading.Thread(target=request_loop)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    conn.send({"steps": steps, "requests": requests})
    conn.close()


class _Sampler:
    """The allocator's RSS and thread count every SAMPLE_S, as (time, MiB, threads)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self._proc.memory_info().rss / 2**20, self._proc.num_threads()))
            except psutil.Error:
                return
            self._stop.wait(SAMPLE_S)

    def peak(self, t0: float, t1: float) -> tuple[float | None, int | None]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None, None
        return round(max(s[1] for s in inside), 1), max(s[2] for s in inside)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _window(samples: dict, t0: float, t1: float, workers: set[str]) -> dict:
    steps = [s for s in samples["steps"] if t0 <= s[0] < t1]
    requests = [r for r in samples["requests"] if t0 <= r[0] < t1]
    return {
        "steps": len(steps), "step_p99_ms": _ms(harness.percentile((s[1] for s in steps), 0.99)),
        "requests": len(requests), "request_p99_ms": _ms(harness.percentile((r[1] for r in requests), 0.99)),
        "errors": [s[2] for s in steps if s[2]] + [r[2] for r in requests if r[2]],
        "answered_by_others": sum(r[3] not in workers for r in requests if not r[2] or r[3]),
    }


def _stack_run(kind: str, w: AttackWorkload, names: list[str]) -> dict:
    from pagedkv.stack import LocalStack

    credentials = kind == "credentials"
    env = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": str(w.snapshot_every),
           "PAGEDKV_ROUTER_HEADER_TIMEOUT": str(w.router_header_timeout_s),
           "PAGEDKV_ROUTER_BODY_TIMEOUT": str(w.router_body_timeout_s),
           "PAGEDKV_ROUTER_FIRST_BYTE_TIMEOUT": str(w.router_first_byte_timeout_s)}
    # the attacker's address, held from now on (its token is bound to it), and the store's folder
    attacker = socket.create_server(("127.0.0.1", 0))
    store_dir = Path(tempfile.mkdtemp(prefix="pagedkv-attacks-store-"))
    attacker_url = f"http://127.0.0.1:{attacker.getsockname()[1]}"
    try:
        with LocalStack(2, MODEL, worker_args=WORKER_ARGS, router=True, redis=True, credentials=credentials,
                        guest_workers=[(ATTACKER, attacker_url)] if credentials else (), env=env,
                        allocator_args=["--kv-shared-store", f"file://{store_dir}", "--kv-shared-store-size",
                                        STORE_GIB], startup_timeout=300.0) as stack:
            return _run_attacks(stack, kind, attacker, store_dir, w, names)
    finally:
        attacker.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _run_attacks(stack, kind: str, attacker: socket.socket, store_dir: Path, w: AttackWorkload,
                 names: list[str]) -> dict:
    """The victim and each attack in turn against a started stack; its rows and the victim's totals."""
    credentials = kind == "credentials"

    def secret(name: str) -> str | None:
        return (Path(stack.log_dir) / name).read_text().strip() if credentials else None

    attacker_key = secret(f"{ATTACKER}.store-key")
    target = Target(stack, credentials, secret("worker-1.token"), secret("admin-token"),
                    secret(f"{ATTACKER}.token"), attacker_key.encode() if attacker_key else None, attacker, store_dir)
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    mine, theirs = ctx.Pipe(duplex=False)
    victim = ctx.Process(target=_victim, daemon=True,
                         args=(target.allocator, target.admin_token, target.router, target.worker,
                               w.victim_seqs, w.router_max_tokens, stop, ready, theirs))
    victim.start()
    sampler = _Sampler(stack.allocator.pid)
    windows = []
    try:
        if not ready.wait(120):
            raise RuntimeError("the victim did not start")
        for name in names:
            harness.log("attacks", f"{kind}: {name}")
            b0 = time.monotonic()
            time.sleep(w.baseline_s)
            a0 = time.monotonic()
            try:
                with ATTACK_NAMES[name](target, w) as details:
                    time.sleep(w.attack_s)
            except Exception as exc:  # noqa: BLE001 - an attack that broke is reported, the run goes on
                details = {"attack_error": repr(exc)[:300]}
            a1 = time.monotonic()
            alive = {n: p.alive() for n, p in stack.processes.items()}
            windows.append((name, b0, a0, a1, details, alive))
        time.sleep(w.baseline_s)  # the victim's last window after the last attack
    finally:
        stop.set()
        samples = mine.recv() if mine.poll(120) else {"steps": [], "requests": []}
        victim.join(60)
        sampler.stop()
    rows = []
    ours = {worker.worker_id for worker in stack.workers}
    for name, b0, a0, a1, details, alive in windows:
        base, during = _window(samples, b0, a0, ours), _window(samples, a0, a1, ours)
        rss_base, threads_base = sampler.peak(b0, a0)
        rss, threads = sampler.peak(a0, a1)
        reached = details.pop("reached", None)
        refused = details.pop("refused", {})
        died = sorted(n for n, up in alive.items() if not up)
        errors = during["errors"]
        rows.append({
            "attack": name, "seconds": round(a1 - a0, 1),
            "baseline": {k: v for k, v in base.items() if k != "errors"},
            "during": {k: v for k, v in during.items() if k != "errors"},
            "allocator_rss_mib_peak": rss, "allocator_threads_peak": threads,
            "allocator_rss_mib_baseline": rss_base, "allocator_threads_baseline": threads_base,
            "reached": reached, "victim_errors": len(errors), "errors": errors[:KEPT_ERRORS],
            "exited": died, "refused": refused, "details": details,
            "succeeded": bool(reached) or bool(errors) or bool(died) or during["answered_by_others"] > 0,
        })
    every = _window(samples, float("-inf"), float("inf"), ours)
    return {"attacks": rows, "victim": {"steps": every["steps"], "requests": every["requests"],
                                        "errors": len(every["errors"]), "first_errors": every["errors"][:KEPT_ERRORS]}}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    w = ATTACKS[args.workload]
    stacks = {kind: _stack_run(kind, w, args.attacks) for kind in STACKS}
    return {"workload": {"name": args.workload, **{k: v for k, v in asdict(w).items() if k != "what"},
                         "what": w.what, "model": MODEL, "worker_args": WORKER_ARGS},
            "stacks": stacks}


def tables(report: dict) -> list[Table]:
    rows, notes = [], []
    for kind, run in report["stacks"].items():
        for r in run["attacks"]:
            b, d = r["baseline"], r["during"]
            rows.append([kind, r["attack"], cell(b["step_p99_ms"], ".2f"), cell(d["step_p99_ms"], ".2f"),
                         cell(b["request_p99_ms"], ".1f"), cell(d["request_p99_ms"], ".1f"),
                         cell(r["allocator_rss_mib_peak"], ".1f"), cell(r["allocator_threads_peak"]),
                         "yes" if r["succeeded"] else "no", cell(r["victim_errors"]), cell(sum(r["refused"].values()))])
            said = [f"refused {k} {v}" for k, v in sorted(r["refused"].items())]
            if r["attack"] not in OWN_TABLES:
                said += [f"{k} {v}" for k, v in r["details"].items()]
            if said:
                notes.append(f"{kind}, {r['attack']}: " + ", ".join(said))
            notes += [f"{kind}, {r['attack']}: victim error: {e}" for e in r["errors"]]
        v = run["victim"]
        notes.append(f"{kind}: the victim sent {v['steps']} Steps and {v['requests']} router requests; "
                     f"{v['errors']} failed")
    w = report["workload"]
    head = [f"workload {w['name']}: {w['what']}.",
            "p99 before: the victim alone in the seconds before the attack; during: while it ran. Succeeded: the "
            "attack's aim was reached, or the victim lost a Step or a request, or a process exited."]
    tables_ = [Table("attacks on a stack with credentials and one without",
                     ["stack", "attack", "Step p99 before ms", "during", "router p99 before ms", "during",
                      "allocator RSS MiB", "threads", "succeeded", "victim errors", "refused"],
                     rows, head + notes)]
    flood = [[kind, cell(d["connections"]), cell(d["metrics_p50_ms_before"], ".1f"),
              cell(d["metrics_max_ms_before"], ".1f"), cell(d["metrics_p50_ms_during"], ".1f"),
              cell(d["metrics_max_ms_during"], ".1f"), cell(d["metrics_failed_during"]), cell(d["threads_before"]),
              cell(d["threads_with_them"])]
             for kind, run in report["stacks"].items() for r in run["attacks"]
             if r["attack"] == "idle-connections" and "metrics_probes" in (d := r["details"])]
    if flood:
        tables_.append(Table(
            "the allocator's /metrics before and during the idle-connection flood on its HTTP port",
            ["stack", "idle connections", "/metrics p50 before ms", "max before", "p50 during", "max during",
             "failed", "allocator threads before", "with them"],
            flood, [f"{METRICS_PROBES} GETs of /metrics before the connections open and {METRICS_PROBES} while they "
                    f"are open, a new connection each; failed: not a 200 within 10 s; target: every one within "
                    f"{METRICS_TARGET_S:g} s."]))
    store = {kind: {r["attack"]: r for r in run["attacks"]} for kind, run in report["stacks"].items()}
    rows = []
    for kind, got in store.items():
        p, d = got.get("store-poisoning"), got.get("prompt-reading")
        if p is None and d is None:
            continue
        pd, dd = (p or {}).get("details", {}), (d or {}).get("details", {})
        refused = ", ".join(f"{k} {v}" for k, v in sorted(p["refused"].items())) if p else None
        changed = (f"{pd['answers_changed_planted'] + pd['answers_changed_overwritten']} of {pd['victim_prompts']}"
                   if "victim_prompts" in pd else None)
        rows.append([kind, cell(pd.get("entries_planted")), cell(pd.get("victim_tokens_from_planted")),
                     cell(pd.get("entries_overwritten")), cell(pd.get("victim_tokens_from_overwritten")),
                     cell(changed), cell(refused or ("0" if p else None)), cell(dd.get("entries_read")),
                     cell(dd.get("entries_decoded")), cell(dd.get("tokens_recovered")),
                     cell(None if "secret_read_back" not in dd else "yes" if dd["secret_read_back"] else "no")])
    if rows:
        tables_.append(Table(
            "the shared store against a worker of another group and whoever reads or writes its files",
            ["stack", "entries planted", "victim tokens loaded from them", "entries overwritten",
             "victim tokens loaded from them", "answers changed", "entries refused", "entries read", "decoded",
             "tokens recovered", "secret read back"],
            rows, ["Store poisoning: the attacker's pool plants forged entries for prompts worker-1 is then sent "
                   "(admit, free, forged K/V under a valid header and checksum, the save confirmed); then it "
                   "writes forged entries over every entry file once worker-2 has computed other prompts, and "
                   "worker-1 is sent those. Victim tokens: worker-1's prompt tokens loaded from the shared store; "
                   "answers changed: its greedy answers that differ from the same prompt computed under a fresh "
                   "salt; entries refused: what worker-1 refused to load, by reason.",
                   "Prompt reading: worker-1 is sent a salted tenant's prompt holding a secret; every entry "
                   "file of the store is decoded without a key and each decoded block's layer-0 V rows mapped "
                   "back to tokens with the public weights.",
                   "With credentials the attacker is a worker of another store group (its own worker token and "
                   "store key); without, every pool shares one unsealed namespace (the documented trust domain)."]))
    rows = []
    for kind, got in store.items():
        e = got.get("evil-worker")
        if e is None or "answers" not in (d := e["details"]):
            continue
        rows.append([kind, f"{d['answers']} x {d['answer_mb']}", cell(min(d["mb_passed_each"]), ".1f"),
                     cell(d["router_rss_mib_before"], ".1f"), cell(d["router_rss_mib_peak"], ".1f"),
                     d["trickled_whole"]["ended"], cell(d["trickled_whole"]["seconds"], ".2f"),
                     d["trickled_stream"]["ended"], cell(d["trickled_stream"]["seconds"], ".2f"),
                     cell(d["first_byte_timeout_s"], "g")])
    if rows:
        tables_.append(Table(
            "an evil worker behind the router: huge and trickled answers",
            ["stack", "answers x MB at once", "MB passed each (least)", "router RSS MiB before", "peak",
             "trickled whole answer", "client held s", "trickled stream", "client held s", "first-byte timeout s"],
            rows, ["The attacker's pool, proven to the router by a server of its own at its address: answers "
                   "with no end of body (the router passes them on as they come; it cuts one at "
                   "PAGEDKV_ROUTER_MAX_ANSWER_MB, or once it has waited its first-byte timeout in all for the "
                   "body), and a whole answer and a stream trickled a byte every 0.1 s after their status (ended "
                   "by the router's first-byte timeout: 504 worker_timeout, or an error event)."]))
    return tables_


def run(args: argparse.Namespace) -> int:
    return harness.run("attacks", args, measure, tables)
