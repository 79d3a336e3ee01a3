"""`DeleteModel` and `tensorhub delete MODEL` against a real hub and etcd (issue 12, item 8):
every key of the model goes (pages and counters too), a stuck model can be published again
from version 1, the models quota counts it gone, a republished version is never served
with the deleted one's cached manifest, and a tenant deletes only its own models.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import pytest
import torch

import ros
from consistency import HolderRecord, HolderState, VersionRegistry
from ros.cli import main
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.consistency.test_manifests import big_manifest
from tests.ros.conftest import ADMIN
from tests.ros.helpers import make_model


def _keys(hub_server: HubServer, tenant: str, what: str = "") -> list[bytes]:
    prefix = f"{hub_server.keys.tenant(tenant)}{what}"
    return [kv.key for kv in hub_server.etcd.range(prefix, prefix=True, keys_only=True).kvs]


def _token(client: ros.Hub) -> str:
    """The tenant token a client connected with (for the CLI)."""
    return dict(client._metadata)["authorization"].removeprefix("Bearer ")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_model_stuck_at_2_63_can_be_deleted_and_published_again_from_1(
    hub_server: HubServer,
    connect: Callable[..., ros.Hub],
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = connect("team-a")
    first = client.publish("stuck", 1, make_model(1))
    # As the old hub left it: `latest` (and a version key) at 2**63 - 1, written into etcd.
    keys, etcd, top = hub_server.keys, hub_server.etcd, 2**63 - 1
    header, _ = etcd.get(keys.manifest("team-a", "stuck", 1))
    assert header is not None
    etcd.put(f"{keys.versions('team-a', 'stuck')}{top:020d}/manifest", header.value)
    etcd.put(keys.latest("team-a", "stuck"), str(top))
    with pytest.raises(ros.StaleVersion):
        client.publish("stuck", 2, make_model(2))
    token = _token(client)
    code, out, err = _cli(
        capsys, "delete", "stuck", "--hub", hub_server.address, "--token", token, "--json"
    )
    assert code == 0, err
    answer = json.loads(out)
    assert answer["versions_deleted"] == 2
    assert answer["revision"] > 0
    assert not _keys(hub_server, "team-a", "m/stuck/")
    assert not _keys(hub_server, "team-a", "mp/stuck/")
    assert client.latest("stuck") == 0  # no version: as if never published
    first.release()  # its record went with the model: releasing is a local matter now
    client.publish("stuck", 1, make_model(3))
    assert client.latest("stuck") == 1


def test_every_key_goes_pages_and_shard_counters_included(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    client = connect("team-a")
    stub = hub_pb2_grpc.TensorHubStub(  # type: ignore[no-untyped-call]
        grpc.insecure_channel(
            hub_server.address, options=[("grpc.max_send_message_length", 64 << 20)]
        )
    )
    holder = pb.Holder(name="t", endpoints={"tcp": "127.0.0.1:1"}, session_id=client.session.id)
    big = pb.Manifest.FromString(big_manifest(tensors=2_000, chunks=6_000))  # paged
    stub.Publish(pb.PublishRequest(model="doomed", version=1, manifest=big, holder=holder),
                 metadata=client._metadata, timeout=30)  # fmt: skip
    for index in range(2):  # a model-parallel version: shard records and the arrival counter
        shard = pb.Holder(name=f"r{index}", endpoints={"tcp": "127.0.0.1:1"},
                          session_id=client.session.id, shard=index)  # fmt: skip
        stub.Publish(pb.PublishRequest(model="doomed", version=2, manifest=big, holder=shard,
                                       shard_index=index, shard_count=2),
                     metadata=client._metadata, timeout=30)  # fmt: skip
    client.publish("kept", 1, make_model(1))
    assert _keys(hub_server, "team-a", "mp/doomed/")
    answer = stub.DeleteModel(pb.DeleteModelRequest(model="doomed"), metadata=client._metadata,
                              timeout=10)  # fmt: skip
    assert answer.versions_deleted == 2
    assert not _keys(hub_server, "team-a", "m/doomed/")
    assert not _keys(hub_server, "team-a", "mp/doomed/")
    assert client.latest("kept") == 1  # nothing else touched
    with pytest.raises(ros.VersionNotFound):
        client.fetch("doomed", 1, timeout=5)
    with pytest.raises(grpc.RpcError) as info:  # nothing left: NOT_FOUND, nothing deleted
        stub.DeleteModel(pb.DeleteModelRequest(model="doomed"), metadata=client._metadata,
                         timeout=10)  # fmt: skip
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_republished_version_is_never_served_with_the_deleted_ones_manifest(
    connect: Callable[..., ros.Hub],
) -> None:
    """The hub caches manifests by version (they never change): a version number published
    again after a delete must not be answered with the first one's manifest."""
    trainer = connect("team-a")
    first = {"w": torch.arange(1024, dtype=torch.float32)}
    trainer.publish("again", 1, first)
    assert connect("team-a").fetch("again", 1, timeout=10).tensors["w"].shape == (1024,)
    trainer._rpc("DeleteModel", pb.DeleteModelRequest(model="again"))
    second = {"w": torch.arange(256, dtype=torch.int64), "b": torch.ones(3)}
    connect("team-a").publish("again", 1, second)
    held = connect("team-a").fetch("again", 1, timeout=10)
    assert set(held.tensors) == {"w", "b"}
    assert torch.equal(held.tensors["w"], second["w"])


def test_the_models_quota_counts_a_deleted_model_gone(hub_server: HubServer) -> None:
    admin = (("authorization", f"Bearer {ADMIN}"),)
    stub = hub_pb2_grpc.TensorHubStub(grpc.insecure_channel(hub_server.address))  # type: ignore[no-untyped-call]
    token = stub.CreateTenant(
        pb.CreateTenantRequest(name="small", quotas=pb.Quotas(max_models=1)),
        metadata=admin, timeout=5,
    ).token  # fmt: skip
    with ros.connect(hub_server.address, tenant="small", token=token) as client:
        client.publish("one", 1, make_model(1))
        with pytest.raises(ros.QuotaExceeded):
            client.publish("two", 1, make_model(1))
        client._rpc("DeleteModel", pb.DeleteModelRequest(model="one"))
        client.publish("two", 1, make_model(1))


def test_a_tenant_deletes_only_its_own_models_and_the_admin_any(
    hub_server: HubServer,
    connect: Callable[..., ros.Hub],
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = connect("team-a"), connect("team-b")
    a.publish("policy", 1, make_model(1))
    token_b = _token(b)
    hub = hub_server.address
    # b names a's tenant: refused; b deletes "its" policy: it has none (a's is untouched)
    code, _, err = _cli(capsys, "delete", "policy", "--hub", hub, "--token", token_b,
                        "--tenant", "team-a")  # fmt: skip
    assert code == 1
    assert "PermissionDenied" in err
    request = pb.DeleteModelRequest(model="policy", tenant="team-a")
    with pytest.raises(ros.PermissionDenied):
        b._rpc("DeleteModel", request)
    with pytest.raises(ros.VersionNotFound):
        b._rpc("DeleteModel", pb.DeleteModelRequest(model="policy"))
    assert a.latest("policy") == 1
    # the admin token needs --tenant, then deletes any tenant's model
    code, _, err = _cli(capsys, "delete", "policy", "--hub", hub, "--admin-token", ADMIN)
    assert code == 1
    assert "--tenant" in err
    code, out, err = _cli(capsys, "delete", "policy", "--hub", hub, "--admin-token", ADMIN,
                          "--tenant", "team-a")  # fmt: skip
    assert code == 0, err
    assert "model policy of team-a deleted: 1 version(s)" in out
    assert a.latest("policy") == 0


def test_a_model_written_with_a_holder_named_manifest_counts_one_version(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    """versions_deleted counts manifest headers, not keys that merely end in "manifest"."""
    client = connect("team-a")
    client.publish("odd", 1, make_model(1))
    record = HolderRecord("manifest", {"tcp": "127.0.0.1:1"}, state=HolderState.COMPLETE,
                          session=client.session.id)  # fmt: skip
    VersionRegistry(hub_server.etcd, hub_server.keys)  # the registry writes records as the hub
    hub_server.etcd.put(hub_server.keys.holder("team-a", "odd", 1, "manifest"), record.encode())
    answer = client._rpc("DeleteModel", pb.DeleteModelRequest(model="odd"))
    assert answer.versions_deleted == 1


def test_delete_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["delete", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "published again from version 1" in out
    assert "--admin-token" in out
