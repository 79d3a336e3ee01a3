"""Issue 12, item 8 against a real hub and etcd: a malformed manifest is refused before any
write (the hub by a raw RPC, the SDK before it sends), a bad record already in etcd fails a
reader with a named error, versions are bounded, and a version too big for this machine
fails with `OutOfMemory`, never a bare RuntimeError. Item 9's bounds on topology labels and
manifest metadata, and large manifests and many shards through the hub, are here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

import ros
from consistency import HolderRecord, HolderState, VersionRegistry
from ros.hub.server import HubServer
from ros.manifest_check import MAX_METADATA_BYTES, MAX_TOPOLOGY_LABELS
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import InvalidManifest, OutOfMemory, TensorHubError
from tensorhub.names import MAX_VERSION
from tests.ros.helpers import make_model
from tests.ros.test_manifest_check import CASES, broken, good

Snapshot = Callable[[], list[tuple[bytes, bytes]]]


@pytest.fixture
def stub(hub_server: HubServer) -> Iterator[hub_pb2_grpc.TensorHubStub]:
    channel = grpc.insecure_channel(
        hub_server.address,
        options=[("grpc.max_send_message_length", 64 << 20)],
    )
    yield hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    channel.close()


@pytest.fixture
def client(connect: Callable[..., ros.Hub]) -> ros.Hub:
    hub = connect()
    hub.publish("policy", 5, make_model(1))
    return hub


@pytest.fixture
def snap(hub_server: HubServer) -> Snapshot:
    """Every key and value under the test's prefix but session markers."""
    prefix = hub_server.keys.prefix + "/"
    return lambda: [
        (kv.key, kv.value)
        for kv in hub_server.etcd.range(prefix, prefix=True).kvs
        if b"/s/" not in kv.key
    ]


def holder_of(
    client: ros.Hub, *, shard: int | None = None, topology: dict[str, str] | None = None
) -> pb.Holder:
    return pb.Holder(
        name="trainer", endpoints={"tcp": "127.0.0.1:1"}, session_id=client.session.id,
        shard=shard, topology=topology,
    )  # fmt: skip


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def error_class(error: grpc.RpcError) -> str:
    trailing: Any = error.trailing_metadata()
    return next((str(v) for k, v in trailing or () if k == "tensorhub-error"), "")


@pytest.mark.parametrize("case", CASES)
def test_the_hub_refuses_each_malformed_manifest_before_any_write(
    case: str, client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub, snap: Snapshot
) -> None:
    before = snap()
    for model, version in (("policy", 6), ("fresh", 1)):  # a known model and a new one
        request = pb.PublishRequest(
            model=model, version=version, manifest=broken(case), holder=holder_of(client)
        )
        error = refused(lambda r=request: stub.Publish(r, metadata=client._metadata, timeout=10))  # type: ignore[misc]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert error_class(error) == "InvalidManifest", case
        assert (error.details() or "").startswith("manifest: "), error.details()
    assert snap() == before  # nothing written: no version key, no page, latest unchanged
    assert client.latest("policy") == 5
    assert "fresh" not in [m for m, _ in _models(client)]


def test_a_shard_of_a_model_parallel_publish_is_checked_too(
    client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub, snap: Snapshot
) -> None:
    before = snap()
    request = pb.PublishRequest(
        model="tp", version=1, manifest=broken("overlapping offsets"),
        holder=holder_of(client, shard=1), shard_index=1, shard_count=2,
    )  # fmt: skip
    error = refused(lambda: stub.Publish(request, metadata=client._metadata, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("manifest of shard 1: "), error.details()
    assert snap() == before


def test_the_sdk_refuses_before_sending_with_the_hubs_message(
    client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub, snap: Snapshot
) -> None:
    long_name = "w" * 2000  # a tensor name no reader should have to carry
    sent = _publishes()
    before = snap()
    with pytest.raises(InvalidManifest) as local:
        client.publish("policy", 6, {long_name: make_model(0)["embed.weight"]})
    with pytest.raises(InvalidManifest, match="lists no tensors"):
        client.publish("policy", 6, {})
    assert _publishes() == sent  # no Publish reached the hub
    assert client.holdings.get(("team-a", "policy", 6)) is None  # nor is anything served
    # the hub says the same about the same manifest
    entry = pb.TensorEntry(name=long_name, dtype="float32", shape=[1024], nbytes=4096)
    manifest = pb.Manifest(tensors=[entry], total_bytes=4096, chunk_size=4096, chunk_xxh3=[1])
    request = pb.PublishRequest(model="policy", version=6, manifest=manifest,
                                holder=holder_of(client))  # fmt: skip
    error = refused(lambda: stub.Publish(request, metadata=client._metadata, timeout=10))
    assert error.details() == str(local.value)
    assert snap() == before


@pytest.mark.parametrize("case", ["1 TB tensor in a small version", "dtype float33",
                                  "checksum count", "overlapping offsets"])  # fmt: skip
def test_a_bad_manifest_already_in_etcd_fails_the_reader_by_name(
    case: str, hub_server: HubServer, client: ros.Hub, connect: Callable[..., ros.Hub]
) -> None:
    """Written straight into etcd (as before the hub validated): the reader refuses it with
    `InvalidManifest` before laying anything out; the 1 TB case was a bare RuntimeError."""
    _plant(hub_server, client, "planted", broken(case))
    reader = connect()
    with pytest.raises(InvalidManifest, match="manifest of planted@1"):
        reader.fetch("planted", 1, timeout=10)


def test_a_valid_version_too_big_for_this_machine_is_out_of_memory(
    hub_server: HubServer, client: ros.Hub, connect: Callable[..., ros.Hub]
) -> None:
    """1 TiB in 1 GiB chunks: a valid manifest (the hub must accept terabyte models), but no
    test machine can allocate it: `OutOfMemory`, not torch's RuntimeError."""
    size = 1 << 40
    entry = pb.TensorEntry(name="w", dtype="uint8", shape=[size], nbytes=size)
    manifest = pb.Manifest(
        tensors=[entry], total_bytes=size, chunk_size=1 << 30, chunk_xxh3=[0] * 1024
    )
    _plant(hub_server, client, "huge", manifest)
    with pytest.raises(TensorHubError) as info:
        connect().fetch("huge", 1, timeout=10)
    assert isinstance(info.value, OutOfMemory | ros.VersionUnavailable), info.value


def test_versions_are_bounded(
    client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub, snap: Snapshot
) -> None:
    before = snap()
    for version in (2**63 - 1, MAX_VERSION + 1):
        request = pb.PublishRequest(
            model="policy", version=version, manifest=good(), holder=holder_of(client)
        )
        error = refused(lambda r=request: stub.Publish(r, metadata=client._metadata, timeout=10))  # type: ignore[misc]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "MAX_VERSION" in (error.details() or "")
        with pytest.raises(ros.InvalidArgument, match="MAX_VERSION"):
            client.publish("policy", version, make_model(2))
    assert snap() == before
    client.publish("policy", MAX_VERSION, make_model(2))  # the bound itself is a version
    assert client.latest("policy") == MAX_VERSION


def test_topology_labels_are_bounded_before_any_write(
    client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub, snap: Snapshot
) -> None:
    before = snap()
    many = {f"label{i}": "x" for i in range(10_000)}
    long = {"dc": "dc1", "zone": "z" * (1 << 20)}
    for topology in (many, long):
        publish = pb.PublishRequest(
            model="policy", version=6, manifest=good(), holder=holder_of(client, topology=topology)
        )
        register = pb.RegisterHolderRequest(
            model="policy", version=5, holder=holder_of(client, topology=topology)
        )
        for method, request in (("Publish", publish), ("RegisterHolder", register)):
            error = refused(
                lambda m=method, r=request: getattr(stub, m)(  # type: ignore[misc]
                    r, metadata=client._metadata, timeout=10
                )
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "topology" in (error.details() or ""), error.details()
        resolve = pb.ResolveRequest(model="policy", version=5, topology=topology)
        error = refused(lambda r=resolve: stub.Resolve(r, metadata=client._metadata, timeout=10))  # type: ignore[misc]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert snap() == before
    fine = {f"l{i}": "v" for i in range(MAX_TOPOLOGY_LABELS)}
    stub.Publish(
        pb.PublishRequest(model="policy", version=6, manifest=good(),
                          holder=holder_of(client, topology=fine)),
        metadata=client._metadata, timeout=10,
    )  # fmt: skip


def test_metadata_is_bounded_before_any_write(
    client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub, snap: Snapshot
) -> None:
    before = snap()
    manifest = good()
    manifest.metadata["blob"] = "x" * (1_400_000)  # 1.4 MB: was accepted unchecked
    request = pb.PublishRequest(
        model="policy", version=6, manifest=manifest, holder=holder_of(client)
    )
    error = refused(lambda: stub.Publish(request, metadata=client._metadata, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"exceeds {MAX_METADATA_BYTES} bytes" in (error.details() or "")
    assert snap() == before


def test_large_manifests_and_many_shards_publish_or_fail_by_name(
    client: ros.Hub, stub: hub_pb2_grpc.TensorHubStub
) -> None:
    """Issue 12, item 9: manifests of 1.5-16 MiB and shard_count >= 200 answered UNKNOWN
    "etcd error". Each is now paged (or fails with a named error): here they publish."""
    for model, mib in (("m2", 2), ("m16", 16)):
        chunks = (mib << 20) // 9  # about 9 bytes per checksum on the wire
        entry = pb.TensorEntry(name="w", dtype="uint8", shape=[chunks * 4096], nbytes=chunks * 4096)
        manifest = pb.Manifest(tensors=[entry], total_bytes=chunks * 4096, chunk_size=4096,
                               chunk_xxh3=[(1 << 63) + i for i in range(chunks)])  # fmt: skip
        assert manifest.ByteSize() > 1.5 * (1 << 20) * (mib / 2)
        answer = stub.Publish(
            pb.PublishRequest(model=model, version=1, manifest=manifest, holder=holder_of(client)),
            metadata=client._metadata, timeout=30,
        )  # fmt: skip
        assert answer.visible
    shards = 256
    for index in range(shards):
        answer = stub.Publish(
            pb.PublishRequest(model="wide", version=1, manifest=good(),
                              holder=holder_of(client, shard=index),
                              shard_index=index, shard_count=shards),
            metadata=client._metadata, timeout=30,
        )  # fmt: skip
    assert answer.visible
    assert client.latest("wide") == 1


def _plant(hub_server: HubServer, client: ros.Hub, model: str, manifest: pb.Manifest) -> None:
    """Version 1 of `model`, written straight into etcd (no hub, no validation), held by a
    holder that is never dialled (port 1) under the client's session."""
    record = HolderRecord(
        "planted", {"tcp": "127.0.0.1:1"}, state=HolderState.COMPLETE, session=client.session.id
    )
    VersionRegistry(hub_server.etcd, hub_server.keys).publish(
        client.tenant, model, 1, manifest.SerializeToString(), record, timeout=10
    )


def _models(client: ros.Hub) -> list[tuple[str, int]]:
    listed = client._rpc("ListModels", pb.ListModelsRequest())
    return [(m.name, m.latest) for m in listed.models]


def _publishes() -> float:
    return sum(
        REGISTRY.get_sample_value("tensorhub_hub_requests_total", {"method": "Publish", "code": c})
        or 0.0
        for c in ("OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED")
    )
