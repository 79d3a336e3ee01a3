"""`DeleteModel` racing a model-parallel shard burst (issue 25, "also untested"), through
real hubs (gRPC on loopback) over the real etcd. Whole versions:
`test_review_delete_race.py`.

Whatever the interleaving, afterwards the model is either entirely gone or the version is
whole and visible: never visible with a shard record missing, never a key of the deleted
model left behind (a page, a holder record, a counter), and the tenant's usage key never
charges less than what is left (`tests.ros.review_state`). A burst cut in two by the delete
leaves the shards that came after it as a version in flight (no header, no `latest`), which
the ranks' idempotent retry of their shards completes: that, too, is checked.

The interleavings are forced with `HeldTxn` (the hub's etcd client holds one transaction at
the door), never with sleeps; a last test races them freely over two replicas, seeded.
"""

from __future__ import annotations

import asyncio
import functools
import random
from typing import Any

import grpc
import pytest

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.consistency.test_manifests import big_manifest
from tests.ros import review_state
from tests.ros.helpers import make_model
from tests.ros.review_state import ModelState, read_model
from tests.ros.test_burst import (
    HeldTxn,
    error_name,
    gather,
    metadata,
    run_burst,
    shard_request,
    tenant,
    wait_until,
)

RANKS = 8


def settled(hub: HubServer, name: str, model: str, *, exact: bool = True) -> ModelState:
    """`review_state.settled` on this hub's etcd and prefix."""
    return review_state.settled(hub.etcd, hub.keys, name, model, exact=exact)


def shard(index: int, session: int, version: int, model: str = "mp") -> pb.PublishRequest:
    """Rank `index`'s shard of `model@version` (one of `RANKS`), a tiny inline manifest."""
    request = shard_request(index, RANKS, session, model)
    request.version = version
    return request


@pytest.fixture
def held() -> Any:
    made: list[HeldTxn] = []
    yield made
    for failpoint in made:
        failpoint.remove()


@pytest.mark.timeout(60)
def test_a_delete_in_the_middle_of_a_shard_burst_leaves_a_version_the_retries_complete(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    """Shard 0 of mp@2 commits; the other 7 wait in or behind a held batch; the model is deleted
    (@1, @2's counter and shard 0 go). Proves: the 7 commit onto the empty model as a
    version in flight (no header, no `latest`: never visible with a shard missing), the
    budget charges exactly them, and rank 0's idempotent retry of its shard makes mp@2
    whole and visible once."""
    token = tenant(hub_server, "race-d")
    keys = hub_server.keys
    group = hub_server.servicer.hub.shard_batches.group
    md = metadata(token)

    async def body(stubs: list[Any]) -> list[Any]:
        stub = stubs[0]
        sessions = [
            (await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)).session_id
            for _ in range(RANKS)
        ]
        whole = shard(0, sessions[0], 1)
        whole.ClearField("shard_count")
        whole.ClearField("shard_index")
        whole.holder.ClearField("shard")
        await stub.Publish(whole, metadata=md, timeout=30)
        first = await stub.Publish(shard(0, sessions[0], 2), metadata=md, timeout=30)
        assert not first.visible
        failpoint = HeldTxn(hub_server.etcd, keys.shards("race-d", "mp", 2))
        held.append(failpoint)
        rest = asyncio.ensure_future(
            gather(
                [
                    stub.Publish(shard(i, sessions[i], 2), metadata=md, timeout=30)
                    for i in range(1, RANKS)
                ]
            )
        )
        await asyncio.to_thread(failpoint.reached.wait, 30)
        # every other shard is in the held batch or queued behind it (a batch lingers a few
        # ms for more shards of its version: it may hold them all; `largest` is its size,
        # shard 0's batch having been 1; this hub is the test's own)
        await asyncio.to_thread(
            wait_until,
            "the other shards are in the held batch or queued",
            lambda: group.waiting(("race-d", "mp", 2)) + group.largest >= RANKS - 1,
        )
        answer = await stub.DeleteModel(pb.DeleteModelRequest(model="mp"), metadata=md)
        assert answer.versions_deleted == 1
        failpoint.release()
        results = await rest
        errors = [error_name(r) for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        middle = settled(hub_server, "race-d", "mp")
        retried = await stub.Publish(shard(0, sessions[0], 2), metadata=md, timeout=30)
        return [middle, retried]

    middle, retried = run_burst([hub_server.address], token, body)
    assert middle.latest is None
    assert not middle.headers
    assert sorted(middle.shards[2]) == list(range(1, RANKS))
    assert retried.visible
    state = settled(hub_server, "race-d", "mp")
    assert state.latest == 2
    assert state.headers[2].shards == RANKS


@pytest.mark.timeout(60)
def test_a_delete_between_a_paged_shards_staged_pages_and_its_batch_leaves_no_page(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    """A shard whose manifest is over 1 KiB is paged: its pages are written under the
    rank's lease before its batch. The delete removes them while the batch waits at the
    door. Proves: that shard is then refused with a named error (its pages are gone), no
    page or record of it is left, the budget is exact, and the rank's retry publishes it."""
    token = tenant(hub_server, "race-g")
    md = metadata(token)
    manifest = pb.Manifest.FromString(big_manifest(tensors=60, chunks=180))
    assert len(manifest.SerializeToString()) > 1 << 10  # paged, not inline

    def paged(index: int, session: int) -> pb.PublishRequest:
        request = shard(index, session, 1, "paged")
        request.shard_count = 2
        request.manifest.CopyFrom(manifest)
        return request

    async def body(stubs: list[Any]) -> list[Any]:
        stub = stubs[0]
        sessions = [
            (await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)).session_id
            for _ in range(2)
        ]
        first = await stub.Publish(paged(1, sessions[1]), metadata=md, timeout=30)
        assert not first.visible
        failpoint = HeldTxn(hub_server.etcd, hub_server.keys.shards("race-g", "paged", 1))
        held.append(failpoint)
        second = asyncio.ensure_future(
            gather([stub.Publish(paged(0, sessions[0]), metadata=md, timeout=30)])
        )
        await asyncio.to_thread(failpoint.reached.wait, 30)
        staged = read_model(hub_server.etcd, hub_server.keys, "race-g", "paged")
        assert any(part == "000000" for _, part, _ in staged.pages), "shard 0 was not paged"
        await stub.DeleteModel(pb.DeleteModelRequest(model="paged"), metadata=md, timeout=20)
        failpoint.release()
        (result,) = await second
        middle = settled(hub_server, "race-g", "paged")
        again = [await stub.Publish(paged(i, sessions[i]), metadata=md, timeout=30) for i in (1, 0)]
        return [result, middle, again]

    result, middle, again = run_burst([hub_server.address], token, body)
    if isinstance(result, BaseException):  # refused, named, and nothing of it left
        assert error_name(result) not in ("", "InternalError", "UNKNOWN"), result
        assert middle.empty, (error_name(result), middle)
    else:  # committed onto the empty model: in flight, with its pages
        assert sorted(middle.shards[1]) == [0], middle
    assert again[-1].visible
    assert settled(hub_server, "race-g", "paged").headers[1].shards == 2


async def race_round(
    stubs: list[Any],
    md: Any,
    hub: HubServer,
    trainer: ros.Hub,
    version: int,
    delays: tuple[float, float],
) -> tuple[object, list[int]]:
    """One round of `test_deletes_racing_bursts_and_publishes_over_two_replicas`: the
    burst of `mp@version` over both replicas and the whole `whole@version`, each raced by
    a `DeleteModel` after its delay; a burst left in flight is completed by re-sending the
    missing shards. Returns the whole publish's outcome and the shards that were re-sent."""
    sessions = [
        (
            await stubs[i % 2].OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)
        ).session_id
        for i in range(RANKS)
    ]

    async def late_delete(stub: Any, model: str, after: float) -> Any:
        await asyncio.sleep(after)
        return await stub.DeleteModel(pb.DeleteModelRequest(model=model), metadata=md, timeout=20)

    def publish_whole() -> ros.Publication:
        return trainer.publish("whole", version, make_model(version), timeout=20)

    burst = [
        stubs[i % 2].Publish(shard(i, sessions[i], version), metadata=md, timeout=30)
        for i in range(RANKS)
    ]
    results = await gather(
        [
            *burst,
            late_delete(stubs[1], "mp", delays[0]),
            late_delete(stubs[0], "whole", delays[1]),
            asyncio.to_thread(publish_whole),
        ]
    )
    shards, deleted, publication = results[:RANKS], results[RANKS:-1], results[-1]
    errors = [error_name(r) for r in shards if isinstance(r, BaseException)]
    assert not errors, errors
    for result in deleted:  # nothing to delete yet: the only refusal allowed
        if isinstance(result, BaseException):
            assert error_name(result) == "VersionNotFound", error_name(result)
    state = settled(hub, "race-e", "mp", exact=False)
    missing = [i for i in range(RANKS) if i not in state.shards.get(version, {})]
    if state.shards.get(version) and version not in state.headers:
        retried = await gather(
            [
                stubs[i % 2].Publish(shard(i, sessions[i], version), metadata=md, timeout=30)
                for i in missing
            ]
        )
        assert not [r for r in retried if isinstance(r, BaseException)], retried
        # shown once: every reply of the batch that completes it says visible
        assert len({r.revision for r in retried if r.visible}) == 1, retried
    return publication, missing


@pytest.mark.timeout(90)
def test_deletes_racing_bursts_and_publishes_over_two_replicas(
    hub_server: HubServer, etcd_cluster: EtcdCluster
) -> None:
    """Seeded free races: each round, 8 ranks publish their shards of a version over two
    replicas while a `DeleteModel` lands at a random moment on one of them, and a whole
    version of another model is published while it is deleted. Proves, after every round:
    the keys are consistent and the budget never below what etcd holds; a shard burst is
    whole and visible, gone, or in flight and completed by re-sending the missing shards
    (then whole); the whole version is visible with its holder record or entirely gone."""
    rng = random.Random(25)
    keys: Keys = hub_server.keys
    token = tenant(hub_server, "race-e")
    md = metadata(token)
    other = HubServer(etcd_cluster.endpoints, admin_token="x", keys=keys).start()
    trainer = ros.connect(other.address, tenant="race-e", token=token)
    channel = grpc.insecure_channel(other.address)
    cleanup = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    try:
        for round_ in range(8):
            version = round_ + 1
            delays = (rng.uniform(0.0, 0.015), rng.uniform(0.0, 0.015))

            publication, missing = run_burst(
                [hub_server.address, other.address],
                token,
                functools.partial(
                    race_round,
                    md=md,
                    hub=hub_server,
                    trainer=trainer,
                    version=version,
                    delays=delays,
                ),
            )
            state = settled(hub_server, "race-e", "mp", exact=False)
            assert state.empty or (
                state.latest == version and state.headers[version].shards == RANKS
            ), (round_, missing, state)
            whole = settled(hub_server, "race-e", "whole", exact=False)
            if isinstance(publication, ros.Publication):
                assert whole.empty or (
                    whole.visible() == [version]
                    and trainer.holder_name in [h.holder for h in whole.holders[version]]
                ), (round_, whole)
                publication.release(force=True)
            else:  # named, and then nothing of it left
                assert isinstance(publication, ros.TensorHubError), publication
                assert version not in whole.headers, (round_, publication, whole)
            for model, left in (("mp", state), ("whole", whole)):
                if not left.empty:
                    cleanup.DeleteModel(pb.DeleteModelRequest(model=model), metadata=md, timeout=20)
                assert settled(hub_server, "race-e", model, exact=False).empty
    finally:
        trainer.close()
        channel.close()
        other.stop(grace=0.2)
