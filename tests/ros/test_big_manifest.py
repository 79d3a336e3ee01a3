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
from ros.hub.tenants import Quotas
from ros.manifest_check import check_manifest
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub import delta_rules
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


def with_delta(raw: bytes, share: float = 0.02) -> tuple[pb.Manifest, pb.Manifest]:
    """The big manifest with a delta section encoding every chunk (the section's worst
    case: one size and two checksums per chunk), and its companion's manifest (one uint8
    tensor, the encoded chunks back to back, `share` of a chunk each)."""
    manifest = pb.Manifest.FromString(raw)
    chunks, size = len(manifest.chunk_xxh3), int(share * manifest.chunk_size)
    manifest.delta.CopyFrom(
        pb.Delta(
            base=1,
            encoding=delta_rules.ENCODING,
            encoded_bytes=[size] * chunks,
            encoded_xxh3=[(i * 7 + 1) & (2**64 - 1) for i in range(chunks)],
            base_checksum=list(manifest.chunk_xxh3),
            companion=delta_rules.companion_of("big"),
        )
    )
    companion = pb.Manifest(chunk_size=manifest.chunk_size, total_bytes=size * chunks)
    companion.tensors.add(name=delta_rules.TENSOR, dtype="uint8", shape=[size * chunks],
                          offset=0, nbytes=size * chunks)  # fmt: skip
    count = -(-companion.total_bytes // companion.chunk_size)
    companion.chunk_xxh3.extend(range(1, count + 1))
    return manifest, companion


def test_a_delta_of_the_300k_chunk_version_stays_inside_the_manifest_and_budget_bounds(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    """Issue 22, item 1: at 100,000 tensors and 300,000 chunks, the delta section and the
    companion's manifest stay under MAX_MANIFEST_BYTES each, and the two versions with their
    companion under the tenant's default etcd budget; the hub takes the delta version."""
    raw = big_manifest()
    manifest, companion = with_delta(raw)
    check_manifest(manifest, model="big", version=2)
    check_manifest(companion, model="big.delta", version=2)
    grown = manifest.ByteSize() - len(raw)
    figures = {
        "whole": len(raw), "with delta": manifest.ByteSize(), "grown": grown,
        "companion": companion.ByteSize(), "limit": MAX_MANIFEST_BYTES,
    }  # fmt: skip
    print("manifest bytes at 100,000 tensors / 300,000 chunks:", figures)
    assert grown < 20 * 300_000  # one varint size and two fixed64 checksums per chunk
    assert manifest.ByteSize() < MAX_MANIFEST_BYTES
    assert companion.ByteSize() < MAX_MANIFEST_BYTES
    assert len(raw) + manifest.ByteSize() + companion.ByteSize() < Quotas.max_etcd_bytes
    client = connect()
    channel = grpc.insecure_channel(
        hub_server.address, options=[("grpc.max_send_message_length", 64 << 20)]
    )
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    holder = pb.Holder(
        name="trainer", endpoints={"tcp": "127.0.0.1:1"}, session_id=client.session.id
    )
    published = stub.Publish(
        pb.PublishRequest(model="big", version=2, manifest=manifest, holder=holder),
        metadata=client._metadata, timeout=60,
    )  # fmt: skip
    assert published.visible
    channel.close()
