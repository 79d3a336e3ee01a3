"""Bad input gets INVALID_ARGUMENT (or its named error) with a clear message; nothing changes."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

import ros
from consistency import Etcd
from consistency.manifests import MAX_MANIFEST_BYTES, MAX_SHARDS
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.helpers import make_model


def snapshot(etcd: Etcd, prefix: str) -> list[tuple[bytes, bytes]]:
    """Every key and value under the test prefix except session markers (leases come and go)."""
    return [
        (kv.key, kv.value) for kv in etcd.range(prefix, prefix=True).kvs if b"/s/" not in kv.key
    ]


@pytest.fixture
def setup(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> tuple[ros.Hub, Callable[[], list[tuple[bytes, bytes]]]]:
    client = connect()
    client.publish("policy", 5, make_model(1))
    return client, lambda: snapshot(hub_server.etcd, hub_server.keys.prefix + "/")


@pytest.mark.parametrize("model", ["../x", "a/b", "", "X", "x" * 200, "pölicy"])
def test_invalid_model_names(
    setup: tuple[ros.Hub, Callable[[], list[tuple[bytes, bytes]]]], model: str
) -> None:
    client, snap = setup
    before = snap()
    with pytest.raises(ros.InvalidName, match="must match"):
        client.publish(model, 6, make_model(2))
    with pytest.raises(ros.InvalidName):
        client.latest(model)
    assert snap() == before


@pytest.mark.parametrize("version", [0, -1])
def test_zero_or_negative_versions(
    setup: tuple[ros.Hub, Callable[[], list[tuple[bytes, bytes]]]], version: int
) -> None:
    client, snap = setup
    before = snap()
    with pytest.raises(ros.InvalidArgument, match="positive"):
        client.publish("policy", version, make_model(2))
    assert snap() == before


def test_version_older_than_latest(
    setup: tuple[ros.Hub, Callable[[], list[tuple[bytes, bytes]]]],
) -> None:
    client, snap = setup
    before = snap()
    with pytest.raises(ros.StaleVersion, match="not newer than latest policy@5"):
        client.publish("policy", 4, make_model(2))
    assert snap() == before
    # and the publisher's memory is not left registered for serving
    assert client.holdings.get(("team-a", "policy", 4)) is None


def test_tensors_that_do_not_match_the_manifest(
    setup: tuple[ros.Hub, Callable[[], list[tuple[bytes, bytes]]]], connect: Callable[..., ros.Hub]
) -> None:
    _, snap = setup
    reader = connect()
    before = snap()
    cases = {
        "missing": {k: v for k, v in make_model(0).items() if k != "head.weight"},
        "dtype": {**make_model(0), "head.weight": torch.zeros(10, 64)},
        "shape": {**make_model(0), "embed.weight": torch.zeros(64, 256)},
        "extra": {**make_model(0), "surprise": torch.zeros(1)},
    }
    for what, into in cases.items():
        with pytest.raises(ros.InvalidArgument) as info:
            reader.fetch("policy", 5, into=into, timeout=5)
        assert str(info.value), what
    assert snap() == before


def test_raw_rpcs_get_invalid_argument_with_a_message(
    hub_server: HubServer, setup: tuple[ros.Hub, Callable[[], list[tuple[bytes, bytes]]]]
) -> None:
    client, snap = setup
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(hub_server.address))  # type: ignore[no-untyped-call]
    md = client._metadata
    holder = pb.Holder(name="h", endpoints={"tcp": "127.0.0.1:1"}, session_id=client.session.id)
    entry = pb.TensorEntry(name="w", dtype="float32", shape=[1], nbytes=4)
    before = snap()
    manifest = pb.Manifest(tensors=[entry])
    bad_holder = pb.Holder(name="BAD NAME", session_id=client.session.id)
    # over MAX_MANIFEST_BYTES (48 MiB), under the hub's 64 MiB gRPC messages
    huge = pb.Manifest(tensors=[entry], metadata={"blob": "x" * (MAX_MANIFEST_BYTES + 1)})
    cases = {
        "version": pb.PublishRequest(model="policy", version=-3, manifest=manifest, holder=holder),
        "holder": pb.PublishRequest(
            model="policy", version=9, manifest=manifest, holder=bad_holder
        ),
        "empty": pb.PublishRequest(
            model="policy", version=9, manifest=pb.Manifest(), holder=holder
        ),
        "oversized": pb.PublishRequest(model="policy", version=9, manifest=huge, holder=holder),
        "shards": pb.PublishRequest(
            model="policy", version=9, manifest=manifest, holder=holder, shard_count=MAX_SHARDS + 1
        ),
    }
    for what, request in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            stub.Publish(request, metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        assert info.value.details(), what
        if what == "oversized":
            assert f"the limit is {MAX_MANIFEST_BYTES} bytes" in (info.value.details() or "")
        if what == "shards":
            assert f"1 to {MAX_SHARDS} shards" in (info.value.details() or "")
    assert snap() == before


def test_quota_on_models(hub_server: HubServer) -> None:
    admin = (("authorization", "Bearer admin-secret-for-tests"),)
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(hub_server.address))  # type: ignore[no-untyped-call]
    token = stub.CreateTenant(
        pb.CreateTenantRequest(name="small", quotas=pb.Quotas(max_models=1, max_sessions=2)),
        metadata=admin,
        timeout=5,
    ).token
    with ros.connect(hub_server.address, tenant="small", token=token) as client:
        client.publish("one", 1, make_model(1))
        with pytest.raises(ros.QuotaExceeded, match="quota 1"):
            client.publish("two", 1, make_model(1))
        client.publish("one", 2, make_model(2))  # more versions of a known model are fine
        with (
            ros.connect(hub_server.address, tenant="small", token=token),
            pytest.raises(ros.QuotaExceeded, match="sessions"),
        ):
            ros.connect(hub_server.address, tenant="small", token=token)
