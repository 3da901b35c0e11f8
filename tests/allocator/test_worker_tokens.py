"""Worker tokens (`--worker-tokens-file`): each registers its own worker
only, at its own address; that id and that address are no other
credential's but the admin's. Against a real allocator process."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from allocator_service.roles import parse_worker_tokens
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import stub

C = grpc.StatusCode
SHARED, ADMIN = "shared-pools-token", "admin-token-x"
TABLE = """\
# worker id, the address it advertises, its token
worker-1 http://worker-1:8000 tok-one
worker-2 http://worker-2:8000/ tok-two
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, allocator_server):
    d = tmp_path_factory.mktemp("tokens")
    (d / "workers").write_text(TABLE)
    (d / "shared").write_text(SHARED)
    (d / "admin").write_text(ADMIN)
    with allocator_server(
        "--worker-tokens-file",
        str(d / "workers"),
        "--auth-token-file",
        str(d / "shared"),
        "--admin-token-file",
        str(d / "admin"),
        env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "60"},
    ) as s:
        yield s


def _register(address: str, token: str | None, worker_id: str, url: str) -> grpc.StatusCode | str:
    s, md, channel = stub(address, token)
    try:
        r = s.RegisterPool(
            pb.RegisterPoolRequest(
                worker_id=worker_id,
                advertise_url=url,
                shape=pb.PoolShape(num_blocks=8, block_size=4, model_fingerprint="m"),
            ),
            metadata=md,
            timeout=10,
        )
        s.DeregisterPool(
            pb.DeregisterPoolRequest(pool=pb.PoolRef(pool_id=r.pool_id, credential=r.credential)),
            metadata=md,
            timeout=10,
        )
        return r.pool_id
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("token", "worker_id", "url", "outcome"),
    [
        # its own worker at its own address (a trailing '/' is the same address)
        ("tok-one", "worker-1", "http://worker-1:8000", "worker-1/1"),
        ("tok-two", "worker-2", "http://worker-2:8000", "worker-2/1"),
        # nothing else with it
        ("tok-one", "worker-2", "http://worker-2:8000", C.PERMISSION_DENIED),
        ("tok-one", "worker-1", "http://evil:8000", C.PERMISSION_DENIED),
        ("tok-one", "evil", "http://worker-1:8000", C.PERMISSION_DENIED),
        ("tok-one", "worker-1", "", C.PERMISSION_DENIED),
        # the shared token: any other worker, never a bound id (squatting) or a bound address
        ("shared-pools-token", "worker-1", "http://evil:8000", C.PERMISSION_DENIED),
        ("shared-pools-token", "evil", "http://worker-2:8000", C.PERMISSION_DENIED),
        ("shared-pools-token", "other", "http://other:8000", "other/1"),
        # no token, or a wrong one: nothing
        (None, "other", "http://other:8000", C.UNAUTHENTICATED),
        ("tok-three", "other", "http://other:8000", C.UNAUTHENTICATED),
        # an admin approves any registration
        ("admin-token-x", "worker-1", "http://elsewhere:8000", "worker-1/1"),
    ],
)
def test_a_worker_token_registers_its_own_worker_only(server, token, worker_id, url, outcome):
    got = _register(server.address, token, worker_id, url)
    if isinstance(outcome, str):  # a pool id: the epoch depends on the order the cases ran in
        assert isinstance(got, str) and got.split("/")[0] == outcome.split("/")[0]
    else:
        assert got == outcome


def test_a_bound_worker_without_a_group_is_a_group_of_its_own():
    grants = parse_worker_tokens(
        "w-1 http://a:1 t1\nhost:gpu.0 http://b:1 t2\nw-3 http://c:1 t3 group=team\n"
    )
    groups = [g.store_group for g in grants.values()]
    assert groups[0] == "w-1" and groups[2] == "team"
    # a name, unique
    assert groups[1].startswith("host_gpu_0-") and len(groups[1]) == len("host_gpu_0-") + 16


def test_a_worker_token_is_refused_the_router_calls(server):
    s, md, channel = stub(server.address, "tok-one")
    with pytest.raises(grpc.RpcError) as refused:
        s.ListPools(pb.ListPoolsRequest(), metadata=md, timeout=10)
    assert refused.value.code() == C.PERMISSION_DENIED
    channel.close()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "worker-1 http://a:1\n",
            r"line 1: want 'WORKER_ID URL TOKEN \[BLOCKS\] \[group=NAME\]', got 2 fields",
        ),
        ("w1 http://a:1 t1 group=\n", "line 1: group= needs a name"),
        (
            "w1 http://a:1 t1 group=a.b\n",
            r"line 1: the store group 'a.b' must be 1 to 64 characters of \[A-Za-z0-9_-\]",
        ),
        ("w1 http://a:1 t1 many\n", "line 1: BLOCKS must be a positive whole number, not 'many'"),
        ("worker-1 a:1 tok\n", "line 1: the address must be an http:// or https:// URL"),
        (
            "w1 http://a:1 tok\nw2 http://b:1 tok\n",
            "line 2: worker id, address and token must each appear once",
        ),
        (
            "w1 http://a:1 t1\nw1 http://b:1 t2\n",
            "line 2: worker id, address and token must each appear once",
        ),
        (
            "w1 http://a:1/ t1\nw2 http://a:1 t2\n",
            "line 2: worker id, address and token must each appear once",
        ),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_its_line(text, error):
    with pytest.raises(ValueError, match=error):
        parse_worker_tokens(text)


def test_the_allocator_will_not_start_on_a_bad_tokens_file(tmp_path):
    bad = tmp_path / "workers"
    bad.write_text("worker-1 http://a:1\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "allocator_service",
            "--listen",
            "127.0.0.1:0",
            "--worker-tokens-file",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert (
        f"--worker-tokens-file {bad}: line 1: want 'WORKER_ID "
        "URL TOKEN [BLOCKS] [group=NAME]', got 2 fields" in r.stderr
    )
    assert "Traceback" not in r.stderr
