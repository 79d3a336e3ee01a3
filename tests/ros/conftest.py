"""Hub fixtures: a real hub (gRPC on loopback) over the session's real etcd, per-test prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tests.ros.failpoints import HeldTxn

ADMIN = "admin-secret-for-tests"


@pytest.fixture
def hub_server(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    server = HubServer(etcd_cluster.endpoints, admin_token=ADMIN, keys=keys).start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture
def make_tenant(hub_server: HubServer) -> Callable[[str], str]:
    """Create a tenant directly in etcd; returns its token."""

    def create(name: str) -> str:
        return TenantStore(hub_server.etcd, hub_server.keys).create(name)

    return create


@pytest.fixture
def connect(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> Iterator[Callable[..., ros.Hub]]:
    tokens: dict[str, str] = {}
    opened: list[ros.Hub] = []

    def open_client(tenant: str = "team-a", **kwargs: object) -> ros.Hub:
        if tenant not in tokens:
            tokens[tenant] = make_tenant(tenant)
        client = ros.connect(hub_server.address, tenant=tenant, token=tokens[tenant], **kwargs)  # type: ignore[arg-type]
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.fixture
def held() -> Iterator[list[HeldTxn]]:
    """Failpoints a test puts here are removed (and released) when it ends."""
    made: list[HeldTxn] = []
    yield made
    for failpoint in made:
        failpoint.remove()
