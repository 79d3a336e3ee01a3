"""One retry layer: a hub that refuses N times costs exactly the attempts of the one policy
that retries the call, counted on the server's side (a real gRPC server on loopback that
answers UNAVAILABLE). Were gRPC's service-config retries still underneath a policy, each
policy attempt would cost several calls here."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace

import grpc
import pytest

import ros
from consistency.retry import RetryPolicy
from ros.client.channel import open_channel
from ros.client.rpc import UNARY_POLICY, HubRpc
from ros.client.session import OPEN_POLICY
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import Unavailable

NO_WAIT = RetryPolicy(sleep=lambda _: None)  # a schedule with no real waiting


class RefusingHub(hub_pb2_grpc.TensorHubServicer):
    """Answers UNAVAILABLE to the first `refusals[method]` calls of a method, and counts
    every call it receives. Enough of a hub for `ros.connect`: a session and a keepalive."""

    def __init__(self) -> None:
        self.refusals: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, method: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            refuse = self.calls[method] <= self.refusals.get(method, 0)
        if refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the test")

    def OpenSession(  # noqa: N802  (gRPC's method name)
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        self._count("OpenSession", context)
        return pb.OpenSessionResponse(
            session_id=7, ttl_seconds=30, read_keys=[pb.ReadKey(id=1, key=b"k" * 32)]
        )

    def KeepAlive(  # noqa: N802
        self, requests: Iterator[pb.KeepAliveRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.KeepAliveResponse]:
        for _ in requests:
            yield pb.KeepAliveResponse(ttl_seconds=30)

    def CloseSession(  # noqa: N802
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse()

    def Latest(  # noqa: N802
        self, request: pb.LatestRequest, context: grpc.ServicerContext
    ) -> pb.LatestResponse:
        self._count("Latest", context)
        return pb.LatestResponse(version=3, revision=10)

    def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        self._count("ListModels", context)
        return pb.ListModelsResponse()


@pytest.fixture
def refusing() -> Iterator[tuple[RefusingHub, str]]:
    hub = RefusingHub()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    hub_pb2_grpc.add_TensorHubServicer_to_server(hub, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield hub, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize("refusals", [0, 2, 4, 9])
def test_a_plain_call_costs_exactly_the_unary_policys_attempts(
    refusing: tuple[RefusingHub, str], refusals: int
) -> None:
    hub, address = refusing
    hub.refusals["ListModels"] = refusals
    channel = open_channel([address])
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    rpc = HubRpc(stub, (), 10.0, lambda: None, policy=replace(UNARY_POLICY, sleep=lambda _: None))
    tries = UNARY_POLICY.tries
    assert tries == 5
    try:
        if refusals < tries:
            rpc("ListModels", pb.ListModelsRequest())
            assert hub.calls["ListModels"] == refusals + 1
        else:
            with pytest.raises(Unavailable):
                rpc("ListModels", pb.ListModelsRequest())
            assert hub.calls["ListModels"] == tries
        hub.calls.clear()
        hub.refusals["ListModels"] = 1
        with pytest.raises(Unavailable):
            rpc.once("ListModels", pb.ListModelsRequest())
        assert hub.calls["ListModels"] == 1  # `once`: one try, never retried
    finally:
        channel.close()


@pytest.mark.parametrize("refusals", [0, 3, 20])
def test_a_fresh_read_costs_exactly_the_clients_policys_attempts(
    refusing: tuple[RefusingHub, str], refusals: int
) -> None:
    """`Hub.latest` through `ros.connect`: each attempt of the client's `retry` policy is one
    call on the server, and the connect's OpenSession one call."""
    hub, address = refusing
    client = ros.connect(
        address, tenant="team-a", token="t", retry=replace(NO_WAIT, tries=6), timeout=10
    )
    try:
        assert hub.calls["OpenSession"] == 1
        hub.refusals["Latest"] = refusals
        if refusals < 6:
            assert client.latest("m") == 3
            assert hub.calls["Latest"] == refusals + 1
        else:
            with pytest.raises(Unavailable):
                client.latest("m")
            assert hub.calls["Latest"] == 6
    finally:
        client.close()


def test_opening_a_session_costs_exactly_its_policys_attempts(
    refusing: tuple[RefusingHub, str],
) -> None:
    hub, address = refusing
    assert OPEN_POLICY.tries == 9
    hub.refusals["OpenSession"] = 100
    with pytest.raises(Unavailable):
        ros.connect(address, tenant="team-a", token="t", timeout=30)
    assert hub.calls["OpenSession"] == OPEN_POLICY.tries
