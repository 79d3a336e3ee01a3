"""Two tenants: B can neither see nor touch A's data, on the hub or on A's holder port."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

import ros
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import issue_read_token
from tests.ros.conftest import ADMIN
from tests.ros.helpers import make_model
from transport.layout import Layout
from transport.planner import Source
from transport.reader import fetch
from transport.store import HeldVersion
from transport.topology import Topology

# FAILED_PRECONDITION: `SessionExpired`, the answer to another tenant's session id (the same
# as to a missing one, so session ids cannot be scanned for; test_tenant_identity.py).
REFUSED = (
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
)


@pytest.fixture
def two_tenants(connect: Callable[..., ros.Hub]) -> tuple[ros.Hub, ros.Hub, ros.Publication]:
    a, b = connect("team-a"), connect("team-b")
    pub = a.publish("policy", 1, make_model(1))
    return a, b, pub


def _stub(server: HubServer) -> hub_pb2_grpc.TensorHubStub:
    return hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(server.address))  # type: ignore[no-untyped-call]


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()  # type: ignore[no-any-return]


def test_b_sees_nothing_of_a(two_tenants: tuple[ros.Hub, ros.Hub, ros.Publication]) -> None:
    a, b, _ = two_tenants
    assert b.latest("policy") == 0
    assert b.list_models() == []
    with pytest.raises(ros.VersionNotFound):
        b.inspect("policy", 1)
    with pytest.raises(ros.VersionNotFound):
        b.fetch("policy", 1, timeout=5)
    assert [m.name for m in a.list_models()] == ["policy"]


def test_every_rpc_on_a_session_of_a_is_refused_to_b(
    hub_server: HubServer,
    two_tenants: tuple[ros.Hub, ros.Hub, ros.Publication],
    connect: Callable[..., ros.Hub],
) -> None:
    a, b, _ = two_tenants
    stub = _stub(hub_server)

    def as_b(method: str, request: object) -> Callable[[], object]:
        if method == "KeepAlive":
            return lambda: list(stub.KeepAlive(iter([request]), metadata=b._metadata, timeout=5))
        return lambda: getattr(stub, method)(request, metadata=b._metadata, timeout=5)

    sid = a.session.id
    holder = pb.Holder(name="intruder", endpoints={"tcp": "127.0.0.1:1"}, session_id=sid)
    # A manifest every rule accepts (a's own): the publish is refused for the session alone.
    manifest = stub.Inspect(
        pb.InspectRequest(model="policy", version=1), metadata=a._metadata, timeout=5
    ).manifest
    calls = {
        "Publish": as_b(
            "Publish",
            pb.PublishRequest(model="policy", version=2, manifest=manifest, holder=holder),
        ),
        "RegisterHolder": as_b(
            "RegisterHolder", pb.RegisterHolderRequest(model="policy", version=1, holder=holder)
        ),
        "CloseSession": as_b("CloseSession", pb.CloseSessionRequest(session_id=sid)),
        "KeepAlive": as_b("KeepAlive", pb.KeepAliveRequest(session_id=sid)),
        "Pin": as_b("Pin", pb.PinRequest(model="policy", version=1, pin_id="p", session_id=sid)),
        "Resolve": as_b("Resolve", pb.ResolveRequest(model="policy", version=1)),
        "Inspect": as_b("Inspect", pb.InspectRequest(model="policy", version=1)),
        "ReleaseHolder": as_b(
            "ReleaseHolder",
            pb.ReleaseHolderRequest(
                model="policy", version=1, holder=a.holder_name, force=True, session_id=sid
            ),
        ),
    }
    for name, call in calls.items():
        if name == "ReleaseHolder":
            call()  # b releases "its own" (non-existent) record: a no-op in b's namespace
            continue
        assert _code(call) in REFUSED, name
    # a's data is untouched: still published, a still holds it, its session still alive
    assert a.latest("policy") == 1
    assert [h.holder for h in a.holders("policy", 1)] == [a.holder_name]
    time.sleep(0.2)
    assert not a.session.lost.is_set()


def test_unauthenticated_and_non_admin_calls_are_refused(hub_server: HubServer) -> None:
    stub = _stub(hub_server)
    assert (
        _code(lambda: stub.Latest(pb.LatestRequest(model="policy"), timeout=5))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    bad = (("authorization", "Bearer team-a.not-the-token"),)
    assert (
        _code(lambda: stub.Latest(pb.LatestRequest(model="policy"), metadata=bad, timeout=5))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert (
        _code(lambda: stub.CreateTenant(pb.CreateTenantRequest(name="x"), metadata=bad, timeout=5))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    admin = (("authorization", f"Bearer {ADMIN}"),)
    assert stub.CreateTenant(
        pb.CreateTenantRequest(name="x"), metadata=admin, timeout=5
    ).token.startswith("x.")
    assert (
        _code(
            lambda: stub.CreateTenant(pb.CreateTenantRequest(name="x"), metadata=admin, timeout=5)
        )
        == grpc.StatusCode.ALREADY_EXISTS
    )


def _read(a: ros.Hub, tenant: str, token: bytes, version: int = 1) -> None:
    """A raw data-plane read of policy@version from a's holder port, with the given token."""
    weights = make_model(1)
    layout = Layout.from_tensors(weights)
    dest = HeldVersion.reader(tenant, "policy", version, layout, layout.allocate())
    host, port = a._serving.server.address
    fetch(
        tenant, "policy", version, layout, dest, [Source(a.holder_name, host, port, Topology())],
        token=token, deadline=time.monotonic() + 5, me=Topology(),
    )  # fmt: skip


def test_holder_port_refuses_foreign_expired_and_wrong_version_tokens(
    hub_server: HubServer, two_tenants: tuple[ros.Hub, ros.Hub, ros.Publication]
) -> None:
    a, b, _ = two_tenants
    b_key = b.session.read_key
    a_key = a.session.read_key
    assert a_key != b_key
    # b's own valid token names tenant b: a's holder holds nothing of b's and refuses
    b_token, _ = issue_read_token(b_key, "team-b", "policy", 1)
    with pytest.raises((ros.PermissionDenied, ros.VersionUnavailable)):
        _read(a, "team-b", b_token)
    # b's key used to forge a token for tenant a: refused
    forged, _ = issue_read_token(b_key, "team-a", "policy", 1)
    with pytest.raises(ros.PermissionDenied):
        _read(a, "team-a", forged)
    # a's key but expired
    expired, _ = issue_read_token(a_key, "team-a", "policy", 1, ttl=-10)
    with pytest.raises(ros.PermissionDenied):
        _read(a, "team-a", expired)
    # a's key, valid, but for another version
    other, _ = issue_read_token(a_key, "team-a", "policy", 2)
    with pytest.raises(ros.PermissionDenied):
        _read(a, "team-a", other)
    # and the control: a correct token reads fine
    good, _ = issue_read_token(a_key, "team-a", "policy", 1)
    _read(a, "team-a", good)


def test_an_expired_session_is_named_lease_lost(
    hub_server: HubServer, two_tenants: tuple[ros.Hub, ros.Hub, ros.Publication]
) -> None:
    a, _, _ = two_tenants
    hub_server.etcd.lease_revoke(a.session.id)  # as if a's renewals had been lost
    stub = _stub(hub_server)
    request = pb.PinRequest(model="policy", version=1, pin_id="p", session_id=a.session.id)
    with pytest.raises(grpc.RpcError) as info:
        stub.Pin(request, metadata=a._metadata, timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "expired or was revoked" in (info.value.details() or "")
