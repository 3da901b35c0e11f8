"""Reading a worker over HTTP (the worker processes are a fixture: tests/conftest.py)."""

from __future__ import annotations

import httpx
import openai


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def openai_client(url: str, api_key: str = "unused", timeout: float = 120):
    """The official client for a worker or router at `url`, no retries of its own."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
