"""A call the transport cuts after the allocator applied it, as a proxy, a
load balancer or a restarting server's network does: the worker's client
sends it again and gets the first answer (the step id), whatever status
gRPC ended the cut call with, so the worker never fails a request for it.
A refusal from the allocator's own code (it names a `pagedkv-error`
reason) is never sent again.

The proxy is a real gRPC server in front of a real allocator process: it
forwards every call, and ends chosen step calls with a chosen status and
no answer once the allocator has answered them."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import PoolConfig
from allocator_service.rpc.servicer import SERVICE_NAME
from allocator_service.wire.errors import ERROR_KEY
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc
from tests.support.allocator import as_json, random_steps

SPEC = PoolSpec("cut-test", PoolConfig(32, 4, True, "m"))


class CuttingProxy(grpc.GenericRpcHandler):
    """Forwards every call to `upstream`; the step calls whose number is in
    `cut` (counting from 1, unary Steps and steps on a StepStream alike) are
    forwarded, answered upstream, then ended with `code` (and `trailer`, if
    given) instead of the answer."""

    def __init__(
        self, upstream: str, cut: set[int], code: grpc.StatusCode, trailer: tuple = ()
    ) -> None:
        self.channel = grpc.insecure_channel(upstream)
        self.stub = pb_grpc.AllocatorStub(self.channel)
        self.cut, self.code, self.trailer = cut, code, trailer
        self.steps = 0  # step calls seen
        self.lock = threading.Lock()

    def _step(self, request: pb.StepRequest, context) -> pb.StepResponse:
        response = self.stub.Step(request, timeout=10, metadata=context.invocation_metadata())
        with self.lock:
            self.steps += 1
            n = self.steps
        if n in self.cut:
            if self.trailer:
                context.set_trailing_metadata(self.trailer)
            context.abort(self.code, "cut by the proxy")
        return response

    def _stream(self, requests, context):
        for request in requests:
            yield self._step(request, context)

    def service(self, details):
        method = details.method
        if method == f"/{SERVICE_NAME}/Step":
            return grpc.unary_unary_rpc_method_handler(
                self._step, pb.StepRequest.FromString, pb.StepResponse.SerializeToString
            )
        if method == f"/{SERVICE_NAME}/StepStream":
            return grpc.stream_stream_rpc_method_handler(
                self._stream, pb.StepRequest.FromString, pb.StepResponse.SerializeToString
            )
        forward = self.channel.unary_unary(method)  # bytes in, bytes out

        def unary(request: bytes, context) -> bytes:
            return forward(request, timeout=10, metadata=context.invocation_metadata())

        return grpc.unary_unary_rpc_method_handler(unary)


def start_proxy(handler: CuttingProxy) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
    ],
    ids=lambda c: c.name,
)
def test_a_step_cut_after_it_was_applied_is_answered_once(allocator_server, code, step_stream):
    steps = random_steps(seed=7, steps=15)
    reference = EmbeddedAllocator(SPEC)
    with allocator_server() as server:
        proxy = CuttingProxy(server.address, cut={2, 5, 6, 11}, code=code)
        front, address = start_proxy(proxy)
        try:
            worker = GrpcAllocator(address, SPEC, backoff_s=0.01, step_stream=step_stream)
            for ops in steps:
                assert worker.step(ops) == reference.step(ops)
            assert proxy.steps == len(steps) + 4  # each cut step sent once more
            assert worker.dump() == as_json(reference.pool.to_state())
            worker.close()
        finally:
            front.stop(0)
            proxy.channel.close()


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.FAILED_PRECONDITION], ids=lambda c: c.name
)
def test_an_answer_of_the_allocators_code_is_not_sent_again(allocator_server, code):
    """A status that names the allocator's reason came from its code: the
    step fails at once (the worker reports it), with no second attempt."""
    steps = random_steps(seed=8, steps=3)
    with allocator_server() as server:
        proxy = CuttingProxy(server.address, cut={2}, code=code, trailer=((ERROR_KEY, "internal"),))
        front, address = start_proxy(proxy)
        try:
            worker = GrpcAllocator(address, SPEC, backoff_s=0.01)
            worker.step(steps[0])
            with pytest.raises(grpc.RpcError) as err:
                worker.step(steps[1])
            assert err.value.code() == code
            assert proxy.steps == 2
            worker.close()
        finally:
            front.stop(0)
            proxy.channel.close()


class SeenLock:
    """A pool's lock whose waiters are seen: `waiting` is set once another
    thread asks for it while the test holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = threading.Event()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            self.waiting.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_a_stream_ended_at_shutdown_answers_its_step_in_flight():
    """What SIGTERM does to step streams (`end_step_streams`) while a step
    is being applied: the step is answered on the stream (the client gets
    one attempt, no retry), and the next step is refused unapplied
    (UNAVAILABLE: a worker sends it to the next server)."""
    from allocator_service.client import AllocatorUnavailable
    from allocator_service.rpc.server import create_server
    from allocator_service.service import AllocatorService

    steps = random_steps(seed=9, steps=3)
    reference = EmbeddedAllocator(SPEC)
    service = AllocatorService()
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    try:
        worker = GrpcAllocator(f"127.0.0.1:{port}", SPEC, retries=0, heartbeat=False)
        assert worker.step(steps[0]) == reference.step(steps[0])
        lock = service.registry.pools[worker.pool_id].lock = SeenLock()
        answer: dict = {}
        with lock:
            t = threading.Thread(target=lambda: answer.update(r=worker.step(steps[1])))
            t.start()
            assert lock.waiting.wait(10)  # the step is in the server, waiting for its pool
            service.streams.end_step_streams()
        t.join(10)
        assert answer["r"] == reference.step(steps[1])
        with pytest.raises(AllocatorUnavailable):
            worker.step(steps[2])
        # the refused step was not applied
        assert service.registry.pools[worker.pool_id].last_step_id == 2
        worker.close()
    finally:
        server.stop(0)
        service.close()
