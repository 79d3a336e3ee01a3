"""A tenant's etcd budget (issue 12, item 3): live manifest bytes and publishes per minute,
enforced before any write and across replicas; and NOSPACE named on every write path.

A real hub over the session's real etcd (and, for NOSPACE, a member of the test's own).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from etcd3 import etcdrpc

import ros
from consistency import Etcd, EtcdCluster, Keys
from consistency.usage import Usage
from ros.errors import from_rpc_error
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import QuotaExceeded, StorageFull
from tests.ros.conftest import ADMIN
from tests.ros.review_state import model_charge
from tests.waiting import wait_until

TENSORS = 20_000  # one float each: a manifest of ~0.8 MB, paged in etcd


def _big() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(1) for i in range(TENSORS)}


def _usage(etcd: Etcd, keys: Keys, tenant: str) -> Usage:
    kv, _ = etcd.get(keys.quota_fence(tenant, "usage"))
    return Usage() if kv is None else Usage.decode(kv.value)


def _keys_under(etcd: Etcd, prefix: str) -> int:
    return len(etcd.range(prefix, prefix=True, keys_only=True).kvs)


@pytest.mark.timeout(180)
def test_live_bytes_past_the_quota_are_refused_before_any_write(
    hub_server: HubServer, etcd: Etcd, keys: Keys
) -> None:
    """Each published version of a big manifest stays live (one model each): the third no
    longer fits 2.5 manifests' worth and is refused with QuotaExceeded, nothing written;
    another tenant keeps publishing; once one model is deleted, the third fits. Retention
    gives bytes back: one model published over and over (2 versions kept, a third live
    while it is published) stays within 3.5."""
    tenants = TenantStore(etcd, keys)
    with ros.connect(hub_server.address, tenant="probe", token=tenants.create("probe")) as p:
        p.publish("m", 1, _big()).release(force=True)
    size = _usage(etcd, keys, "probe").held
    assert size > 500_000
    quota = int(size * 2.5)
    token = tenants.create("team-a", Quotas(max_etcd_bytes=quota))
    token_b = tenants.create("team-b")
    tensors = _big()
    with (
        ros.connect(hub_server.address, tenant="team-a", token=token) as hub,
        ros.connect(hub_server.address, tenant="team-b", token=token_b) as other,
    ):
        hub.publish("m1", 1, tensors).release(force=True)
        hub.publish("m2", 1, tensors).release(force=True)
        before = _usage(etcd, keys, "team-a")
        pages = _keys_under(etcd, keys.tenant("team-a"))
        with pytest.raises(QuotaExceeded, match="max_etcd_bytes"):
            hub.publish("m3", 1, tensors)
        assert hub.latest("m3") == 0
        assert _usage(etcd, keys, "team-a").held == before.held
        assert _keys_under(etcd, keys.tenant("team-a")) == pages  # nothing was written
        other.publish("m3", 1, tensors).release(force=True)  # another tenant is unaffected
        assert other.latest("m3") == 1

        # Deleting a model gives its bytes back in the same transaction: m3 fits now.
        with grpc.insecure_channel(hub_server.address) as channel:
            stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
            auth = (("authorization", f"Bearer {token}"),)
            stub.DeleteModel(pb.DeleteModelRequest(model="m2"), metadata=auth, timeout=10)
        assert _usage(etcd, keys, "team-a").held < before.held
        hub.publish("m3", 1, tensors).release(force=True)
        assert hub.latest("m3") == 1

    token_r = tenants.create("team-r", Quotas(max_etcd_bytes=int(size * 3.5)))
    with ros.connect(hub_server.address, tenant="team-r", token=token_r) as hub:
        for version in range(1, 8):
            wait_until(
                "retention gave old versions' bytes back",
                lambda: _usage(etcd, keys, "team-r").held <= 2.1 * size,
                30,
            )
            hub.publish("m", version, tensors).release(force=True)
        assert hub.latest("m") == 7


@pytest.mark.timeout(120)
def test_a_fast_publisher_is_refused_past_its_rate_on_every_replica(
    hub_server: HubServer, etcd_cluster: EtcdCluster, etcd: Etcd, keys: Keys
) -> None:
    """3 publishes per minute, shared by two replicas: alternating between them, the
    tenant is refused with QuotaExceeded after its 3 (plus what the bucket refilled
    meanwhile), nothing written; another tenant on the same replicas still publishes."""
    rate = 3
    tenants = TenantStore(etcd, keys)
    token = tenants.create("team-fast", Quotas(max_publishes_per_minute=rate))
    token_b = tenants.create("team-b")
    second = HubServer(etcd_cluster.endpoints, admin_token=ADMIN, keys=keys).start()
    tiny = {"w": torch.ones(4)}
    try:
        with (
            ros.connect(hub_server.address, tenant="team-fast", token=token) as one,
            ros.connect(second.address, tenant="team-fast", token=token) as two,
            ros.connect(second.address, tenant="team-b", token=token_b) as other,
        ):
            started = time.monotonic()
            published = 0
            refused: QuotaExceeded | None = None
            for version in range(1, 21):
                try:
                    (one if version % 2 else two).publish("m", version, tiny).release(force=True)
                except QuotaExceeded as exc:
                    refused = exc
                    break
                published += 1
            elapsed = time.monotonic() - started
            assert refused is not None, "20 publishes were never refused"
            assert "max_publishes_per_minute" in str(refused)
            assert rate <= published <= rate + 1 + int(elapsed * rate / 60)
            assert one.latest("m") == published  # the refused one wrote nothing
            for version in range(1, 6):
                other.publish("m", version, tiny).release(force=True)
            assert other.latest("m") == 5
    finally:
        second.stop(grace=0.2)


@pytest.mark.timeout(120)
def test_each_replica_s_cached_usage_stays_exact_across_replicas(
    hub_server: HubServer, etcd_cluster: EtcdCluster, etcd: Etcd, keys: Keys
) -> None:
    """Each replica charges against the usage it last saw (`UsageCache`); a publish through
    one replica makes the other's copy stale. Alternating replicas over models of
    different sizes, the usage key still ends exactly at the sum of every model's charge
    (no charge lost or counted twice), and the refusal comes on whichever replica is next."""
    tenants = TenantStore(etcd, keys)
    with ros.connect(hub_server.address, tenant="probe", token=tenants.create("probe")) as p:
        p.publish("m", 1, {"w": torch.ones(8)}).release(force=True)
    small = _usage(etcd, keys, "probe").held
    token = tenants.create("team-x", Quotas(max_etcd_bytes=small * 6 + small // 2))
    second = HubServer(etcd_cluster.endpoints, admin_token=ADMIN, keys=keys).start()
    try:
        with (
            ros.connect(hub_server.address, tenant="team-x", token=token) as one,
            ros.connect(second.address, tenant="team-x", token=token) as two,
        ):
            for index in range(1, 7):
                (one if index % 2 else two).publish(f"m{index}", 1, {"w": torch.ones(8)})
            with pytest.raises(QuotaExceeded, match="max_etcd_bytes"):
                # `one` last saw the usage after the fifth: its copy admits, the compare
                # fails, and the usage read again refuses
                one.publish("m7", 1, {"w": torch.ones(8)})
            assert one.latest("m7") == 0
            charged = sum(model_charge(etcd, keys, "team-x", f"m{i}", 5.0) for i in range(1, 7))
            assert _usage(etcd, keys, "team-x").held == charged == 6 * small
    finally:
        second.stop(grace=0.2)


@pytest.fixture
def nospace_hub(etcd_cluster: EtcdCluster) -> Iterator[tuple[HubServer, Etcd]]:
    """A hub over a member of its own whose NOSPACE alarm the test raises (no compactor)."""
    binary = etcd_cluster.binary
    with EtcdCluster(size=1, binary=binary) as cluster:
        server = HubServer(
            cluster.endpoints, admin_token=ADMIN, keys=Keys("/test/nospace"), compact_interval=0
        ).start()
        etcd = Etcd(cluster.endpoints)
        try:
            yield server, etcd
        finally:
            etcd.close()
            server.stop(grace=0.2)


def _alarm(etcd: Etcd, action: int) -> None:
    member, _ = etcd.status()
    request = etcdrpc.AlarmRequest(action=action, memberID=member, alarm=etcdrpc.NOSPACE)
    etcd.call(lambda m, t: m.maintenance.Alarm(request, timeout=t), timeout=10)


@pytest.mark.timeout(60)
def test_nospace_is_storage_full_on_open_session_and_create_tenant(
    nospace_hub: tuple[HubServer, Etcd],
) -> None:
    """With etcd's NOSPACE alarm raised, OpenSession (so `ros.connect`) and the admin's
    CreateTenant answer StorageFull, not UNKNOWN "etcd error"; both work once it clears."""
    server, etcd = nospace_hub
    token = TenantStore(server.etcd, server.keys).create("team-a")
    _alarm(etcd, etcdrpc.AlarmRequest.ACTIVATE)
    try:
        with pytest.raises(StorageFull):
            ros.connect(server.address, tenant="team-a", token=token)
        with grpc.insecure_channel(server.address) as channel:
            stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
            admin = (("authorization", f"Bearer {ADMIN}"),)
            with pytest.raises(grpc.RpcError) as info:
                stub.CreateTenant(pb.CreateTenantRequest(name="team-z"), metadata=admin, timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert isinstance(from_rpc_error(info.value), StorageFull)
    finally:
        _alarm(etcd, etcdrpc.AlarmRequest.DEACTIVATE)
    with ros.connect(server.address, tenant="team-a", token=token) as hub:
        assert hub.latest("m") == 0
