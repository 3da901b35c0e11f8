"""Pause points in the core's long loops.

The core is single-threaded and knows nothing of who runs it. Its loops over
a whole pool (an integrity check, a dump, the hash chain of a long prompt)
call `pace()` between chunks of work. By default that does nothing; a
service that runs many pools in one process installs, for the thread doing
the work, a function that may wait there (the allocator's per-pool CPU fair
share, `allocator_service/fair_share.py`), so one pool's long call can step
aside while another pool's short one runs. A pause point is always between
two whole pieces of work, so waiting there changes no result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

# Work between two pause points: small enough that another pool's call
# waits little for the next one, large enough that the check costs nothing.
CHUNK = 512

_local = threading.local()


def pace() -> None:
    """A point where the running thread may wait (see the module docstring)."""
    pacer = getattr(_local, "pacer", None)
    if pacer is not None:
        pacer()


@contextmanager
def pacing(pacer: Callable[[], None]) -> Iterator[None]:
    """Run the block with `pacer` called at every pause point of this thread."""
    before = getattr(_local, "pacer", None)
    _local.pacer = pacer
    try:
        yield
    finally:
        _local.pacer = before


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    """`items` as slices of `size`, with a pause point before each: a long
    loop written `for part in chunks(xs): for x in part: ...` (per item it
    costs nothing; a generator per item would)."""
    for start in range(0, len(items), size):
        pace()
        yield items[start : start + size]


class Unpaced:
    """A lock under which the holder's pause points do nothing: a thread that
    holds a lock every other call may need (the service's mutation lock,
    held through a reload's replay) must never wait there for those calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pacer: Callable[[], None] | None = None  # the holder's, restored on release

    def __enter__(self) -> Unpaced:
        self._lock.acquire()
        self._pacer = getattr(_local, "pacer", None)
        _local.pacer = None
        return self

    def __exit__(self, *exc: object) -> None:
        _local.pacer = self._pacer
        self._lock.release()
