"""A bad holder endpoint can no longer poison a version (issue 12, item 6).

The attack: a tenant registers a holder record whose endpoint no reader can use
(`"not an endpoint"`, `"127.0.0.1:99999"`, `":80"`, `"host:"`). The old hub wrote it, and
every later fetch of that version failed at once with `InvalidArgument: invalid address`,
although the publisher still served it. Now the hub refuses such a record before any write,
and a reader that meets one anyway (written by an older hub) skips it and says why.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

import ros
from consistency.records import HolderRecord, HolderState
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.helpers import make_model
from tests.waiting import wait_until

BAD_ENDPOINTS = [
    "not an endpoint",
    "127.0.0.1:99999",
    ":80",
    "host:",
    "127.0.0.1:0",
    "::1:80",  # an IPv6 host must be bracketed
    "[::1:80",
    "999.1.1.1:80",
    "bad_host!:80",
]


def _snapshot(server: HubServer) -> list[tuple[bytes, bytes]]:
    """Every key and value under the test prefix except session markers."""
    prefix = server.keys.prefix + "/"
    return [
        (kv.key, kv.value)
        for kv in server.etcd.range(prefix, prefix=True).kvs
        if b"/s/" not in kv.key
    ]


def _refused(call: Callable[..., object], request: object, md: object) -> str:
    """Call a raw RPC that must be refused with INVALID_ARGUMENT; its message."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, metadata=md, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details() or ""


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_hub_refuses_a_bad_endpoint_before_any_write(
    hub_server: HubServer, connect: Callable[..., ros.Hub], endpoint: str
) -> None:
    client = connect()
    client.publish("policy", 1, make_model(1))
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(hub_server.address))  # type: ignore[no-untyped-call]
    md = client._metadata
    sid = client.session.id
    entry = pb.TensorEntry(name="w", dtype="float32", shape=[1], nbytes=4)
    before = _snapshot(hub_server)
    for kind in ("tcp", "rdma"):
        bad = pb.Holder(name="intruder", endpoints={kind: endpoint}, session_id=sid)
        publish = pb.PublishRequest(
            model="other", version=1, manifest=pb.Manifest(tensors=[entry]), holder=bad
        )
        assert "invalid endpoint" in _refused(stub.Publish, publish, md)
        register = pb.RegisterHolderRequest(model="policy", version=1, holder=bad)
        assert "invalid endpoint" in _refused(stub.RegisterHolder, register, md)
        update = pb.UpdateHolderRequest(model="policy", version=1, holder=bad)
        assert "invalid endpoint" in _refused(stub.UpdateHolder, update, md)
    assert _snapshot(hub_server) == before
    assert connect().fetch("policy", 1, timeout=20).version == 1  # the version is unharmed


def test_hub_refuses_unknown_kinds_and_holders_without_endpoints(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    client = connect()
    client.publish("policy", 1, make_model(1))
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(hub_server.address))  # type: ignore[no-untyped-call]
    before = _snapshot(hub_server)
    for endpoints in ({}, {"carrier-pigeon": "127.0.0.1:80"}):
        bad = pb.Holder(name="odd", endpoints=endpoints, session_id=client.session.id)
        request = pb.RegisterHolderRequest(model="policy", version=1, holder=bad)
        _refused(stub.RegisterHolder, request, client._metadata)
    assert _snapshot(hub_server) == before


def _plant(
    server: HubServer, owner: ros.Hub, model: str, version: int, name: str, endpoint: str
) -> None:
    """Write a COMPLETE holder record straight into etcd, under `owner`'s lease: what an
    older hub, which checked no endpoint, may have left behind."""
    record = HolderRecord(
        holder=name, endpoints={"tcp": endpoint}, state=HolderState.COMPLETE,
        session=owner.session.id,
    )  # fmt: skip
    key = server.keys.holder(owner.tenant, model, version, name)
    server.etcd.put(key, record.encode(), lease=owner.session.id, timeout=10)


def test_a_reader_skips_holders_with_bad_endpoints_and_says_why(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer, bystander, reader = connect(), connect(), connect()
    model = make_model(3)
    trainer.publish("policy", 1, model)
    planted = {f"old-{i}": endpoint for i, endpoint in enumerate(BAD_ENDPOINTS)}
    for name, endpoint in planted.items():
        _plant(hub_server, bystander, "policy", 1, name, endpoint)
    wait_until(
        "the hub lists the planted records",
        lambda: len(reader.inspect("policy", 1).holders) == 1 + len(planted),
    )
    held = reader.fetch("policy", 1, timeout=30)
    for name, tensor in model.items():
        assert torch.equal(held.tensors[name], tensor)
    assert set(held.stats.bytes_per_source) == {trainer.holder_name}
    skipped = {n: why for n, why in held.stats.failed_sources.items() if n in planted}
    assert set(skipped) <= set(planted)  # the Resolve answer may list only some of them
    for name, why in skipped.items():
        assert why.startswith("skipped: invalid endpoint"), (name, why)


def test_a_fetch_with_only_bad_endpoints_left_names_them(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer, bystander, reader = connect(), connect(), connect()
    trainer.publish("policy", 1, make_model(4)).release(force=True)
    _plant(hub_server, bystander, "policy", 1, "old-hub-holder", "127.0.0.1:99999")
    wait_until(
        "the hub lists only the planted record",
        lambda: [h.name for h in reader.inspect("policy", 1).holders] == ["old-hub-holder"],
    )
    with pytest.raises(ros.VersionUnavailable, match=r"old-hub-holder: skipped: invalid endpoint"):
        reader.fetch("policy", 1, timeout=20)


@pytest.mark.parametrize("advertise", ["not a host", "[::1", "999.1.1.1", "host:80"])
def test_connect_refuses_an_advertised_host_no_reader_could_use(
    hub_server: HubServer, make_tenant: Callable[[str], str], advertise: str
) -> None:
    with pytest.raises(ros.InvalidArgument, match="invalid endpoint"):
        ros.connect(
            hub_server.address, tenant="team-a", token=make_tenant("team-a"), advertise=advertise
        )
