"""A 100,000-tensor / 300,000-chunk manifest through the hub: Publish, then Resolve it back;
the hub's publish limits, exported as metrics.

The registry pages it in etcd (`consistency.manifests`); here the hub's own path is checked
end to end, at etcd's default request limit, with the digest the response carries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import grpc
import pytest
from prometheus_client import REGISTRY

import ros
from consistency.manifests import MAX_MANIFEST_BYTES, MAX_SHARDS
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.consistency.test_manifests import big_manifest


def test_a_300k_chunk_manifest_publishes_and_resolves_through_the_hub(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    client = connect()
    raw = big_manifest()
    manifest = pb.Manifest.FromString(raw)
    channel = grpc.insecure_channel(
        hub_server.address,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    md = client._metadata
    holder = pb.Holder(
        name="trainer", endpoints={"tcp": "127.0.0.1:1"}, session_id=client.session.id
    )
    published = stub.Publish(
        pb.PublishRequest(model="big", version=1, manifest=manifest, holder=holder),
        metadata=md,
        timeout=30,
    )
    assert published.visible
    resolved = stub.Resolve(pb.ResolveRequest(model="big", version=1), metadata=md, timeout=30)
    assert resolved.manifest.SerializeToString() == raw
    assert len(resolved.manifest.chunk_xxh3) == 300_000
    assert len(resolved.manifest.tensors) == 100_000
    assert resolved.manifest_digest == hashlib.sha256(raw).digest()
    channel.close()


def test_publish_limits_are_exported_and_refusals_counted(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    client = connect()
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(hub_server.address))  # type: ignore[no-untyped-call]
    holder = pb.Holder(
        name="trainer", endpoints={"tcp": "127.0.0.1:1"}, session_id=client.session.id
    )
    entry = pb.TensorEntry(name="w", dtype="float32", shape=[1], nbytes=4)

    def sample(name: str, limit: str) -> float:
        return REGISTRY.get_sample_value(name, {"limit": limit}) or 0.0

    assert sample("tensorhub_hub_publish_limit", "manifest_bytes") == MAX_MANIFEST_BYTES
    assert sample("tensorhub_hub_publish_limit", "shards") == MAX_SHARDS
    refused = sample("tensorhub_hub_publishes_refused_total", "shards")
    request = pb.PublishRequest(
        model="m", version=1, manifest=pb.Manifest(tensors=[entry]), holder=holder,
        shard_index=0, shard_count=MAX_SHARDS + 1,
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        stub.Publish(request, metadata=client._metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sample("tensorhub_hub_publishes_refused_total", "shards") == refused + 1
