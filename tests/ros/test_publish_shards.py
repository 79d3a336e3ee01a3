"""PublishShards: a process group's shards of one version in one call (issue 35, item 3), by
raw gRPC against a real hub and etcd. Each shard must be treated as its own Publish: the
version visible atomically with the last, a bad shard refused alone with its named error and
nothing partial visible, a retried call idempotent, the publish-rate quota charged
`shard_tokens(0, N)`, and each holder record under its own rank's session, so a rank whose
session dies stops being offered while the others stay."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest

from consistency import EtcdCluster, Keys
from consistency.manifests import SHARD_INLINE_BYTES
from consistency.publishing import Published
from consistency.shard_entries import FULL_BATCH
from consistency.usage import SHARDS_PER_TOKEN, shard_tokens
from ros.client import shard_frames
from ros.client.shard_frames import frames
from ros.errors import from_outcome, from_rpc_error
from ros.hub import shard_group
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.raw_manifest import RawPublishRequest
from tensorhub.errors import (
    InvalidArgument,
    InvalidManifest,
    QuotaExceeded,
    SessionExpired,
    TensorHubError,
)
from tests.ros.conftest import ADMIN
from tests.ros.test_hostile_publishers import (
    Metadata,
    publish,
    raw_client,
    shard,
    shard_written,
    tenant,
)


def publish_shards(
    stub: object, requests: Sequence[pb.PublishRequest], metadata: Metadata
) -> pb.PublishShardsResponse:
    return stub.PublishShards(iter(requests), metadata=metadata, timeout=30)  # type: ignore[attr-defined,no-any-return]


def errors(answer: pb.PublishShardsResponse) -> list[TensorHubError | None]:
    return [
        from_outcome(o.error, o.message, o.fields) if o.error else None for o in answer.outcomes
    ]


def latest(stub: object, metadata: Metadata, model: str = "mp") -> int:
    return int(stub.Latest(pb.LatestRequest(model=model), metadata=metadata, timeout=10).version)  # type: ignore[attr-defined]


def sessions(stub: object, metadata: Metadata, count: int) -> list[int]:
    return [
        int(stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=metadata).session_id)  # type: ignore[attr-defined]
        for _ in range(count)
    ]


def test_a_group_of_shards_in_one_call_commits_in_batches_and_shows_once(
    hub_server: HubServer,
) -> None:
    """150 ranks, each its own session, in one call: every shard committed, one batch of
    them (the last) says visible, in about 150 / 61 transactions; each holder record is
    under its own rank's lease."""
    count = 150
    token = tenant(hub_server, "group")
    with raw_client(hub_server, token) as (stub, metadata, _):
        ranks = sessions(stub, metadata, count)
        answer = publish_shards(
            stub, [shard("mp", 1, i, count, ranks[i]) for i in range(count)], metadata
        )
        assert latest(stub, metadata) == 1
    assert errors(answer) == [None] * count
    assert [o.shard_index for o in answer.outcomes] == list(range(count))
    visible = {o.revision for o in answer.outcomes if o.visible}
    assert len(visible) == 1
    assert visible == {max(o.revision for o in answer.outcomes)}
    keys = hub_server.keys
    written = hub_server.etcd.range(keys.shards("group", "mp", 1), prefix=True).kvs
    assert len({kv.mod_revision for kv in written}) <= math.ceil(count / 61) + 2
    holders = hub_server.etcd.range(keys.holders("group", "mp", 1), prefix=True).kvs
    assert sorted(kv.lease for kv in holders) == sorted(ranks)


def test_a_bad_shard_is_refused_alone_and_nothing_partial_is_visible(
    hub_server: HubServer,
) -> None:
    count = 8
    token = tenant(hub_server, "bad-shard")
    with raw_client(hub_server, token) as (stub, metadata, session):
        requests = [shard("mp", 1, i, count, session) for i in range(count)]
        requests[3].manifest.tensors[0].nbytes = 17  # not 4 float32s: an invalid manifest
        requests[5].shard_count = count + 1  # another version's count
        answer = publish_shards(stub, requests, metadata)
        found = errors(answer)
        assert isinstance(found[3], InvalidManifest), found
        assert isinstance(found[5], InvalidArgument), found
        assert [f for i, f in enumerate(found) if i not in (3, 5)] == [None] * (count - 2)
        assert not any(o.visible for o in answer.outcomes)
        assert latest(stub, metadata) == 0  # 6 of 8 shards: nothing visible
        assert not shard_written(hub_server, "bad-shard", "mp", 1, 3)
        # the two fixed, sent again with the six already there: idempotent, now whole
        retry = [shard("mp", 1, i, count, session) for i in range(count)]
        again = publish_shards(stub, retry, metadata)
        assert errors(again) == [None] * count
        assert latest(stub, metadata) == 1
        once_more = publish_shards(stub, retry, metadata)  # a retry after success
        assert errors(once_more) == [None] * count
        assert {o.revision for o in once_more.outcomes} <= {o.revision for o in again.outcomes}


def test_what_a_calls_shards_share_is_checked_once_and_each_shards_own_every_time(
    hub_server: HubServer,
) -> None:
    """A call's shards share their model and version, checked with its first shard that
    passed and reused by the rest (`CallChecks`, `ros.hub.publish_checks`); what is each
    shard's own is still checked for each: a first shard refused for its holder leaves the
    next checked in full, and a later shard's bad endpoint, foreign session or invalid
    manifest is refused alone."""
    count = 6
    token = tenant(hub_server, "shared-checks")
    with raw_client(hub_server, token) as (stub, metadata, session):
        requests = [shard("mp", 1, i, count, session) for i in range(count)]
        requests[0].holder.name = "Not A Name"  # refused before anything is shared
        requests[2].holder.endpoints["tcp"] = "nowhere"  # not host:port
        requests[3].holder.session_id = session + 1  # no session of this tenant
        requests[4].manifest.tensors[0].nbytes = 17  # not 4 float32s
        found = errors(publish_shards(stub, requests, metadata))
        assert isinstance(found[0], InvalidArgument), found
        assert isinstance(found[2], InvalidArgument), found
        assert isinstance(found[3], SessionExpired), found
        assert isinstance(found[4], InvalidManifest), found
        assert [found[1], found[5]] == [None, None], found
        assert latest(stub, metadata) == 0
        again = [shard("mp", 1, i, count, session) for i in range(count)]
        assert errors(publish_shards(stub, again, metadata)) == [None] * count
        assert latest(stub, metadata) == 1


@pytest.mark.timeout(60)
def test_a_group_call_of_n_shards_takes_shard_tokens_0_n(hub_server: HubServer) -> None:
    """A publish-rate quota of 2 a minute pays for one group call of 2·K shards
    (`shard_tokens(0, 2K)` = 2): it lands whole, and the next version's shard is refused.
    A call of 2·K + 1 shards needs 3: its last arrival is refused with `QuotaExceeded`."""
    rate = 2
    count = rate * SHARDS_PER_TOKEN
    assert shard_tokens(0, count) == rate
    token = tenant(hub_server, "group-rate", max_publishes_per_minute=rate)
    with raw_client(hub_server, token) as (stub, metadata, session):
        answer = publish_shards(
            stub, [shard("mp", 1, i, count, session) for i in range(count)], metadata
        )
        assert errors(answer) == [None] * count
        assert latest(stub, metadata) == 1
        answer = publish_shards(stub, [shard("mp", 2, 0, count, session)], metadata)
        refused = errors(answer)[0]
        assert isinstance(refused, QuotaExceeded), refused
    token = tenant(hub_server, "group-over", max_publishes_per_minute=rate)
    with raw_client(hub_server, token) as (stub, metadata, session):
        answer = publish_shards(
            stub, [shard("mp", 1, i, count + 1, session) for i in range(count + 1)], metadata
        )
        refusals = [e for e in errors(answer) if e is not None]
        assert len(refusals) == 1, refusals
        assert isinstance(refusals[0], QuotaExceeded)


def test_each_rank_lives_and_dies_with_its_own_session(hub_server: HubServer) -> None:
    """A rank whose session died before the call is refused alone (`SessionExpired`); one
    that dies after it is no longer offered: its holder record goes with its lease, the
    other ranks' stay."""
    count = 4
    token = tenant(hub_server, "ranks-die")
    with raw_client(hub_server, token) as (stub, metadata, _):
        ranks = sessions(stub, metadata, count + 1)
        hub_server.etcd.lease_revoke(ranks[count])  # died before the call
        requests = [shard("mp", 1, i, count, ranks[i]) for i in range(count)]
        dead = shard("mp", 1, 1, count, ranks[count])
        answer = publish_shards(stub, [*requests[:1], dead], metadata)
        found = errors(answer)
        assert found[0] is None
        assert isinstance(found[1], SessionExpired), found
        answer = publish_shards(stub, requests, metadata)
        assert errors(answer) == [None] * count
        assert latest(stub, metadata) == 1
        hub_server.etcd.lease_revoke(ranks[2])  # rank 2 dies: its lease ends
        for index in range(count):
            resolved = stub.Resolve(  # type: ignore[attr-defined]
                pb.ResolveRequest(model="mp", version=1, shard=index, omit_manifest=True),
                metadata=metadata,
                timeout=10,
            )
            names = [h.name for h in resolved.holders]
            assert names == ([] if index == 2 else [f"rank-{index:05d}"]), (index, names)


def test_a_call_past_its_versions_shard_count_is_refused_whole(hub_server: HubServer) -> None:
    """A stream is bounded by the shard count its first shard states: a fourth message for a
    version of 3 shards, or a first message with no count, or none at all, refuse the call."""
    token = tenant(hub_server, "too-many")
    with raw_client(hub_server, token) as (stub, metadata, session):
        calls = [
            [shard("mp", 1, i % 3, 3, session) for i in range(4)],
            [pb.PublishRequest(model="mp", version=1)],
            [],
        ]
        for requests in calls:
            with pytest.raises(grpc.RpcError) as refused:
                publish_shards(stub, requests, metadata)
            error = from_rpc_error(refused.value, "PublishShards")
            assert isinstance(error, InvalidArgument), (len(requests), error)


def layer_shard(index: int, count: int, session: int, tensors: int = 40) -> pb.PublishRequest:
    """Rank `index`'s shard with a manifest of `tensors` tensors (a few KB: paged, were it
    published alone), as a transformer layer's."""
    request = shard("mp", 1, index, count, session)
    nbytes = 64 * 64 * 4
    del request.manifest.tensors[:]
    request.manifest.tensors.extend(
        pb.TensorEntry(
            name=f"model.layers.{index}.proj_{t}.weight", dtype="float32", shape=[64, 64],
            offset=t * nbytes, nbytes=nbytes,
        )
        for t in range(tensors)
    )  # fmt: skip
    request.manifest.total_bytes = tensors * nbytes
    request.manifest.chunk_xxh3[:] = [index] * -(-tensors * nbytes // 4096)
    return request


def test_layer_manifests_ride_in_their_batches_and_every_shard_resolves(
    hub_server: HubServer,
) -> None:
    """130 shards of manifests over SHARD_INLINE_BYTES in one call: no page written before
    any batch (the call's revisions are its batches: ceil(130 / 61) = 3), each shard's
    manifest resolves to exactly what its rank sent, and the call sent again writes
    nothing and answers the same commits."""
    count = 130
    token = tenant(hub_server, "packed")
    with raw_client(hub_server, token) as (stub, metadata, session):
        requests = [layer_shard(i, count, session) for i in range(count)]
        assert requests[0].manifest.ByteSize() > SHARD_INLINE_BYTES
        before = hub_server.etcd.get("/probe")[1]
        answer = publish_shards(stub, requests, metadata)
        after = hub_server.etcd.get("/probe")[1]
        assert errors(answer) == [None] * count
        assert latest(stub, metadata) == 1
        assert after - before == math.ceil(count / FULL_BATCH)
        for index in (0, 64, count - 1):
            resolved = stub.Resolve(  # type: ignore[attr-defined]
                pb.ResolveRequest(model="mp", version=1, shard=index),
                metadata=metadata,
                timeout=10,
            )
            assert resolved.manifest == requests[index].manifest
        again = publish_shards(stub, requests, metadata)  # a lost reply's retry
        assert errors(again) == [None] * count
        assert [o.revision for o in again.outcomes] == [o.revision for o in answer.outcomes]
        assert hub_server.etcd.get("/probe")[1] == after


def test_manifests_pass_as_sent_bytes_and_bad_bytes_are_refused_alone(
    hub_server: HubServer,
) -> None:
    """The hub reads a group call's manifests as the bytes they came (`ros.raw_manifest`),
    never parsed whole: a shard of a layout already checked whose name is not UTF-8, one
    whose names repeat, and one whose manifest bytes are cut short are each refused alone
    with `InvalidManifest`, and nothing is visible; a manifest written in another field
    order is stored as sent and resolves to what it parses to. Fixed, the call lands."""
    count = 6
    token = tenant(hub_server, "raw-bytes")
    with raw_client(hub_server, token) as (stub, metadata, session):
        requests = [layer_shard(i, count, session) for i in range(count)]
        sent = [r.SerializeToString() for r in requests]
        name = b"model.layers.3.proj_5.weight"
        assert sent[3].count(name) == 1
        sent[3] = sent[3].replace(name, name[:-1] + b"\xff")  # same length: not UTF-8
        twice = pb.PublishRequest()
        twice.CopyFrom(requests[4])
        twice.manifest.tensors[1].name = twice.manifest.tensors[0].name
        sent[4] = twice.SerializeToString()
        cut = RawPublishRequest.FromString(sent[5])
        cut.manifest = cut.manifest[:100]
        sent[5] = cut.SerializeToString()
        head = requests[2].manifest
        reordered = (
            pb.Manifest(
                total_bytes=head.total_bytes, chunk_size=head.chunk_size
            ).SerializeToString()
            + pb.Manifest(tensors=head.tensors, chunk_xxh3=head.chunk_xxh3).SerializeToString()
        )  # fields 2 and 3 before field 1: the same message, other bytes
        assert reordered != head.SerializeToString()
        other = RawPublishRequest.FromString(sent[2])
        other.manifest = reordered
        sent[2] = other.SerializeToString()
        with grpc.insecure_channel(hub_server.address) as channel:
            call = channel.stream_unary(
                "/tensorhub.v1.TensorHub/PublishShards",
                request_serializer=lambda raw: raw,
                response_deserializer=pb.PublishShardsResponse.FromString,
            )
            answer = call(iter(sent), metadata=metadata, timeout=30)
            found = errors(answer)
            assert [type(f) for f in found[3:]] == [InvalidManifest] * 3, found
            assert "duplicate tensor name" in str(found[4])
            assert found[:3] == [None] * 3
            assert latest(stub, metadata) == 0
            fixed = sent[:3] + [r.SerializeToString() for r in requests[3:]]
            again = call(iter(fixed), metadata=metadata, timeout=30)
        assert errors(again) == [None] * count
        assert latest(stub, metadata) == 1
        resolved = stub.Resolve(  # type: ignore[attr-defined]
            pb.ResolveRequest(model="mp", version=1, shard=2), metadata=metadata, timeout=10
        )
        assert resolved.manifest == head


@pytest.fixture
def checking_hub(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    """A hub that checks group calls' manifests in a process of its own, as `tensorhub
    serve` does (`ros.hub.manifest_processes`)."""
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, check_processes=1
    ).start()
    yield server
    server.stop(grace=0.2)


def test_manifests_checked_in_a_process_of_their_own_are_refused_alike(
    checking_hub: HubServer,
) -> None:
    """With the manifests of a group call checked in a checking process, a bad shard is
    still refused alone with its own named error (the same as without: its manifest checked
    again where it is staged), nothing partial is visible, and a retry is idempotent; and
    the process did decide them."""
    test_a_bad_shard_is_refused_alone_and_nothing_partial_is_visible(checking_hub)
    test_manifests_pass_as_sent_bytes_and_bad_bytes_are_refused_alone(checking_hub)
    assert checking_hub.servicer.hub.manifest_processes.answered > 0


def test_shards_framed_many_a_message_are_each_their_own_publish(hub_server: HubServer) -> None:
    """Shards sent many a message (`PublishRequest.shards`, as `ros.client.shard_frames`
    frames the bytes the ranks serialized) are each treated as their own Publish: inside a
    message of 4, a shard whose manifest breaks a rule is refused alone with
    `InvalidManifest`, one of another version's count with `InvalidArgument`, and one that
    carries shards of its own with `InvalidArgument`; nothing is visible. Fixed and framed
    otherwise (3 a message, plain messages among them), the call lands whole in its batches;
    sent again, it answers the same commits and writes nothing."""
    count = 70
    token = tenant(hub_server, "framed")
    with raw_client(hub_server, token) as (stub, metadata, session):
        requests = [layer_shard(i, count, session) for i in range(count)]
        bad = [pb.PublishRequest() for _ in range(3)]
        for copy, index in zip(bad, (5, 6, 7), strict=True):
            copy.CopyFrom(requests[index])
        bad[0].manifest.tensors[2].nbytes = 17  # inside the message of shards 4-7
        bad[1].shard_count = count + 1
        bad[2].shards.append(requests[7])
        sent = [r.SerializeToString() for r in requests[:5]]
        sent += [b.SerializeToString() for b in bad]
        sent += [r.SerializeToString() for r in requests[8:]]
        framed = list(frames(sent, shards=4))
        assert len(framed) == math.ceil(count / 4)
        assert len(pb.PublishRequest.FromString(framed[1]).shards) == 4
        with grpc.insecure_channel(hub_server.address) as channel:
            call = shard_frames.publish_shards(channel)
            answer = call(iter(framed), metadata=metadata, timeout=30)
            found = errors(answer)
            assert isinstance(found[5], InvalidManifest), found[5]
            assert isinstance(found[6], InvalidArgument), found[6]
            assert isinstance(found[7], InvalidArgument), found[7]
            assert "shards" in str(found[7])
            assert [f for i, f in enumerate(found) if i not in (5, 6, 7)] == [None] * (count - 3)
            assert [o.shard_index for o in answer.outcomes] == list(range(count))
            assert not any(o.visible for o in answer.outcomes)
            assert latest(stub, metadata) == 0
            assert not shard_written(hub_server, "framed", "mp", 1, 5)
            fixed = [r.SerializeToString() for r in requests]
            mixed = [*frames(fixed[:30], shards=3), *fixed[30:40], *frames(fixed[40:])]
            before = hub_server.etcd.get("/probe")[1]
            again = call(iter(mixed), metadata=metadata, timeout=30)
            after = hub_server.etcd.get("/probe")[1]
            assert errors(again) == [None] * count
            assert latest(stub, metadata) == 1
            assert after - before <= math.ceil(count / FULL_BATCH)
            last = max(o.revision for o in again.outcomes)
            assert all(o.visible for o in again.outcomes if o.revision == last)
            retried = call(iter(frames(fixed)), metadata=metadata, timeout=30)
            assert errors(retried) == [None] * count
            assert [o.revision for o in retried.outcomes] == [o.revision for o in again.outcomes]
            assert hub_server.etcd.get("/probe")[1] == after
        resolved = stub.Resolve(  # type: ignore[attr-defined]
            pb.ResolveRequest(model="mp", version=1, shard=5), metadata=metadata, timeout=10
        )
        assert resolved.manifest == requests[5].manifest


def test_shards_outside_a_publishshards_message_of_their_own_are_refused(
    hub_server: HubServer,
) -> None:
    """`shards` is a PublishShards message's framing only: a message that sets it and a
    field of its own refuses the call whole (`InvalidArgument`), and so does a Publish
    that sets it; neither writes anything."""
    token = tenant(hub_server, "frame-rules")
    with raw_client(hub_server, token) as (stub, metadata, session):
        both = shard("mp", 1, 0, 2, session)
        both.shards.append(shard("mp", 1, 1, 2, session))
        with pytest.raises(grpc.RpcError) as refused:
            publish_shards(stub, [both], metadata)
        assert isinstance(from_rpc_error(refused.value, "PublishShards"), InvalidArgument)
        whole = pb.PublishRequest()
        whole.CopyFrom(both)
        whole.ClearField("shard_count")
        whole.ClearField("shard_index")
        whole.holder.ClearField("shard")
        for request in (both, whole):
            assert isinstance(publish(stub, request, metadata), InvalidArgument)
        assert latest(stub, metadata) == 0
        assert not shard_written(hub_server, "frame-rules", "mp", 1, 0)


def test_frames_carry_the_requests_as_they_came_within_their_bounds() -> None:
    """`frames` is a join: each message parses back to the requests it carries, in order,
    at most `shards` of them and `max_bytes` of their bytes (a request larger than that
    alone); one shard a message is the requests as they are."""
    requests = [layer_shard(i, 9, 1, tensors=1 + i).SerializeToString() for i in range(9)]
    for shards, max_bytes in ((4, 1 << 20), (9, 3 * len(requests[4])), (2, 1)):
        framed = list(frames(requests, shards=shards, max_bytes=max_bytes))
        carried = [pb.PublishRequest.FromString(f).shards for f in framed]
        assert [s.SerializeToString() for c in carried for s in c] == requests
        for one in carried:
            assert 1 <= len(one) <= shards
            assert len(one) == 1 or sum(s.ByteSize() for s in one) <= max_bytes
    assert list(frames(requests, shards=1)) == requests
    with pytest.raises(InvalidArgument):
        list(frames(requests, shards=0))


def test_a_calls_chunks_are_staged_one_at_a_time_in_order() -> None:
    """`shard_group.publish_shards` stages a call's chunks one at a time, in the order they
    filled (each chunk's hashing and compression take turns at the GIL with the loop that
    reads the stream: one thread at a time, not one a chunk), and each shard still gets its
    own outcome, in order."""
    count = 3 * shard_group.CHUNK + 5
    staging: list[int] = []
    at_once = 0
    most = 0

    async def requests() -> AsyncIterator[pb.PublishRequest]:
        for i in range(count):
            yield pb.PublishRequest(model="lane", version=1, shard_index=i, shard_count=count)

    async def check(request: pb.PublishRequest) -> int:
        return int(request.shard_index)

    async def stage(checked: list[int]) -> list[int | BaseException]:
        nonlocal at_once, most
        at_once += 1
        most = max(most, at_once)
        staging.append(checked[0])
        await asyncio.sleep(0.01)  # a worker's time: another chunk would start meanwhile
        at_once -= 1
        return list(checked)

    def commit(staged: list[int]) -> list[asyncio.Future[Published]]:
        done: list[asyncio.Future[Published]] = []
        for index in staged:
            future = asyncio.get_running_loop().create_future()
            future.set_result(Published(1, 100 + index, index == count - 1))
            done.append(future)
        return done

    answer = asyncio.run(shard_group.publish_shards(requests(), check, stage, commit))
    assert most == 1
    assert staging == list(range(0, count, shard_group.CHUNK))  # each chunk's first, in order
    assert [o.shard_index for o in answer.outcomes] == list(range(count))
    assert [o.revision for o in answer.outcomes] == [100 + i for i in range(count)]
    assert not any(o.error for o in answer.outcomes)
