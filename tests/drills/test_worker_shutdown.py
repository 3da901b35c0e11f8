"""A worker told to stop (SIGTERM) stops by itself even when its allocator is gone.

The engine waits for an unanswered allocator as long as it takes (the allocator
may come back with the pool); a shutdown must not: the step in flight is given
up after the client's own retries, so a stack that stops its allocator first,
or a launcher killed with every child told to stop at once, leaves no worker
behind.
"""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from pagedkv.stack import WorkerProcess

pytestmark = pytest.mark.slow


def test_a_worker_stops_on_sigterm_while_its_allocator_is_gone(allocator_server):
    with allocator_server() as allocator:
        worker = WorkerProcess(
            "worker",
            args=[
                "--log-level",
                "warning",
                "--model",
                "tiny-random",
                "--allocator",
                allocator.address,
                "--num-blocks",
                "64",
                "--block-size",
                "4",
            ],
        )
        url = worker.start().wait_healthy(90).url
        body = {"model": "tiny-random", "prompt": "a b c d e f", "max_tokens": 2000}
        body["ignore_eos"] = True
        httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        allocator.kill()  # gone: no step is answered any more

        def client() -> None:  # a request in flight, given up by its client
            try:
                httpx.post(f"{url}/v1/completions", json=body, timeout=3)
            except httpx.HTTPError:
                pass

        asking = threading.Thread(target=client)
        asking.start()
        asking.join()
        # SIGTERM, SIGKILL only past the grace: a worker that waited for its allocator
        # would be killed (-SIGKILL); one that stops exits by itself (uvicorn ends by
        # raising the SIGTERM it handled again: -SIGTERM)
        status = worker.terminate(grace=60)
        assert status in (0, -signal.SIGTERM), (status, worker.log()[-2000:])
