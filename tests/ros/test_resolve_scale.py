"""Resolve at scale: bounded candidates, freshness across replicas, shards, paged Inspect.

Holders are registered straight through the hub's RPCs (under one real session), so 120 of
them cost milliseconds each instead of one SDK client apiece; the hub and etcd are real.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import pytest
import torch

import ros
from consistency import Etcd, EtcdCluster, Keys
from ros.hub.candidates import MAX_CANDIDATES
from ros.hub.holder_index import HolderIndex
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tests.ros.conftest import ADMIN
from tests.ros.helpers import digest, make_model

READERS = 120


def holder(client: ros.Hub, name: str, **topology: str) -> pb.Holder:
    return pb.Holder(
        name=name, endpoints={"tcp": "127.0.0.1:9"}, topology=topology, state=pb.PARTIAL,
        session_id=client.session.id,
    )  # fmt: skip


def register(
    client: ros.Hub, model: str, version: int, name: str, shard: int | None = None, **topo: str
) -> pb.RegisterHolderResponse:
    message = holder(client, name, **topo)
    if shard is not None:
        message.shard = shard
    request = pb.RegisterHolderRequest(model=model, version=version, holder=message)
    response: pb.RegisterHolderResponse = client._rpc("RegisterHolder", request)
    return response


@pytest.fixture
def second_replica(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    server = HubServer(etcd_cluster.endpoints, admin_token=ADMIN, keys=keys).start()
    yield server
    server.stop(grace=0.2)


def test_candidates_are_bounded_and_hold_the_pipeline_predecessor(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer = connect()
    trainer.publish("policy", 1, make_model(1))
    fences = {}
    previous = trainer.holder_name
    for i in range(READERS):
        name = f"reader-{i:03d}"
        answer = register(trainer, "policy", 1, name)
        names = [h.name for h in answer.candidates]
        assert len(names) <= MAX_CANDIDATES
        assert name not in names
        assert previous in names  # the chain: each reader's predecessor is the one before
        assert answer.total_holders == i + 2
        fences[name] = answer.fence
        previous = name
    # a Resolve answers a bounded selection too, and counts every holder
    resolved = trainer._rpc("Resolve", pb.ResolveRequest(model="policy", version=1))
    assert len(resolved.holders) <= MAX_CANDIDATES
    assert resolved.total_holders == READERS + 1
    # from the fence of reader 60: readers registered after it are no candidates
    me = "reader-060"
    request = pb.ResolveRequest(model="policy", version=1, fence=fences[me], holder=me)
    mine = trainer._rpc("Resolve", request)
    assert me not in [h.name for h in mine.holders]
    assert "reader-059" in [h.name for h in mine.holders]
    assert all(h.state == pb.COMPLETE or h.fence < fences[me] for h in mine.holders)


def test_nearest_tier_first(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect(topology={"dc": "dc1", "rack": "a", "host": "t"})
    trainer.publish("policy", 1, make_model(1))
    register(trainer, "policy", 1, "far", dc="dc2", rack="b", host="x")
    register(trainer, "policy", 1, "same-dc", dc="dc1", rack="b", host="y")
    register(trainer, "policy", 1, "same-rack", dc="dc1", rack="a", host="z")
    register(trainer, "policy", 1, "same-host", dc="dc1", rack="a", host="h")
    request = pb.ResolveRequest(
        model="policy", version=1, topology={"dc": "dc1", "rack": "a", "host": "h"}
    )
    names = [h.name for h in trainer._rpc("Resolve", request).holders]
    assert names.index("same-host") < names.index("same-rack") < names.index("same-dc")
    assert names.index("same-dc") < names.index("far")


def test_a_resolve_on_another_replica_honours_the_revision_floor(
    connect: Callable[..., ros.Hub], second_replica: HubServer
) -> None:
    trainer = connect()
    trainer.publish("policy", 1, make_model(1))
    other = ros.connect(second_replica.address, tenant="team-a", token=trainer._metadata[0][1][7:])
    try:
        other._rpc("Resolve", pb.ResolveRequest(model="policy", version=1))  # index warm
        for i in range(5):
            fence = register(trainer, "policy", 1, f"new-{i}").fence
            request = pb.ResolveRequest(model="policy", version=1, min_revision=fence)
            answer = other._rpc("Resolve", request)
            assert answer.revision >= fence
            assert f"new-{i}" in [h.name for h in answer.holders]
            assert answer.total_holders == i + 2
        # a floor with no event of this model behind it (a revision of another key) is met
        # through etcd's progress notification, not by waiting for an event
        unrelated = trainer._rpc("Latest", pb.LatestRequest(model="nothing")).revision
        request = pb.ResolveRequest(model="policy", version=1, min_revision=unrelated)
        assert other._rpc("Resolve", request).revision >= unrelated
    finally:
        other.close()


def test_manifest_once_and_its_digest_always(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect()
    trainer.publish("policy", 1, make_model(1))
    full = trainer._rpc("Resolve", pb.ResolveRequest(model="policy", version=1))
    assert full.manifest.tensors
    assert not full.manifest_omitted
    assert bytes(full.manifest_digest) == hashlib.sha256(full.manifest.SerializeToString()).digest()
    bare = trainer._rpc("Resolve", pb.ResolveRequest(model="policy", version=1, omit_manifest=True))
    assert bare.manifest_omitted
    assert not bare.manifest.tensors
    assert bare.manifest_digest == full.manifest_digest
    assert bare.ByteSize() < full.ByteSize()
    # the SDK caches it: a second fetch of the version asks without it, and reads right
    reader = connect()
    model = make_model(1)
    first = reader.fetch("policy", 1, timeout=30)
    assert digest(first.tensors) == digest(model)
    first.release()
    assert len(reader._reads.manifests) == 1
    again = reader.fetch("policy", 1, into={k: torch.empty_like(v) for k, v in model.items()})
    assert digest(again.tensors) == digest(model)


def test_sharded_candidates_and_manifest_are_of_the_shard_only(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = [connect() for _ in range(2)]
    parts = [{f"w{i}": torch.full((64,), float(i))} for i in range(2)]
    for i, t in enumerate(trainers):
        t.publish("policy", 1, parts[i], shard=(i, 2))
    for i in range(6):
        register(trainers[0], "policy", 1, f"s{i % 2}-reader-{i}", shard=i % 2)
    for shard in (0, 1):
        request = pb.ResolveRequest(model="policy", version=1, shard=shard)
        answer = trainers[0]._rpc("Resolve", request)
        assert answer.shard_count == 2
        assert not answer.shards
        assert [t.name for t in answer.manifest.tensors] == [f"w{shard}"]
        assert {h.shard for h in answer.holders} == {shard}
        assert answer.total_holders == 4  # its publisher and three readers
        assert trainers[shard].holder_name in [h.name for h in answer.holders]
    with pytest.raises(ros.InvalidArgument, match="out of range"):
        trainers[0]._rpc("Resolve", pb.ResolveRequest(model="policy", version=1, shard=2))


def test_inspect_pages_list_every_holder_exactly_once(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect()
    trainer.publish("policy", 1, make_model(1))
    for i in range(READERS):
        register(trainer, "policy", 1, f"reader-{i:03d}")
    seen: list[str] = []
    request = pb.InspectRequest(model="policy", version=1, page_size=25)
    pages = 0
    while True:
        page = trainer._rpc("Inspect", request)
        pages += 1
        assert len(page.holders) <= 25
        assert page.total_holders == READERS + 1
        assert bool(page.manifest.tensors) == (pages == 1)
        seen += [h.name for h in page.holders]
        if not page.next_page_token:
            break
        request.page_token, request.omit_manifest = page.next_page_token, True
    assert pages == 5
    assert sorted(seen) == seen
    assert len(set(seen)) == len(seen) == READERS + 1
    assert {h.holder for h in trainer.holders("policy", 1)} == set(seen)  # the SDK follows
    with pytest.raises(ros.InvalidArgument):
        trainer._rpc("Inspect", pb.InspectRequest(model="policy", version=1, page_size=-1))


def test_a_partial_holder_pins_its_version_until_complete(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect()
    trainer.publish("policy", 1, make_model(1))
    answer = register(trainer, "policy", 1, "reader")
    assert list(trainer.inspect("policy", 1).pins) == ["reader"]
    done = holder(trainer, "reader")
    done.state, done.fence = pb.COMPLETE, answer.fence
    trainer._rpc("UpdateHolder", pb.UpdateHolderRequest(model="policy", version=1, holder=done))
    assert list(trainer.inspect("policy", 1).pins) == []
    # and an SDK fetch leaves no pin behind either
    reader = connect()
    reader.fetch("policy", 1, timeout=30)
    assert list(trainer.inspect("policy", 1).pins) == []


def test_the_index_is_bounded_and_drops_idle_models(etcd: Etcd, keys: Keys) -> None:
    index = HolderIndex(etcd, keys, max_models=2)
    try:
        for model in ("a", "b", "c"):
            assert index.fresh("t", model, 0, 1.0) is not None
        assert len(index) == 2  # the least recently used one went
    finally:
        index.close()
    idle = HolderIndex(etcd, keys, idle_seconds=0.0)
    try:
        idle.fresh("t", "a", 0, 1.0)
        idle.fresh("t", "b", 0, 1.0)
        assert len(idle) == 1  # "a" was idle when "b" came
    finally:
        idle.close()
