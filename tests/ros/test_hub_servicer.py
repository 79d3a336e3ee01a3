"""The servicer answers every RPC of `tensorhub.v1.TensorHub` itself (none is left to the
generated base class, which answers UNIMPLEMENTED)."""

from __future__ import annotations

from ros.hub.servicer import HubServicer
from ros.proto.tensorhub.v1 import hub_pb2, hub_pb2_grpc


def test_every_rpc_of_the_service_has_a_handler() -> None:
    service = hub_pb2.DESCRIPTOR.services_by_name["TensorHub"]
    names = [method.name for method in service.methods]
    assert "DeleteTenant" in names
    for name in names:
        assert getattr(HubServicer, name) is not getattr(hub_pb2_grpc.TensorHubServicer, name), (
            f"{name} is not handled"
        )
