"""Helpers of the reliability drills (tests/drills/).

A `Stack` is the serving topology as REAL processes (`pagedkv.stack.LocalStack`),
each of which a drill can kill -9 and start again on the same address: an
optional private Redis (append-only), the allocator (`python -m
allocator_service`) and N workers (`python -m worker`, tiny-random model) on
loopback ports. Every figure a
drill reports comes from here: request outcomes with their latency, worker
and allocator metrics, the resident memory of each process, and the
allocator's exact state rebuilt from its Redis journal (the journal is
written before memory changes, so it is what the allocator holds).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pagedkv.stack import LocalStack

MODEL = "tiny-random"


# ------------------------------------------------------------------ processes
def rss_bytes(pid: int) -> int:
    """Resident set size of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_for(check, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll `check()` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


# The workers' shared token: a drill's own extra pools register with it too (`Stack.token`).
POOLS_TOKEN = "drill-pools-token"


class Stack(LocalStack):
    """The drills' topology: `pagedkv.stack.LocalStack` with the tiny model, quiet
    workers, a private Redis by default (the drill is skipped without
    redis-server), and the readings the drills report."""

    def __init__(
        self,
        workers: int = 2,
        *,
        worker_args: Sequence[str] = (),
        allocator_args: Sequence[str] = (),
        redis: bool = True,
        token: str | None = None,
        tls: tuple[Path, Path] | None = None,
        env: dict[str, str] | None = None,
        standby: bool = False,
    ) -> None:
        if redis and shutil.which("redis-server") is None:
            pytest.skip("skipped: needs redis-server on PATH (Debian package redis-server)")
        # "--threads 1/1": every core per worker, torch's default, not the stack's
        # share. The drills' faults must land mid-workload and their workloads
        # are sized for that pace; with the cores divided a worker got through
        # them in 0.6 s, before the fault (the Redis kill drill then saw no retry).
        super().__init__(
            workers,
            MODEL,
            worker_args=["--log-level", "warning", "--threads", "1/1", *worker_args],
            allocator_args=allocator_args,
            redis=redis,
            token=token or POOLS_TOKEN,
            tls=tls,
            startup_timeout=120.0,
            grace=15.0,
            env=env,
            standby=standby,
        )

    # ------------------------------------------------------------ faults
    def kill_allocator(self) -> None:
        self.allocator.kill()

    def start_allocator(self) -> None:
        """Again on the same port (and metrics port), with the same state."""
        self.allocator.start().wait_healthy(30)

    def kill_redis(self) -> None:
        """SIGKILL redis-server (its append-only file stays)."""
        self.redis.kill()

    def start_redis(self) -> None:
        self.redis.start().wait_healthy(15)

    # ------------------------------------------------------------ reading
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.processes.items()}

    def rss(self) -> dict[str, int]:
        return {name: rss_bytes(pid) for name, pid in self.pids().items()}

    def allocator_metrics(self) -> Samples:
        return scrape(self.allocator_metrics_url)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until every worker runs nothing and holds no block (the frees of
        the last requests go out with one more engine step)."""

        def idle():
            return all(
                (m := scrape(f"{w.url}/metrics")).value("pagedkv_worker_kv_blocks_used") == 0
                and m.value("pagedkv_worker_running_sequences") == 0
                and m.value("pagedkv_worker_waiting_sequences") == 0
                for w in self.workers
            )

        wait_for(idle, timeout_s, "the workers to be idle", 0.2)

    def close(self) -> None:
        self.stop()


# ------------------------------------------------------------------ metrics
@dataclass
class Samples:
    """One Prometheus scrape: (name, labels) -> value."""

    items: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        return sum(
            v
            for n, lab, v in self.items
            if n == name and all(lab.get(k) == x for k, x in labels.items())
        )

    def labels(self, name: str, key: str) -> set[str]:
        return {lab[key] for n, lab, _ in self.items if n == name and key in lab}


def scrape(url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    return Samples(
        [
            (s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
    )


def error_requests(samples: Samples) -> float:
    """Requests a worker ended other than normally ("abort": failed or dropped; "error")."""
    return samples.value("pagedkv_worker_requests_total", finish_reason="abort") + samples.value(
        "pagedkv_worker_requests_total", finish_reason="error"
    )


# ------------------------------------------------------------------ requests
@dataclass
class Result:
    status: int
    text: str = ""
    latency_s: float = 0.0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""


def complete(
    url: str,
    prompt: str,
    max_tokens: int,
    *,
    stream: bool = False,
    chat: bool = False,
    salt: str | None = None,
    timeout_s: float = 120.0,
    client: httpx.Client | None = None,
) -> Result:
    """One greedy request (ignore_eos, so exactly `max_tokens` tokens); its
    outcome, never an exception (a transport failure is status 0)."""
    body: dict = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if salt is not None:
        body["cache_salt"] = salt
    if stream:
        body["stream_options"] = {"include_usage": True}
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    t0 = time.monotonic()
    try:
        if not stream:
            r = client.post(url + path, json=body, timeout=timeout_s)
            if r.status_code != 200:
                return Result(r.status_code, latency_s=time.monotonic() - t0, error=r.text[:500])
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            return Result(200, text, time.monotonic() - t0, cached, choice["finish_reason"])
        parts: list[str] = []
        cached, reason, done = 0, None, False
        with client.stream("POST", url + path, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return Result(
                    r.status_code, latency_s=time.monotonic() - t0, error=r.read().decode()[:500]
                )
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                for c in chunk.get("choices", ()):
                    parts.append(
                        (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
                    )
                    reason = c.get("finish_reason") or reason
        if not done:
            return Result(
                0, "".join(parts), time.monotonic() - t0, error="stream ended without [DONE]"
            )
        return Result(200, "".join(parts), time.monotonic() - t0, cached, reason)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Result(0, latency_s=time.monotonic() - t0, error=repr(exc))
    finally:
        if own:
            client.close()


@dataclass
class Job:
    worker: int  # index into Stack.workers
    prompt: int  # index into the prompt list
    stream: bool
    chat: bool = False


def run_jobs(
    stack: Stack, prompts: Sequence[str], jobs: Sequence[Job], max_tokens: int, during=None
) -> tuple[list[Result], dict]:
    """Send every job at once (one thread each); `during()` runs meanwhile
    (the fault) and its return value is handed back."""
    results: list[Result | None] = [None] * len(jobs)

    def one(i: int) -> None:
        j = jobs[i]
        results[i] = complete(
            stack.workers[j.worker].url, prompts[j.prompt], max_tokens, stream=j.stream, chat=j.chat
        )

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    fault = during() if during is not None else {}
    for t in threads:
        t.join(300)
    assert all(r is not None for r in results), "a request thread did not finish"
    return results, fault


def reference_texts(prompts: Sequence[str], max_tokens: int, chat: bool = False) -> list[str]:
    """Greedy texts of a fault-free run: the offline engine, in this process,
    synchronous (`--no-async-scheduling`): the drills' workers pipeline their
    allocator calls (the default) and must produce the same texts."""
    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.model.loader import load_model

    loaded = load_model(MODEL)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=1024, block_size=4, async_scheduling=False))
    if chat:
        inputs = [
            loaded.tokenizer.encode_chat(
                [{"role": "user", "content": p}], add_generation_prompt=True
            )
            for p in prompts
        ]
    else:
        inputs = list(prompts)
    outs = engine.generate(
        inputs, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    engine.close()
    return [o.text for o in outs]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def report(name: str, figures: dict) -> None:
    """The drill's figures as one JSON line (`pytest -s` shows it)."""
    print(f"\nDRILL {json.dumps({'drill': name, **figures}, sort_keys=True)}", flush=True)


# ------------------------------------------------------------------ allocator state
def journal_state(redis_url: str):
    """(Registry rebuilt from the snapshot and journal in Redis, the journal
    records after the snapshot). The allocator writes the journal before it
    changes memory, so this is its state (read it while nothing runs). The
    journal must verify: every digest and chain sound."""
    import redis

    from allocator_service.store.events import EventLog
    from allocator_service.store.framing import record_bytes
    from allocator_service.store.journal import split_prefix
    from allocator_service.store.replay import replay
    from allocator_service.wire.v1 import journal_pb2 as jpb

    url, prefix = split_prefix(redis_url)
    client = redis.Redis.from_url(url)
    try:
        with client.pipeline(transaction=True) as p:
            p.get(prefix + "snapshot")
            p.lrange(prefix + "journal", 0, -1)
            p.get(prefix + "head")
            snap, raw, head = p.execute()
    finally:
        client.close()
    registry, check = replay(snap, raw, head, EventLog(1 << 16))
    assert check.sound, [str(p) for p in check.problems]
    records = [jpb.JournalRecord.FromString(record_bytes(r)) for r in raw]
    return registry, records


def check_no_leak(redis_url: str, live_pools: Sequence[str]) -> dict[str, dict]:
    """Every pool in the journal's state is intact, holds no sequence and no
    used block (every block free or cached), and the live pools are these."""
    registry, _ = journal_state(redis_url)
    assert sorted(registry.pools) == sorted(live_pools)
    out = {}
    for pool_id, entry in registry.pools.items():
        pool = entry.pool
        assert pool.integrity_problems() == [], pool_id
        s = pool.stats()
        assert s.used_blocks == 0 and s.num_sequences == 0, (pool_id, s)
        assert s.free_blocks == s.num_blocks, (pool_id, s)
        out[pool_id] = {
            "blocks": s.num_blocks,
            "cached": s.cached_blocks,
            "last_step_id": entry.last_step_id,
        }
    return out


# ------------------------------------------------------------------ TLS
def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost/127.0.0.1 and its key: with the
    `cryptography` package when installed, else the `openssl` CLI; skips the
    test when neither is there."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip(
                "skipped: making a TLS certificate needs the "
                "`cryptography` package or the openssl CLI"
            )
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )
        return cert, key
    pk = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    crt = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pk.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(pk, hashes.SHA256())
    )
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        pk.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key
