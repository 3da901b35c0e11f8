"""The baseline the paged layout is measured against: one contiguous run of
slots reserved per request, placed first-fit. It shows both kinds of waste of
the reference article: internal (reserved slots never filled) and external
(free slots split into runs too short for the next request)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Reservation:
    start: int
    reserved: int
    used: int


class ContiguousPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self.requests: dict[str, Reservation] = {}

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every maximal free run, in address order."""
        runs, pos = [], 0
        for r in sorted(self.requests.values(), key=lambda r: r.start):
            if r.start > pos:
                runs.append((pos, r.start - pos))
            pos = r.start + r.reserved
        if pos < self.num_slots:
            runs.append((pos, self.num_slots - pos))
        return runs

    def reserve(self, rid: str, reserve: int, used: int = 0) -> int | None:
        """Reserve `reserve` slots in a row for request `rid`, holding `used`
        tokens. Returns the start slot, or None when no free run is long enough."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already holds a reservation")
        if not 0 <= used <= reserve:
            raise ValueError("used must be between 0 and the reservation")
        for start, length in self.free_runs():
            if length >= reserve:
                self.requests[rid] = Reservation(start, reserve, used)
                return start
        return None

    def free(self, rid: str) -> None:
        del self.requests[rid]

    @property
    def reserved_slots(self) -> int:
        return sum(r.reserved for r in self.requests.values())

    @property
    def used_slots(self) -> int:
        return sum(r.used for r in self.requests.values())

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.reserved_slots
