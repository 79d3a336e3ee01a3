"""Attacks on who a caller is (issue 12, items 10 and 14), each against a real hub and etcd.

- Item 10: a tenant scanning session ids must not tell another tenant's live session from
  a missing one: both answer `SessionExpired`, with the same message.
- Item 14: a client that names one tenant and holds another tenant's token is refused, at
  connect, with `PermissionDenied` naming both.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

import ros
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.helpers import make_model


def _stub(server: HubServer) -> hub_pb2_grpc.TensorHubStub:
    return hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(server.address))  # type: ignore[no-untyped-call]


def _answer(call: Callable[[], object], session_id: int) -> tuple[grpc.StatusCode, str]:
    """The status a refused call got, its message with the session id taken out."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), (exc.details() or "").replace(f"{session_id:x}", "<id>")
    raise AssertionError(f"session {session_id:x}: the call was not refused")


def test_scanning_session_ids_cannot_tell_a_live_foreign_session_from_a_missing_one(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    a, b = connect("team-a"), connect("team-b")
    a.publish("policy", 1, make_model(1))
    b.publish("policy", 1, make_model(2))  # so a Pin as b has a version to pin
    stub = _stub(hub_server)
    metadata = b._metadata

    def calls(sid: int) -> dict[str, Callable[[], object]]:
        keepalive = pb.KeepAliveRequest(session_id=sid)
        pin = pb.PinRequest(model="policy", version=1, pin_id="scan", session_id=sid)
        return {
            "CloseSession": lambda: stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid), metadata=metadata, timeout=5
            ),
            "KeepAlive": lambda: list(
                stub.KeepAlive(iter([keepalive]), metadata=metadata, timeout=5)
            ),
            "Pin": lambda: stub.Pin(pin, metadata=metadata, timeout=5),
        }

    live = a.session.id
    gone, _ = hub_server.etcd.lease_grant(10)  # a lease that existed, then was revoked
    hub_server.etcd.lease_revoke(gone)
    # ids next to a's (lease ids are near-sequential), none of them the caller's own session
    near = [i for i in range(live - 3, live + 4) if i not in (live, b.session.id)]
    scanned = [live, gone, *near, 0x7FFF_FFFF_0000_0001]
    for method in ("CloseSession", "KeepAlive", "Pin"):
        answers = {sid: _answer(calls(sid)[method], sid) for sid in scanned}
        assert answers[live][0] == grpc.StatusCode.FAILED_PRECONDITION, (method, answers)
        assert len(set(answers.values())) == 1, (method, answers)  # one answer for all
        assert "expired or was revoked" in answers[live][1]
    # and the probes did nothing to a's session
    assert a.latest("policy") == 1
    assert hub_server.etcd.lease_ttl(live) > 0
    assert not a.session.lost.is_set()


def test_a_client_naming_another_tenant_than_its_token_is_refused_at_connect(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    a_token = make_tenant("team-a")
    make_tenant("team-b")
    with ros.connect(hub_server.address, tenant="team-a", token=a_token) as a:
        a.publish("policy", 1, make_model(1))
    with pytest.raises(ros.PermissionDenied) as info:
        ros.connect(hub_server.address, tenant="team-b", token=a_token)
    assert "team-a" in str(info.value)
    assert "team-b" in str(info.value)
    # a raw call and a raw stream naming team-b with team-a's token are refused the same way
    stub = _stub(hub_server)
    metadata = (("authorization", f"Bearer {a_token}"), ("tensorhub-tenant", "team-b"))
    with pytest.raises(grpc.RpcError) as raw:
        stub.Latest(pb.LatestRequest(model="policy"), metadata=metadata, timeout=5)
    assert raw.value.code() == grpc.StatusCode.PERMISSION_DENIED
    watch = stub.Watch(pb.WatchRequest(model="policy"), metadata=metadata, timeout=5)
    with pytest.raises(grpc.RpcError) as streamed:
        next(iter(watch))
    assert streamed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # a caller that names no tenant is still served as its token's (older SDKs)
    plain = (("authorization", f"Bearer {a_token}"),)
    assert stub.Latest(pb.LatestRequest(model="policy"), metadata=plain, timeout=5).version == 1
