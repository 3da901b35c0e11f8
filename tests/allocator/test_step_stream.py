"""StepStream, the hot path as one long-lived call per pool, against real
servers: the same answers as unary Step and as the in-process core, every
step counted in the RPC metrics, the bearer-token roles, a step's error
ending the stream without losing the client, the refusal past the server's
limit (unary from then on), and the step id applied once across streams."""

from __future__ import annotations

import json
import re
import urllib.request

import grpc
import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.transport import error_reason
from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import Admit, Append, Free, PoolConfig
from allocator_service.rpc.server import create_server
from allocator_service.service import AllocatorService
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import as_json, random_steps, register, stub

C = grpc.StatusCode
TOKEN, ROUTER_TOKEN = "pool-s3cret", "router-s3cret"


@pytest.fixture(scope="module")
def server(tmp_path_factory, allocator_server):
    tokens = tmp_path_factory.mktemp("stream-auth")
    (tokens / "token").write_text(TOKEN + "\n")
    (tokens / "router").write_text(ROUTER_TOKEN + "\n")
    with allocator_server(
        "--auth-token-file",
        str(tokens / "token"),
        "--metrics-port",
        "0",
        env={"PAGEDKV_ALLOCATOR_ROUTER_TOKEN_FILE": str(tokens / "router")},
    ) as s:
        yield s


def spec(worker: str, prefix: bool = True) -> PoolSpec:
    return PoolSpec(worker, PoolConfig(40, 4, prefix, "m"))


def stream_count(server) -> int:
    """Steps the server answered on StepStream with OK, from /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    m = re.search(
        r'pagedkv_allocator_rpc_duration_seconds_count\{code="OK",method="StepStream"\} (\S+)', text
    )
    return int(float(m.group(1))) if m else 0


@pytest.mark.parametrize("prefix", [False, True])
def test_stream_answers_as_unary_and_the_core(server, prefix):
    """The same random workload three ways: on the stream, unary, in-process.
    Every answer and the final state agree, and each streamed step shows in
    the RPC metrics under StepStream."""
    streamed = GrpcAllocator(server.address, spec(f"stream-{prefix}", prefix), auth_token=TOKEN)
    unary = GrpcAllocator(
        server.address, spec(f"unary-{prefix}", prefix), auth_token=TOKEN, step_stream=False
    )
    local = EmbeddedAllocator(spec("local", prefix))
    before = stream_count(server)
    steps = random_steps(seed=31 + prefix, steps=80)
    for ops in steps:
        want = local.step(ops)
        assert streamed.step(ops) == want
        assert unary.step(ops) == want
    state = as_json(local.pool.to_state())
    assert streamed.dump() == state
    assert unary.dump() == state
    assert stream_count(server) - before == len(steps)
    streamed.close()
    unary.close()


def test_stream_roles(server):
    """The stream is a pool call: the pools' bearer token opens it, no
    token or a wrong one is UNAUTHENTICATED, the router's is PERMISSION_DENIED;
    each request still needs its pool's credential."""
    s, md, channel = stub(server.address, TOKEN)
    ref = register(s, md, "stream-roles")
    request = pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Admit("a", [1, 2, 3])]))
    for token, code in (
        (None, C.UNAUTHENTICATED),
        ("wrong", C.UNAUTHENTICATED),
        (ROUTER_TOKEN, C.PERMISSION_DENIED),
    ):
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        with pytest.raises(grpc.RpcError) as err:
            next(s.StepStream(iter([request]), metadata=metadata, timeout=10))
        assert err.value.code() == code
    stolen = pb.StepRequest(
        pool=pb.PoolRef(pool_id=ref.pool_id, credential="not-it"), step_id=1, ops=request.ops
    )
    with pytest.raises(grpc.RpcError) as err:
        next(s.StepStream(iter([stolen]), metadata=md, timeout=10))
    assert err.value.code() == C.PERMISSION_DENIED
    answers = list(s.StepStream(iter([request, request]), metadata=md, timeout=10))
    # the retry: the first answer, applied once
    assert [list(a.appended) for a in answers] == [[0], [0]]
    channel.close()


def test_an_error_ends_the_stream_not_the_client(server):
    """A step id reused with other operations is FAILED_PRECONDITION (the
    stream ends with it, as a unary call would); the next step opens a new
    stream; a retry of the last step on a new stream gets its first answer."""
    s, md, channel = stub(server.address, TOKEN)
    ref = register(s, md, "stream-conflict")
    first = pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Admit("a", [1, 2, 3, 4, 5])]))
    other = pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Free("a")]))
    call = s.StepStream(iter([first, other]), metadata=md, timeout=10)
    answer = next(call)
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == C.FAILED_PRECONDITION
    assert error_reason(err.value) == "step_conflict"
    again = list(s.StepStream(iter([first]), metadata=md, timeout=10))
    assert again == [answer]
    assert dump_tables(s, md, ref) == {"a": [0, 1]}
    channel.close()

    worker = GrpcAllocator(server.address, spec("stream-client-conflict"), auth_token=TOKEN)
    worker.step([Admit("a", [1, 2, 3])])
    with pytest.raises(grpc.RpcError) as err:  # a request the server refuses whole
        worker.step([Admit("b", [1] * 2_000_000)])  # over the server's tokens per call
    assert err.value.code() == C.INVALID_ARGUMENT
    assert worker.step([Append("a", [4, 5])])[0].append == [1]  # on a new stream
    worker.close()


def dump_tables(s, md, ref) -> dict:
    r = s.DumpPool(pb.DumpPoolRequest(pool=ref), metadata=md, timeout=10)
    return {seq: v["table"] for seq, v in json.loads(r.state_json)["seqs"].items()}


def test_past_the_limit_workers_step_unary():
    """A server that serves one step stream: the second worker is refused
    the stream and sends unary Steps, with the same answers."""
    service = AllocatorService(ServiceConfig(limits=Limits(max_step_streams=1)))
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        a = GrpcAllocator(address, spec("limit-a"))
        b = GrpcAllocator(address, spec("limit-b"))
        local = EmbeddedAllocator(spec("local"))
        for ops in random_steps(seed=5, steps=20):
            want = local.step(ops)
            assert a.step(ops) == want
            assert b.step(ops) == want
        assert a._use_stream and not b._use_stream
        a.close()
        c = GrpcAllocator(address, spec("limit-c"))  # a's stream is gone: c gets one
        c.step([Admit("x", [1])])
        assert c._use_stream
        b.close()
        c.close()
    finally:
        server.stop(0).wait()
        service.close()
