"""A hub over an etcd whose NOSPACE alarm is raised: publishers get `StorageFull` (not an
"etcd error"), the hub's writes health says NOT_SERVING, and once the hub's own compactor has
compacted, defragmented and disarmed, publishing works again with no operator involved.

The etcd is the test's own small-quota member (a quota is per member), filled through the SDK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import WRITES_HEALTH_NAME, HubServer
from ros.hub.tenants import TenantStore
from tensorhub.errors import StorageFull
from tests.waiting import wait_until

QUOTA = 4 << 20


@pytest.fixture
def small_hub(etcd_cluster: EtcdCluster) -> Iterator[HubServer]:
    binary = etcd_cluster.binary
    extra = [f"--quota-backend-bytes={QUOTA}"]
    with EtcdCluster(size=1, extra_args=extra, binary=binary) as cluster:
        # The compactor is armed but slow: it must not compact before the test fills etcd.
        server = HubServer(
            cluster.endpoints, admin_token="admin", keys=Keys("/test/full"), compact_interval=30.0
        ).start()
        try:
            yield server
        finally:
            server.stop(grace=0.2)


def _writes_health(server: HubServer) -> int:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=WRITES_HEALTH_NAME)
        return int(stub.Check(request, timeout=5).status)


def _watch_writes_health(server: HubServer, seen: list[int]) -> Callable[[], None]:
    """Record every status of the writes health name (the compactor may clear NOSPACE
    within one poll, faster than a Check loop would catch it); returns the stop."""
    channel = grpc.insecure_channel(server.address)
    request = health_pb2.HealthCheckRequest(service=WRITES_HEALTH_NAME)
    stream = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=80)

    def pump() -> None:
        try:
            for reply in stream:
                seen.append(int(reply.status))
        except grpc.RpcError:
            pass  # cancelled at the end of the test
        finally:
            channel.close()

    threading.Thread(target=pump, daemon=True).start()
    return stream.cancel  # type: ignore[no-any-return]


@pytest.mark.timeout(90)
def test_publish_gets_storage_full_and_works_again_after_the_compactor(
    small_hub: HubServer,
) -> None:
    token = TenantStore(small_hub.etcd, small_hub.keys).create("team-a")
    statuses: list[int] = []
    stop_watching = _watch_writes_health(small_hub, statuses)
    hub = ros.connect(small_hub.address, tenant="team-a", token=token)
    try:
        # 16k float32 tensors: a ~600 KB manifest per version, paged in etcd. Retention keeps
        # 2 versions live; without compaction the history of the rest fills the quota.
        tensors = {f"t{i}": torch.zeros(1) for i in range(16_000)}
        full = None
        for version in range(1, 200):
            try:
                hub.publish("policy", version, tensors).release(force=True)
            except StorageFull as exc:
                full = exc
                break
        assert full is not None, "the small quota never filled"
        # The refusal itself turned the writes health NOT_SERVING (the compactor's state),
        # not the compactor's next check: it is still full, or already rescued since.
        noticed = small_hub.compactor.status()
        assert noticed.storage_full or noticed.disarms >= 1
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until("writes health NOT_SERVING", lambda: not_serving in statuses, 30)
        assert hub.latest("policy") == version - 1  # reads still work under NOSPACE

        def publishes() -> bool:
            try:
                hub.publish("policy", version + 100, {"w": torch.ones(4)}).release(force=True)
            except StorageFull:
                return False
            return True

        wait_until("a publish succeeds again", publishes, 60)
        assert hub.latest("policy") == version + 100
        wait_until("writes health SERVING", lambda: _writes_health(small_hub) == serving, 20)
        assert small_hub.compactor.status().disarms >= 1
        assert statuses[0] == serving
        assert statuses[-1] == serving
    finally:
        stop_watching()
        hub.close()
