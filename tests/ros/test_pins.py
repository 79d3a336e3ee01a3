"""Pins (issue 12, items 12 and 15), against a real hub and etcd.

- Item 12: pins kept 30 versions under `max_retained_versions=4`. A pin that would make more
  versions of a model pinned than that quota is refused with `QuotaExceeded`, also when
  pins race.
- Item 15: within a tenant, another session could Unpin a pin, or force-release a holder
  record, it does not own. The hub now compares the named session with the record's lease.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest

import ros
from ros.errors import from_rpc_error
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import TensorHubError
from tests.ros.helpers import make_model


def _call(client: ros.Hub, method: str, request: object) -> object:
    """A raw hub call with the client's own credentials (errors as TensorHubErrors)."""
    try:
        return getattr(client._stub, method)(request, metadata=client._metadata, timeout=10)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def _pin(client: ros.Hub, version: int, pin_id: str = "keep") -> None:
    request = pb.PinRequest(
        model="policy", version=version, pin_id=pin_id, session_id=client.session.id
    )
    _call(client, "Pin", request)


def _unpin(client: ros.Hub, version: int, pin_id: str = "keep", session: int = -1) -> None:
    sid = client.session.id if session < 0 else session
    request = pb.UnpinRequest(model="policy", version=version, pin_id=pin_id, session_id=sid)
    _call(client, "Unpin", request)


def _quota_tenant(hub_server: HubServer) -> str:
    return TenantStore(hub_server.etcd, hub_server.keys).create(
        "team-q", Quotas(max_retained_versions=4)
    )


def test_a_pin_past_the_retained_versions_quota_is_refused(hub_server: HubServer) -> None:
    token = _quota_tenant(hub_server)
    with ros.connect(hub_server.address, tenant="team-q", token=token) as client:
        for version in range(1, 5):  # four pinned versions: the quota
            client.publish("policy", version, make_model(version)).release(force=True)
            _pin(client, version)
        client.publish("policy", 5, make_model(5)).release(force=True)
        with pytest.raises(ros.QuotaExceeded):
            _pin(client, 5)
        _pin(client, 4, "second")  # another pin of a pinned version pins no new version
        _unpin(client, 1)
        _pin(client, 5)  # a pinned version let go: room for another
        pinned = [v for v in range(1, 6) if _pinned(client, v)]
        assert pinned == [2, 3, 4, 5]


def _pinned(client: ros.Hub, version: int) -> bool:
    try:
        return bool(client.inspect("policy", version).pins)
    except ros.VersionNotFound:
        return False


def test_racing_pins_never_exceed_the_quota(hub_server: HubServer) -> None:
    token = _quota_tenant(hub_server)
    with ros.connect(hub_server.address, tenant="team-q", token=token) as client:
        for version in range(1, 4):  # three pinned: room for one more
            client.publish("policy", version, make_model(version)).release(force=True)
            _pin(client, version)
        for version in (4, 5):  # the two newest: retained, unpinned
            client.publish("policy", version, make_model(version)).release(force=True)
        start = threading.Barrier(2)
        outcomes: dict[int, str] = {}

        def pin(version: int) -> None:
            start.wait(timeout=10)
            try:
                _pin(client, version)
                outcomes[version] = "pinned"
            except TensorHubError as exc:
                outcomes[version] = type(exc).__name__

        threads = [threading.Thread(target=pin, args=(v,)) for v in (4, 5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert sorted(outcomes.values()) == ["QuotaExceeded", "pinned"], outcomes


def test_another_session_of_the_tenant_cannot_unpin_or_force_release(
    connect: Callable[..., ros.Hub],
) -> None:
    owner, other = connect(name="owner"), connect(name="other")
    published = owner.publish("policy", 1, make_model(1))
    _pin(owner, 1)
    with pytest.raises(ros.PermissionDenied):
        _unpin(other, 1)  # its own session: not the pin's
    with pytest.raises(ros.InvalidArgument):
        _call(other, "Unpin", pb.UnpinRequest(model="policy", version=1, pin_id="keep"))
    assert owner.inspect("policy", 1).pins == ["keep"]
    release = pb.ReleaseHolderRequest(
        model="policy", version=1, holder="owner", force=True, session_id=other.session.id
    )
    with pytest.raises(ros.PermissionDenied):
        _call(other, "ReleaseHolder", release)
    with pytest.raises(ros.InvalidArgument):
        _call(
            other,
            "ReleaseHolder",
            pb.ReleaseHolderRequest(model="policy", version=1, holder="owner", force=True),
        )
    assert [h.holder for h in owner.holders("policy", 1)] == ["owner"]
    # the owner's own calls, through the SDK and raw, still work
    _unpin(owner, 1)
    assert owner.inspect("policy", 1).pins == []
    _unpin(owner, 1)  # a pin already gone: nothing to do
    published.release(force=True)  # the SDK names its own session
    assert owner.holders("policy", 1) == []
