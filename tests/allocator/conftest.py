"""The `store` of the log-integrity tests (tests/allocator/test_log_integrity.py,
test_log_redis.py): a private redis-server, since they damage, flush and reconfigure it
(test_journal.py keeps its own `store`, which a shared PAGEDKV_TEST_REDIS may serve)."""

from __future__ import annotations

import pytest


@pytest.fixture
def store(redis_store):
    with redis_store() as s:
        if s[1] is None:
            pytest.skip("needs a private redis-server (PAGEDKV_TEST_REDIS is shared)")
        yield s
