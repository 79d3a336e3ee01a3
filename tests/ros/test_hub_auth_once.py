"""The hub authenticates a call once: the call guard finds the caller and hands it to the
handler, which does not look the token up again."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator

import grpc
import grpc.aio
import pytest

from consistency import Etcd, EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.servicer import HubServicer
from ros.hub.state import HubState
from ros.hub.tenants import Tenant, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.conftest import ADMIN


@pytest.fixture
def lookups(hub_server: HubServer) -> Iterator[list[str]]:
    """Every token lookup the replica's tenant store answers from memory, but the one its
    own `authenticate` makes for the guard before it reads etcd: when the tenant's record
    went stale (5 s, or refreshed by the tenants watch, which on a loaded machine lands
    late), the guard's memory lookup misses and the guard authenticates through etcd in a
    worker; that is the same lookup's slow path, not a second one (a CI run saw it counted
    twice)."""
    store = hub_server.servicer.hub.tenants
    seen: list[str] = []
    cached = store.cached

    def counted(token: str) -> Tenant | None:
        caller = sys._getframe(1)
        slow_path = (
            caller.f_code is TenantStore.authenticate.__code__
            and caller.f_back is not None
            and caller.f_back.f_code is HubState.authenticate.__code__
        )
        if not slow_path:
            seen.append(token)
        return cached(token)

    store.cached = counted  # type: ignore[method-assign]
    yield seen
    store.cached = cached  # type: ignore[method-assign]


def test_each_call_looks_its_token_up_once(
    hub_server: HubServer, make_tenant: Callable[[str], str], lookups: list[str]
) -> None:
    token = make_tenant("once")
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(hub_server.address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        stub.Latest(pb.LatestRequest(model="m"), metadata=metadata, timeout=10)  # now known
        for _ in range(3):
            lookups.clear()
            stub.Latest(pb.LatestRequest(model="m"), metadata=metadata, timeout=10)
            assert lookups == [token]  # the guard's; the handler reads the caller it was given
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=10), metadata=metadata)
        lookups.clear()
        stub.CloseSession(
            pb.CloseSessionRequest(session_id=session.session_id), metadata=metadata, timeout=10
        )
        assert lookups == [token]


def test_the_admin_is_told_apart_once_and_refused_tenant_calls(
    hub_server: HubServer, lookups: list[str]
) -> None:
    admin = (("authorization", f"Bearer {ADMIN}"),)
    with grpc.insecure_channel(hub_server.address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        made = stub.CreateTenant(pb.CreateTenantRequest(name="by-admin"), metadata=admin)
        assert made.token
        assert lookups == []  # the admin token is never looked up as a tenant's
        with pytest.raises(grpc.RpcError) as refused:
            stub.Latest(pb.LatestRequest(model="m"), metadata=admin, timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        tenant = (("authorization", f"Bearer {made.token}"),)
        with pytest.raises(grpc.RpcError) as not_admin:
            stub.DeleteTenant(pb.DeleteTenantRequest(name="by-admin"), metadata=tenant)
        assert not_admin.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs the admin token" in (not_admin.value.details() or "")


@pytest.mark.timeout(60)
def test_a_servicer_served_without_the_guard_refuses_every_call(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    """No handler authenticates: a call the guard did not authenticate has no caller, so a
    servicer served without the guard refuses a valid token's call, and the admin's."""

    async def main() -> None:
        etcd = Etcd(etcd_cluster.endpoints)
        servicer = HubServicer(etcd, keys, admin_token=ADMIN).start()
        server = grpc.aio.server()
        hub_pb2_grpc.add_TensorHubServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        token = TenantStore(etcd, keys).create("unguarded")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        try:
            for bearer, call in (
                (token, stub.Latest(pb.LatestRequest(model="m"), timeout=10, metadata=(
                    ("authorization", f"Bearer {token}"),))),
                (ADMIN, stub.CreateTenant(pb.CreateTenantRequest(name="x"), timeout=10,
                    metadata=(("authorization", f"Bearer {ADMIN}"),))),
            ):  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, bearer
        finally:
            await channel.close(None)
            await server.stop(0)
            servicer.close()
            etcd.close()

    asyncio.run(main())
