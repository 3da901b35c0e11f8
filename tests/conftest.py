# --- worker/attention (tests/worker/test_attention.py): Triton without a GPU ----------
# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
# worker.attention.triton_decode is first imported, so it is set here, before
# any test module loads. Without an NVIDIA driver the kernel can only run in the
# interpreter (on CPU tensors); with one, the real compiler stays on.
import os as _os  # noqa: E402

if not _os.path.exists("/proc/driver/nvidia/version"):
    _os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end worker/attention block ------------------------------------------------


# --- processes: the one launcher (pagedkv.stack) as fixtures ----------------------
# Factories, session-scoped so module-scoped fixtures can use them too; each
# process they start is stopped when its `with` block (or the test) ends.
import contextlib  # noqa: E402
import shutil  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from pagedkv.stack import AllocatorProcess, WorkerProcess, start_allocator, start_redis  # noqa: E402


@pytest.fixture(scope="session")
def allocator_server():
    """`allocator_server(*ARGS, listen=, env=)`: `python -m allocator_service` on a free
    port (or `listen`), serving; a context manager that SIGTERMs it (SIGKILL if it hangs)."""

    def start(*args: str, listen: str = "127.0.0.1:0", env: dict | None = None) -> AllocatorProcess:
        return start_allocator(args, listen=listen, env=env)

    return start


@pytest.fixture(scope="session")
def redis_store():
    """`with redis_store() as (url, redis)`: a Redis URL with a key prefix of its own, and
    the private RedisProcess (None when shared).

    PAGEDKV_TEST_REDIS=redis://host:port/db points the tests at an existing
    Redis (keys under a random prefix, deleted afterwards); otherwise a private
    `redis-server` runs on a free port in a temporary directory."""

    @contextlib.contextmanager
    def store() -> Iterator[tuple[str, object]]:
        prefix = f"pagedkv-test-{uuid.uuid4().hex[:12]}:"
        given = _os.environ.get("PAGEDKV_TEST_REDIS")
        if given:
            sep = "&" if "?" in given else "?"
            try:
                yield f"{given}{sep}key_prefix={prefix}", None
            finally:
                import redis

                client = redis.Redis.from_url(given)
                for key in client.scan_iter(match=prefix + "*"):
                    client.delete(key)
                client.close()
            return
        if shutil.which("redis-server") is None:
            pytest.skip("needs redis-server on PATH or PAGEDKV_TEST_REDIS")
        with start_redis() as r:
            yield f"{r.url}?key_prefix={prefix}", r

    return store


@pytest.fixture(scope="session")
def worker_process():
    """`with worker_process(*ARGS, timeout=90, env=None) as url`: `python -m worker ARGS`
    (with `env` added to its environment) on a free loopback port, healthy; its base URL."""

    @contextlib.contextmanager
    def start(
        *args: str, timeout: float = 90.0, env: dict[str, str] | None = None
    ) -> Iterator[str]:
        worker = WorkerProcess("worker", args=["--log-level", "warning", *args], env=env)
        try:
            yield worker.start().wait_healthy(timeout).url
        finally:
            worker.terminate()

    return start


# --- end processes block ------------------------------------------------------------
