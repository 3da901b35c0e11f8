"""The compose test runs only when asked for: `python -m pytest -m compose`.

It builds images and starts a Docker engine (minutes), so a plain `pytest`
(`make test`) skips it and says how to run it; `-m compose` selects it."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "compose" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(
        reason="skipped: the compose test runs with `python -m pytest -m compose` "
        "(it builds the images and starts a Docker engine; .ci/run does it)"
    )
    for item in items:
        if item.get_closest_marker("compose") is not None:
            item.add_marker(skip)
