"""A deleted tenant's token writes nothing (issue 25, item 1), with two real hub replicas over
one etcd: every write made for a tenant compares its record's create revision in etcd
(`TenantStore.fence`), so a cached token, a write racing the delete, or a tenant created
again under the same name changes nothing: the old token is refused (`PermissionDenied`),
and the new tenant finds nothing of the old one under its prefix.

Races are made with a failpoint on the hub's etcd client (the write is held at the door
while the tenant is deleted), not with timers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from consistency import EtcdCluster, Keys
from ros.errors import ERROR_METADATA_KEY
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.conftest import ADMIN
from tests.ros.failpoints import HeldTxn
from tests.ros.test_burst import shard_request
from tests.waiting import wait_until


@pytest.fixture
def replica(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    """A second replica over the same etcd and prefix as `hub_server`."""
    server = HubServer(etcd_cluster.endpoints, admin_token=ADMIN, keys=keys).start()
    yield server
    server.stop(grace=0.2)


def stub(server: HubServer) -> Any:
    return hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(server.address))  # type: ignore[no-untyped-call]


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def error_of(call: Any) -> str:
    """The TensorHub error class a call raised ("" if it succeeded)."""
    try:
        call()
    except grpc.RpcError as exc:
        return dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY, exc.code().name)  # type: ignore[attr-defined]
    return ""


def whole(model: str, session: int) -> pb.PublishRequest:
    request = shard_request(0, 1, session, model)
    request.ClearField("shard_count")
    request.ClearField("shard_index")
    request.holder.ClearField("shard")
    return request


def tenant_keys(server: HubServer, name: str) -> list[str]:
    return [kv.key.decode() for kv in server.etcd.range(server.keys.tenant(name), prefix=True).kvs]


def test_a_cached_token_of_a_deleted_tenant_writes_nothing_into_its_successor(
    hub_server: HubServer, replica: HubServer
) -> None:
    """The review's sequence: the old token, cached on replica 2, publishes and opens
    sessions after the tenant was deleted through replica 1, and again after a tenant of the
    same name was created. Every write is refused; the new tenant sees nothing planted."""
    store = TenantStore(hub_server.etcd, hub_server.keys)
    old = store.create("acme")
    second = stub(replica)
    session = second.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=md(old))
    assert second.Publish(whole("before", session.session_id), metadata=md(old)).visible
    stub(hub_server).DeleteTenant(
        pb.DeleteTenantRequest(name="acme"), metadata=md(ADMIN), timeout=10
    )
    # Whatever replica 2 still has cached, the writes are refused by the fence in etcd or,
    # once its watch of the tenant records told it, by authentication: PermissionDenied.
    opened = error_of(
        lambda: second.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=md(old))
    )
    assert opened == "PermissionDenied"
    planted = error_of(lambda: second.Publish(whole("ghost", session.session_id), metadata=md(old)))
    assert planted in ("PermissionDenied", "SessionExpired")  # its session went with it
    new = store.create("acme")
    assert error_of(lambda: second.Publish(whole("ghost2", 1), metadata=md(old))) == (
        "PermissionDenied"
    )
    assert tenant_keys(hub_server, "acme") == []  # nothing of the old tenant, nothing planted
    # (replica 2 found "acme" missing a moment ago; its watch tells it the name exists again)
    wait_until(
        "replica 2 knows the new tenant",
        lambda: not error_of(lambda: second.ListModels(pb.ListModelsRequest(), metadata=md(new))),
    )
    assert list(second.ListModels(pb.ListModelsRequest(), metadata=md(new)).models) == []
    # and the session the old tenant had is gone with it
    assert hub_server.etcd.lease_ttl(session.session_id) < 0


def test_a_publish_racing_the_delete_is_refused_in_etcd(
    hub_server: HubServer, replica: HubServer, held: list[HeldTxn]
) -> None:
    """A publish authenticated before the delete, whose transaction reaches etcd after it:
    refused by the fence, not merely by a cache, and nothing is left under the prefix."""
    store = TenantStore(hub_server.etcd, hub_server.keys)
    token = store.create("racer")
    second = stub(replica)
    session = second.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=md(token))
    failpoint = HeldTxn(replica.etcd, replica.keys.model("racer", "late"))
    held.append(failpoint)
    outcome: list[str] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            error_of(lambda: second.Publish(whole("late", session.session_id), metadata=md(token)))
        )
    )
    thread.start()
    assert failpoint.reached.wait(20)
    store.delete("racer", timeout=10)
    store.create("racer")  # the successor exists before the held write goes on
    failpoint.release()
    thread.join(30)
    assert outcome == ["PermissionDenied"]
    assert tenant_keys(hub_server, "racer") == []


def test_a_session_opened_while_the_delete_runs_is_refused_and_revoked(
    hub_server: HubServer, replica: HubServer, held: list[HeldTxn]
) -> None:
    store = TenantStore(hub_server.etcd, hub_server.keys)
    token = store.create("opener")
    failpoint = HeldTxn(replica.etcd, replica.keys.sessions("opener"))
    held.append(failpoint)
    second = stub(replica)
    outcome: list[str] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            error_of(
                lambda: second.OpenSession(
                    pb.OpenSessionRequest(ttl_seconds=30), metadata=md(token), timeout=20
                )
            )
        )
    )
    thread.start()
    assert failpoint.reached.wait(20)  # its lease is granted, its mark held at the door
    (lease,) = {lease for lease in failpoint.leases if lease}
    assert replica.etcd.lease_ttl(lease) > 0
    store.delete("opener", timeout=10)
    failpoint.release()
    thread.join(30)
    assert outcome == ["PermissionDenied"]
    assert tenant_keys(hub_server, "opener") == []
    # the refused open revoked the lease it was granted: nothing of it outlives the refusal
    wait_until("the refused session's lease is revoked", lambda: replica.etcd.lease_ttl(lease) < 0)


def test_shards_in_a_batch_when_their_tenant_is_deleted_are_refused(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    store = TenantStore(hub_server.etcd, hub_server.keys)
    token = store.create("sharded")
    first = stub(hub_server)
    session = first.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=md(token))
    failpoint = HeldTxn(hub_server.etcd, hub_server.keys.shards("sharded", "mp", 1))
    held.append(failpoint)
    outcome: list[str] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            error_of(
                lambda: first.Publish(
                    shard_request(0, 2, session.session_id), metadata=md(token), timeout=20
                )
            )
        )
    )
    thread.start()
    assert failpoint.reached.wait(20)
    store.delete("sharded", timeout=10)
    failpoint.release()
    thread.join(30)
    assert outcome == ["PermissionDenied"]
    assert tenant_keys(hub_server, "sharded") == []
