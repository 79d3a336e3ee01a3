"""`DeleteModel` racing the publish of a whole version (issue 25, "also untested"), inline
or paged, through a real hub (gRPC on loopback) over the real etcd. Shard bursts:
`test_review_delete_shards.py`.

Whatever the interleaving, afterwards the model is either entirely gone or its publish is
whole and visible: never a visible version with a missing key (header, page), never a key
of the deleted model left behind (a page, a holder record), and the tenant's usage key
charges exactly what is left (`tests.ros.review_state`).

The interleavings are forced with failpoints on the hub's etcd client (`HeldTxn` holds one
transaction at the door, `HeldDelete` one deletion), never with
sleeps. Three of them found the usage key wrong afterwards until the charge and the usage
were read in one read (`consistency.usage.release_version`, `release_model`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest

import ros
from consistency import EtcdCluster
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.consistency.test_manifests import big_manifest
from tests.ros import review_state
from tests.ros.failpoints import HeldDelete, HeldTxn
from tests.ros.helpers import make_model
from tests.ros.review_state import (
    ModelState,
    charged_by_keys,
    read_model,
    usage_held,
)
from tests.ros.test_burst import error_name, metadata, tenant
from tests.waiting import wait_until


def settled(hub: HubServer, name: str, model: str) -> ModelState:
    """`review_state.settled` on this hub's etcd and prefix."""
    return review_state.settled(hub.etcd, hub.keys, name, model)


def delete(stub: Any, md: Any, model: str) -> pb.DeleteModelResponse:
    answer: pb.DeleteModelResponse = stub.DeleteModel(
        pb.DeleteModelRequest(model=model), metadata=md, timeout=20
    )
    return answer


@pytest.mark.timeout(60)
def test_a_delete_between_a_publishs_read_and_its_transaction_leaves_it_whole_or_gone(
    hub_server: HubServer, connect: Callable[..., ros.Hub], held: list[HeldTxn]
) -> None:
    """The publish of policy@2 has read `latest` (1) and waits at its transaction while the
    delete removes the model; the publish then fails its compare, reads again and commits
    onto the empty model. Proves: policy@2 is then the whole model (header, holder record,
    latest 2, nothing of @1 left) and the budget charges exactly it."""
    client = connect("race-a")
    client.publish("policy", 1, make_model(1)).release(force=True)
    failpoint = HeldTxn(hub_server.etcd, hub_server.keys.latest("race-a", "policy"))
    held.append(failpoint)
    outcome: list[object] = []

    def publish() -> None:
        try:
            outcome.append(client.publish("policy", 2, make_model(2), timeout=20))
        except ros.TensorHubError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=publish)
    thread.start()
    assert failpoint.reached.wait(20), "the publish never reached its transaction"
    answer = client._rpc("DeleteModel", pb.DeleteModelRequest(model="policy"))
    assert answer.versions_deleted == 1
    failpoint.release()
    thread.join(30)
    (result,) = outcome
    state = settled(hub_server, "race-a", "policy")
    if isinstance(result, ros.TensorHubError):  # a definite refusal: then nothing is left
        assert state.empty, (result, state)
    else:
        assert state.latest == 2
        assert state.visible() == [2]
        assert [h.holder for h in state.holders[2]] == [client.holder_name]
        assert client.latest("policy") == 2


@pytest.mark.timeout(60)
def test_a_publish_that_lands_while_a_delete_waits_is_deleted_with_the_model(
    hub_server: HubServer, connect: Callable[..., ros.Hub], held: list[HeldTxn]
) -> None:
    """The delete has read the model's charge and waits at its transaction; policy@2 is
    published meanwhile. Proves: the delete's compare on the usage key fails, it reads
    again and removes @2 too (nothing of the model left), and the usage gives back both
    versions' bytes, not only those it read first."""
    client = connect("race-b")
    client.publish("policy", 1, make_model(1)).release(force=True)
    client.publish("kept", 1, make_model(3))  # another model: its charge must stay
    failpoint = HeldTxn(hub_server.etcd, hub_server.keys.quota_fence("race-b", "usage"))
    held.append(failpoint)
    answers: list[object] = []

    def run_delete() -> None:
        try:
            answers.append(client._rpc("DeleteModel", pb.DeleteModelRequest(model="policy")))
        except ros.TensorHubError as exc:
            answers.append(exc)

    thread = threading.Thread(target=run_delete)
    thread.start()
    assert failpoint.reached.wait(20), "the delete never reached its transaction"
    published = client.publish("policy", 2, make_model(2), timeout=20)
    assert published.visible
    failpoint.release()
    thread.join(30)
    (answer,) = answers
    assert isinstance(answer, pb.DeleteModelResponse), answer
    assert answer.versions_deleted == 2
    assert settled(hub_server, "race-b", "policy").empty
    assert client.latest("policy") == 0
    assert client.latest("kept") == 1
    assert usage_held(hub_server.etcd, hub_server.keys, "race-b") > 0  # "kept" still charged


@pytest.mark.timeout(60)
def test_a_publish_landing_while_the_delete_commits_is_not_left_charged(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    """The delete has read what the model's versions were charged (and, in the same read,
    the usage key) and its transaction is held at etcd's door; policy@2 is published in that
    window. The delete's compare on the usage key fails, it reads again and removes @2 too,
    giving back its bytes: the usage charges what is left. (It used to read the charge and
    the usage in two reads, and a publish between them stayed charged for keys deleted.)"""
    client = connect("race-f")
    client.publish("policy", 1, make_model(1)).release(force=True)
    failpoint = HeldDelete(hub_server.etcd, hub_server.keys.model("race-f", "policy"))
    answers: list[object] = []

    def run_delete() -> None:
        try:
            answers.append(client._rpc("DeleteModel", pb.DeleteModelRequest(model="policy")))
        except ros.TensorHubError as exc:
            answers.append(exc)

    try:
        thread = threading.Thread(target=run_delete)
        thread.start()
        assert failpoint.reached.wait(20), "the delete never sent its transaction"
        assert client.publish("policy", 2, make_model(2), timeout=20).visible
        failpoint.release()
        thread.join(30)
    finally:
        failpoint.remove()
    (answer,) = answers
    assert isinstance(answer, pb.DeleteModelResponse), answer
    assert read_model(hub_server.etcd, hub_server.keys, "race-f", "policy").empty
    left = usage_held(hub_server.etcd, hub_server.keys, "race-f")
    assert left == charged_by_keys(hub_server.etcd, hub_server.keys, "race-f") == 0, left


@pytest.mark.timeout(60)
def test_retention_racing_a_delete_gives_back_a_version_only_once(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    """policy@3 makes retention (2 versions kept) collect policy@1 on the hub's retention
    worker; its transaction is held at the door while `DeleteModel` removes the whole model
    and gives back every version's bytes, @1's included. Proves (when it passes): the
    collection, retried on the changed usage key, does not give @1's bytes back a second
    time, so the usage still charges what etcd holds (another model's bytes)."""
    client = connect("race-h")
    client.publish("kept", 1, make_model(5))
    for version in (1, 2):
        client.publish("policy", version, make_model(version)).release(force=True)
    failpoint = HeldDelete(hub_server.etcd, hub_server.keys.version("race-h", "policy", 1))
    try:
        client.publish("policy", 3, make_model(3)).release(force=True)
        assert failpoint.reached.wait(20), "retention never collected policy@1"
        answer = client._rpc("DeleteModel", pb.DeleteModelRequest(model="policy"))
        assert answer.versions_deleted == 3
        failpoint.release()
        wait_until(  # the collection retries on the usage key the delete changed, then ends
            "the retention worker is idle",
            lambda: hub_server.servicer.hub.collector.submit(lambda: None).result(20) is None,
        )
    finally:
        failpoint.remove()
    assert read_model(hub_server.etcd, hub_server.keys, "race-h", "policy").empty
    left = usage_held(hub_server.etcd, hub_server.keys, "race-h")
    assert left == charged_by_keys(hub_server.etcd, hub_server.keys, "race-h") > 0, left


@pytest.mark.timeout(60)
def test_two_replicas_collecting_the_same_version_give_it_back_once(
    hub_server: HubServer, etcd_cluster: EtcdCluster, make_tenant: Callable[[str], str]
) -> None:
    """The same double release without any delete: replica A's retention of policy@1 is
    held at its transaction while replica B publishes policy@4 and its own retention
    collects policy@1 (and @2). Proves (when it passes): A's retried collection gives
    nothing back twice, so the usage equals what the tenant's keys were charged."""
    token = make_tenant("race-i")
    other = HubServer(etcd_cluster.endpoints, admin_token="x", keys=hub_server.keys).start()
    a = ros.connect(hub_server.address, tenant="race-i", token=token)
    b = ros.connect(other.address, tenant="race-i", token=token)
    failpoint = HeldDelete(hub_server.etcd, hub_server.keys.version("race-i", "policy", 1))
    try:
        for version in (1, 2):
            a.publish("policy", version, make_model(version)).release(force=True)
        a.publish("policy", 3, make_model(3))  # A's retention collects @1: held at the door
        assert failpoint.reached.wait(20), "A's retention never collected policy@1"
        b.publish("policy", 4, make_model(4))
        wait_until(  # B's retention, on its own worker, collected @1 and @2
            "B collected policy@1 and @2",
            lambda: (
                read_model(hub_server.etcd, hub_server.keys, "race-i", "policy").visible() == [3, 4]
            ),
        )
        failpoint.release()
        wait_until(
            "A's retention worker is idle",
            lambda: hub_server.servicer.hub.collector.submit(lambda: None).result(20) is None,
        )
    finally:
        failpoint.remove()
        b.close()
        a.close()
        other.stop(grace=0.2)
    left = usage_held(hub_server.etcd, hub_server.keys, "race-i")
    assert left == charged_by_keys(hub_server.etcd, hub_server.keys, "race-i"), left


@pytest.mark.timeout(60)
def test_a_delete_between_staged_pages_and_their_commit_leaves_no_page(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    """A paged manifest (over 64 KiB) is staged under the publisher's lease before its
    transaction; the delete removes the pages in between. Proves: the publish is then
    either refused with a named error and leaves no page behind (it must not commit a
    header whose pages are gone), or whole with its pages; and publishing again works."""
    token = tenant(hub_server, "race-c")
    md = metadata(token)
    channel = grpc.insecure_channel(
        hub_server.address, options=[("grpc.max_send_message_length", 64 << 20)]
    )
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    try:
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=md).session_id
        manifest = pb.Manifest.FromString(big_manifest(tensors=2_000, chunks=6_000))
        holder = pb.Holder(name="t", endpoints={"tcp": "127.0.0.1:9"}, session_id=session)
        first = pb.PublishRequest(model="big", version=1, manifest=manifest, holder=holder)
        stub.Publish(first, metadata=md, timeout=30)  # so the delete has something to delete
        failpoint = HeldTxn(hub_server.etcd, hub_server.keys.latest("race-c", "big"))
        held.append(failpoint)
        outcome: list[object] = []
        second = pb.PublishRequest(model="big", version=2, manifest=manifest, holder=holder)

        def publish() -> None:
            try:
                outcome.append(stub.Publish(second, metadata=md, timeout=30))
            except grpc.RpcError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=publish)
        thread.start()
        assert failpoint.reached.wait(20), "the publish never reached its transaction"
        staged = read_model(hub_server.etcd, hub_server.keys, "race-c", "big")
        assert any(v == 2 for v, _, _ in staged.pages), "the pages of @2 were not staged"
        assert delete(stub, md, "big").versions_deleted == 1
        failpoint.release()
        thread.join(40)
        (result,) = outcome
        state = settled(hub_server, "race-c", "big")
        if isinstance(result, grpc.RpcError):
            assert error_name(result) not in ("", "InternalError"), result
            assert state.empty, (error_name(result), state)
        else:
            assert state.visible() == [2]
        again = pb.PublishRequest(model="big", version=3, manifest=manifest, holder=holder)
        assert stub.Publish(again, metadata=md, timeout=30).visible
        assert 3 in settled(hub_server, "race-c", "big").visible()
    finally:
        channel.close()
