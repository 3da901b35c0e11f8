"""The allocator's domain: pools, their steps and reads, over the durable
store, with no transport. `AllocatorService` composes its rooms (allocator.py)."""

from allocator_service.service.allocator import AllocatorService
from allocator_service.service.changes import PoolRef
from allocator_service.service.pools import NOT_ADVERTISED, Advertised, Registration
from allocator_service.service.reads import NO_TIERS, PoolReport, TierView
from allocator_service.service.steps import check_step

__all__ = [
    "NOT_ADVERTISED",
    "NO_TIERS",
    "Advertised",
    "AllocatorService",
    "PoolRef",
    "PoolReport",
    "Registration",
    "TierView",
    "check_step",
]
