"""The clients of `pagedkv bench restart`: greedy requests of every kind (prompt, streamed or not,
chat or completion) kept going against the workers while the allocator is restarted, each
outcome checked against the text of a run with no restart."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.bench import harness

PROMPTS = [
    "sys: hello",
    "sys: what is a page",
    "sys: blocks and tables",
    "sys: one two three",
    "sys: quick brown fox",
    "sys: a paged kv cache",
    "sys: restart me",
    "sys: the journal",
]
MAX_TOKENS = 16
CLIENTS_PER_WORKER = 4
REQUEST_TIMEOUT_S = 300.0
KEPT_FAILURES = 10


@dataclass(frozen=True, slots=True)
class Kind:
    """What a request is: which prompt, streamed or not, chat or completion."""

    prompt: int
    stream: bool
    chat: bool


@dataclass(slots=True)
class Outcome:
    kind: Kind
    worker: int
    status: int  # 0: no HTTP answer, or a stream cut before [DONE]
    text: str
    latency_s: float
    error: str = ""
    started: float = 0.0  # monotonic, for reading it against the restarts


def request(client, url: str, model: str, kind: Kind) -> tuple[int, str, str]:
    """(status, text, error) of one greedy request; never raises."""
    import httpx

    body: dict[str, Any] = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": kind.stream,
    }
    prompt = PROMPTS[kind.prompt]
    if kind.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    try:
        if not kind.stream:
            r = client.post(url + path, json=body, timeout=REQUEST_TIMEOUT_S)
            if r.status_code != 200:
                return r.status_code, "", r.text[:300]
            choice = r.json()["choices"][0]
            return 200, choice["message"]["content"] if kind.chat else choice["text"], ""
        parts: list[str] = []
        with client.stream("POST", url + path, json=body, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                return r.status_code, "", r.read().decode(errors="replace")[:300]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return 200, "".join(parts), ""
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 0, "".join(parts), f"error event: {json.dumps(chunk['error'])[:300]}"
                for c in chunk.get("choices", ()):
                    parts.append(
                        (c.get("delta", {}).get("content") or "")
                        if kind.chat
                        else c.get("text", "")
                    )
        return 0, "".join(parts), "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return 0, "", repr(exc)[:300]


KINDS = [Kind(p, s, c) for p in range(len(PROMPTS)) for s in (False, True) for c in (False, True)]


def reference_texts(urls: list[str], model: str) -> dict[tuple[int, bool], str]:
    """(prompt, chat) -> the text with no restart: each asked once, not streamed, of the first
    worker (the workers serve the same model: the other must give the same)."""
    import httpx

    out = {}
    with httpx.Client() as client:
        for kind in KINDS:
            if kind.stream:
                continue
            status, text, error = request(client, urls[0], model, kind)
            if status != 200:
                raise RuntimeError(
                    f"the reference request failed before any restart: {status} {error}"
                )
            out[(kind.prompt, kind.chat)] = text
    return out


class Load:
    """Client threads that keep the workers busy until `stop()`; every outcome kept."""

    def __init__(self, urls: list[str], model: str, seed: int) -> None:
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._client,
                args=(urls, w, model, random.Random(seed * 1000 + i)),
                name=f"restart-load-{i}",
                daemon=True,
            )
            for i, w in enumerate(w for w in range(len(urls)) for _ in range(CLIENTS_PER_WORKER))
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _client(self, urls: list[str], worker: int, model: str, rng: random.Random) -> None:
        import httpx

        with httpx.Client() as client:
            while not self._stop.is_set():
                kind = rng.choice(KINDS)
                t0 = time.monotonic()
                status, text, error = request(client, urls[worker], model, kind)
                with self._lock:
                    self.outcomes.append(
                        Outcome(kind, worker, status, text, time.monotonic() - t0, error, t0)
                    )

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 10)


def worker_counters(urls: list[str]) -> list[dict[str, float]]:
    names = {
        "pagedkv_worker_allocator_unavailable_seconds_total": "stall_s",
        "pagedkv_worker_allocator_retries_total": "retries",
        "pagedkv_worker_step_errors_total": "step_errors",
        "pagedkv_worker_preemptions_total": "preemptions",
    }
    out = []
    for url in urls:
        row = dict.fromkeys(names.values(), 0.0)
        for s in harness.metric_samples(url):
            if s.name in names:
                row[names[s.name]] += s.value
        out.append(row)
    return out


def outcome_figures(
    outcomes: list[Outcome], reference, before, after, t_start: float
) -> dict[str, Any]:
    """The request figures of a run: counts, failures and wrong
    texts, latency, the workers' counters."""
    failed = [o for o in outcomes if o.status != 200]
    wrong = [
        o for o in outcomes if o.status == 200 and o.text != reference[(o.kind.prompt, o.kind.chat)]
    ]
    per_worker = [{k: round(a[k] - b[k], 3) for k in a} for a, b in zip(after, before, strict=True)]

    def kept(rows: list[Outcome]) -> list[dict]:
        return [
            {
                "worker": o.worker,
                "prompt": o.kind.prompt,
                "stream": o.kind.stream,
                "chat": o.kind.chat,
                "status": o.status,
                "error": o.error,
                "text": o.text,
                "expected": reference[(o.kind.prompt, o.kind.chat)],
                "at_s": round(o.started - t_start, 2),
            }
            for o in rows[:KEPT_FAILURES]
        ]

    latencies = [o.latency_s for o in outcomes]
    return {
        "requests": len(outcomes),
        "streamed": sum(o.kind.stream for o in outcomes),
        "failed_requests": len(failed),
        "wrong_texts": len(wrong),
        "latency_s_p50": round_or_none(harness.percentile(latencies, 0.5)),
        "latency_s_max": round_or_none(max(latencies, default=None)),
        "stall_s": round(sum(w["stall_s"] for w in per_worker), 2),
        "retries": sum(w["retries"] for w in per_worker),
        "step_errors": sum(w["step_errors"] for w in per_worker),
        "preemptions": sum(w["preemptions"] for w in per_worker),
        "per_worker": per_worker,
        "failures": kept(failed),
        "wrong": kept(wrong),
    }


def round_or_none(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
