"""What the tiers report to: one meter per tier, passed in (worker/metrics.py's
`TierMetrics` is one), so the byte movers import no metrics library."""

from __future__ import annotations

from typing import Protocol

__all__ = ["TierMeter"]


class TierMeter(Protocol):
    def set_capacity(self, nbytes: int) -> None:
        """Bytes the tier can hold."""

    def saved(self, blocks: int, nbytes: int, seconds: float) -> None:
        """Blocks whose bytes were written into the tier, and the time the writes took."""

    def loaded(self, blocks: int, nbytes: int, seconds: float) -> None:
        """Blocks whose bytes were read from the tier into the KV pool, and the time it took."""

    def refused(self, reason: str, blocks: int = 1) -> None:
        """Loads not loaded and reported refused (reason: REFUSAL_REASONS, or `missing`)."""

    def store_error(self) -> None:
        """A store call that failed (unreachable, I/O): its blocks were misses or failed saves."""
