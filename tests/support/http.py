"""Reading a worker over HTTP (the worker processes are a fixture: tests/conftest.py)."""

from __future__ import annotations

import httpx


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None
