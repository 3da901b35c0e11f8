"""The journal anchor: the last record this instance wrote, kept in a file of
its own outside the state store (`journal_anchor_file`), so that a state store
rolled back to an older valid state, or holding another history under the
same journal key, is caught at load instead of served.

The file holds one head marker (`framing.head_marker`: `<index>:<chain hex>`)
and is replaced whole (written beside it, then renamed). `JournalAnchor.note`
writes it at most once per `every_s` on the hot path, and at once where the
history is rewritten (a load, a reseed); so it may lag the journal by that
long, and a rollback within the last `every_s` is left to the workers' step
chains (`prev_step_id`). Replay (`replay.Replayer`) checks it: the anchored
record must be in what is replayed with the same chain digest (or under the
snapshot, which only the key's holder could have written).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from allocator_service.store.framing import head_marker
from allocator_service.store.registry import CorruptState


class Anchor(NamedTuple):
    index: int
    chain: bytes


def read_anchor(path: Path) -> Anchor | None:
    """The anchor in `path`; None when there is no file (nothing written
    yet); CorruptState when it is not a head marker."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptState(f"the journal anchor file {path} cannot be read ({exc})") from exc
    index, _, chain = text.partition(":")
    try:
        anchor = Anchor(int(index), bytes.fromhex(chain))
    except ValueError:
        anchor = None
    if anchor is None or anchor.index < 0 or len(anchor.chain) != 32:
        raise CorruptState(
            f"the journal anchor file {path} holds {text[:80]!r}, not `<index>:<64 hex digits>`"
        )
    return anchor


class JournalAnchor:
    """Where this instance notes the last record it wrote (`path`; None: it
    keeps no anchor and every method does nothing)."""

    def __init__(self, path: str | None, clock: Callable[[], float], every_s: float = 1.0) -> None:
        self.path = Path(path) if path else None
        self._clock = clock
        self._every_s = every_s
        self._next = 0.0  # when `note` writes again without `force`

    def read(self) -> Anchor | None:
        return None if self.path is None else read_anchor(self.path)

    def note(self, index: int, chain: bytes, force: bool = False) -> None:
        """Record `index` (chain digest `chain`) is written to the state
        store: write it down if `force` or `every_s` has passed."""
        if self.path is None:
            return
        now = self._clock()
        if not force and now < self._next:
            return
        self._next = now + self._every_s
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_bytes(head_marker(index, chain) + b"\n")
        os.replace(tmp, self.path)
