"""etcd history is part of a tenant's budget (issue 25, item 3), against real etcds.

The review's fill: etcd's quota 256 MiB, two tenants each inside a 24 MiB live budget, one
of them rewriting 4 MiB manifests as fast as it can. Live bytes stayed small (retention
deleted the old versions), but every rewrite stayed in etcd's history until the next
compaction (5 min by default), and 30 publishes raised NOSPACE: every tenant's writes were
refused. Now each publish also spends its history cost from a bucket that refills at
`max_history_bytes` per compaction interval (`consistency.usage`), so the writer is refused
(`QuotaExceeded`) long before etcd fills, and the other tenant publishes undisturbed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from consistency import Etcd, EtcdCluster, Keys
from consistency.usage import RECORD_BYTES, TenantBudget, history_cost
from ros.errors import ERROR_METADATA_KEY
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

QUOTA = 256 << 20
LIVE = 24 << 20
ENTRY_BYTES = 64  # each tensor of the big manifest


@pytest.fixture
def quota_hub(etcd_cluster: EtcdCluster) -> Iterator[HubServer]:
    """A hub with the default compaction interval over its own etcd of a 256 MiB quota."""
    binary = etcd_cluster.binary
    with EtcdCluster(
        size=1, extra_args=[f"--quota-backend-bytes={QUOTA}"], binary=binary
    ) as cluster:
        server = HubServer(
            cluster.endpoints, admin_token="admin", keys=Keys("/test/history"),
            etcd_quota_bytes=QUOTA,
        ).start()  # fmt: skip
        try:
            yield server
        finally:
            server.stop(grace=0.2)


def manifest(nbytes: int) -> pb.Manifest:
    """A valid manifest of about `nbytes` serialized (tensors of 64 bytes, one chunk each
    4 MiB of data)."""
    count = nbytes // 40
    total = count * ENTRY_BYTES
    return pb.Manifest(
        tensors=[
            pb.TensorEntry(
                name=f"l{i:07d}", dtype="float32", shape=[16], offset=ENTRY_BYTES * i,
                nbytes=ENTRY_BYTES,
            )
            for i in range(count)
        ],
        total_bytes=total,
        chunk_size=4 << 20,
        chunk_xxh3=[0] * -(-total // (4 << 20)),
    )  # fmt: skip


def publish(
    stub: object, token: str, session: int, model: str, version: int, body: pb.Manifest
) -> str:
    request = pb.PublishRequest(
        model=model, version=version, manifest=body,
        holder=pb.Holder(name="w", endpoints={"tcp": "127.0.0.1:9"}, state=pb.COMPLETE,
                         session_id=session),
    )  # fmt: skip
    try:
        stub.Publish(request, metadata=(("authorization", f"Bearer {token}"),), timeout=30)  # type: ignore[attr-defined]
    except grpc.RpcError as exc:
        return dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY, exc.code().name)  # type: ignore[attr-defined]
    return ""


def test_a_tenant_inside_its_live_budget_cannot_fill_etcd_with_history(
    quota_hub: HubServer,
) -> None:
    store = TenantStore(quota_hub.etcd, quota_hub.keys)
    quotas = Quotas(max_etcd_bytes=LIVE, max_history_bytes=LIVE)
    attacker, other = store.create("writer", quotas), store.create("bystander", quotas)
    stub = hub_pb2_grpc.TensorHubStub(
        grpc.insecure_channel(quota_hub.address, [("grpc.max_send_message_length", 64 << 20)])
    )  # type: ignore[no-untyped-call]
    sessions = {
        token: stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=120),
                                metadata=(("authorization", f"Bearer {token}"),)).session_id
        for token in (attacker, other)
    }  # fmt: skip
    big, small = manifest(4 << 20), manifest(4 << 10)
    refused, others = [], []
    for version in range(1, 41):  # the review filled etcd in 30-32 of these
        refused.append(publish(stub, attacker, sessions[attacker], "big", version, big))
        others.append(publish(stub, other, sessions[other], "small", version, small))
    assert set(others) == {""}, others  # every one of the other tenant's publishes landed
    landed = refused.count("")
    cost = history_cost(big.ByteSize(), 64 << 10)
    assert 1 <= landed <= LIVE // cost + 1  # a full bucket's worth, then refused
    assert set(refused) == {"", "QuotaExceeded"}
    assert not [a for a in quota_hub.etcd.alarms() if a.kind == "NOSPACE"]


def test_the_history_bucket_refills_per_compaction_interval(etcd: Etcd, keys: Keys) -> None:
    now = [1000.0]
    budget = TenantBudget(
        etcd, keys, "t", max_bytes=1 << 30, publishes_per_minute=10_000,
        history_bytes=10 * (2 * 2048 + RECORD_BYTES), history_period=100.0, inline=1024,
        clock=lambda: now[0],
    )  # fmt: skip
    admitted, compares, puts, refusal = budget.charge_many([2048] * 12, 5.0)
    assert admitted == 10  # 2 x 2048 (paged: written twice) + a record's cost each
    assert refusal is not None
    assert "max_history_bytes" in str(refusal)
    etcd.txn(compares, puts)
    now[0] += 50.0  # half an interval: half the bucket back
    assert budget.charge_many([2048] * 12, 5.0)[0] == 5
    assert budget.charge_many([512] * 40, 5.0)[0] == 16  # inline: written once (512 + 1024)


def test_tenant_create_says_when_the_budgets_do_not_fit_etcd(quota_hub: HubServer) -> None:
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(quota_hub.address))  # type: ignore[no-untyped-call]
    admin = (("authorization", "Bearer admin"),)
    fits = pb.Quotas(max_etcd_bytes=LIVE, max_history_bytes=LIVE)
    first = stub.CreateTenant(pb.CreateTenantRequest(name="a", quotas=fits), metadata=admin)
    assert first.warning == ""
    over = stub.CreateTenant(pb.CreateTenantRequest(name="b"), metadata=admin)  # defaults
    assert "--etcd-quota-bytes" in over.warning
    assert str(QUOTA) in over.warning


def test_tenants_given_only_a_live_budget_get_as_much_history_while_publishing_at_once(
    quota_hub: HubServer,
) -> None:
    """Tenants created through `CreateTenant` with only `max_etcd_bytes` (the history budget
    left to its default, which follows it): A rewrites 4 MiB manifests as fast as the hub
    answers while B publishes beside it. A is refused after a 24 MiB bucket's worth, not
    the 256 MiB default's, so etcd never fills, and every one of B's publishes lands."""
    stub = hub_pb2_grpc.TensorHubStub(
        grpc.insecure_channel(quota_hub.address, [("grpc.max_send_message_length", 64 << 20)])
    )  # type: ignore[no-untyped-call]
    admin = (("authorization", "Bearer admin"),)
    only_live = pb.Quotas(max_etcd_bytes=LIVE)
    tokens = [
        stub.CreateTenant(pb.CreateTenantRequest(name=name, quotas=only_live), metadata=admin,
                          timeout=10).token
        for name in ("flood", "steady")
    ]  # fmt: skip
    flood, steady = (
        stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=120),
                         metadata=(("authorization", f"Bearer {token}"),), timeout=10).session_id
        for token in tokens
    )  # fmt: skip
    big, small = manifest(4 << 20), manifest(4 << 10)
    stop = threading.Event()
    flooded: list[str] = []

    def flood_loop() -> None:  # until B is done and A was refused; at most 40 publishes
        while len(flooded) < 40 and not (stop.is_set() and "QuotaExceeded" in flooded):
            flooded.append(publish(stub, tokens[0], flood, "big", len(flooded) + 1, big))

    thread = threading.Thread(target=flood_loop, daemon=True)
    thread.start()
    others = []
    for version in range(1, 9):
        others.append(publish(stub, tokens[1], steady, "small", version, small))
        time.sleep(0.1)
    stop.set()
    thread.join(60)
    assert not thread.is_alive()
    assert set(others) == {""}, others
    landed = flooded.count("")
    assert 1 <= landed <= LIVE // history_cost(big.ByteSize(), 64 << 10) + 1, flooded
    assert set(flooded) == {"", "QuotaExceeded"}, flooded
    assert not [a for a in quota_hub.etcd.alarms() if a.kind == "NOSPACE"]
