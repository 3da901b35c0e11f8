"""Offline tools built on the allocator core: replay, kv-size, simulate."""
