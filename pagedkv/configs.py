"""Every component's configuration, by name: what the configuration reference is made from.

`reference_markdown(component)`: the table of one component's settings (flag,
environment variable, default, help), rendered from its config dataclass.
"""

from __future__ import annotations

from allocator_service.cli import AllocatorArgs
from pagedkv.stack.config import UpArgs
from pagedkv_base import config
from router.cli import RouterArgs
from worker.cli import WorkerArgs

CONFIGS: dict[str, type] = {c.component: c for c in (AllocatorArgs, WorkerArgs, RouterArgs, UpArgs)}


def reference_markdown(component: str) -> str:
    """The reference table of `component` ("allocator", "worker", "router" or "up")."""
    try:
        return config.reference_markdown(CONFIGS[component])
    except KeyError:
        raise ValueError(f"no component {component!r} (one of {', '.join(CONFIGS)})") from None
