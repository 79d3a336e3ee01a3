"""Hostile publishers of one tenant against a real hub (issue 38, rows 12 and 13), each by
raw gRPC calls where the SDK would refuse to send them, over the session's real etcd.

- Row 12: shards against the publish-rate quota. A version of N shards takes
  ceil(N / `SHARDS_PER_TOKEN`) tokens, one per K-th arrival, so one shard each of many
  versions costs a token each (it cost 1 / N: 11,444 shard publishes a minute passed a
  quota of 600), and a version costs the same one rank per call or all ranks at once.
- Row 13: `.delta` names are reserved in the hub: a Publish of one that is not the companion
  of a delta publish by the session that published its base is `InvalidName`, nothing
  written; so another client of the tenant cannot take the real publisher's companion first
  and make it publish whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch

import ros
from consistency.manifests import MAX_SHARDS
from consistency.usage import SHARDS_PER_TOKEN, shard_tokens
from ros.errors import from_rpc_error
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.delta_rules import TENSOR, companion_of
from tensorhub.errors import InvalidName, QuotaExceeded, TensorHubError

Metadata = tuple[tuple[str, str], ...]
CHUNK = 64 << 10
DELTA_OF, DELTA_BASE = "tensorhub.delta-of", "tensorhub.delta-base"  # as the SDK writes them


@contextmanager
def raw_client(hub: HubServer, token: str) -> Iterator[tuple[object, Metadata, int]]:
    """A raw gRPC stub of the tenant `token` names, its call metadata, and a session of
    its own (30 s)."""
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(hub.address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=metadata)
        yield stub, metadata, int(session.session_id)


def publish(stub: object, request: pb.PublishRequest, metadata: Metadata) -> TensorHubError | None:
    """One raw Publish: None if accepted, else the named error it was refused with."""
    try:
        stub.Publish(request, metadata=metadata, timeout=20)  # type: ignore[attr-defined]
    except grpc.RpcError as exc:
        return from_rpc_error(exc, "Publish")
    return None


def shard(model: str, version: int, index: int, count: int, session: int) -> pb.PublishRequest:
    """Rank `index`'s shard (of `count`) of `model@version`: a tiny inline manifest."""
    return pb.PublishRequest(
        model=model,
        version=version,
        manifest=pb.Manifest(
            tensors=[pb.TensorEntry(name=f"w{index}", dtype="float32", shape=[4], nbytes=16)],
            total_bytes=16,
            chunk_size=4096,
            chunk_xxh3=[index],
        ),
        holder=pb.Holder(
            name=f"rank-{index:05d}",
            endpoints={"tcp": "127.0.0.1:9"},
            state=pb.COMPLETE,
            session_id=session,
            shard=index,
        ),
        shard_index=index,
        shard_count=count,
    )


def tenant(hub: HubServer, name: str, **quotas: int) -> str:
    return TenantStore(hub.etcd, hub.keys).create(name, Quotas(**quotas))


def shard_written(hub: HubServer, name: str, model: str, version: int, index: int) -> bool:
    return hub.etcd.get(hub.keys.shard(name, model, version, index))[0] is not None


# -- row 12: shards and the publish-rate quota ---------------------------------------------


def test_a_version_takes_ceil_n_over_k_tokens_however_its_arrivals_are_split() -> None:
    """The charging function a group publish of N shards uses (arrivals 0 .. N-1 at once)
    gives what the same shards one call per rank give, and any split between batches."""
    for n in range(1, 3 * SHARDS_PER_TOKEN + 2):
        whole = math.ceil(n / SHARDS_PER_TOKEN)
        assert shard_tokens(0, n) == whole
        assert sum(shard_tokens(i, 1) for i in range(n)) == whole
        assert all(shard_tokens(0, a) + shard_tokens(a, n - a) == whole for a in range(n + 1))
    assert shard_tokens(0, MAX_SHARDS) == MAX_SHARDS // SHARDS_PER_TOKEN


@pytest.mark.timeout(60)
def test_one_shard_each_of_many_versions_costs_a_token_each(hub_server: HubServer) -> None:
    """The attack: shard 0 of versions 1, 2, 3, ... of a model each claiming `MAX_SHARDS`
    shards, so that each cost 1/4,096 of a publish. Under a quota of 3 a minute, the 4th
    (or, after a slow start, the 5th) is refused with `QuotaExceeded`, its shard not written;
    before, all 12 landed."""
    rate = 3
    token = tenant(hub_server, "flood-shards", max_publishes_per_minute=rate)
    with raw_client(hub_server, token) as (stub, metadata, session):
        outcomes = [
            publish(stub, shard("mp", version, 0, MAX_SHARDS, session), metadata)
            for version in range(1, 13)
        ]
    accepted = [v for v, o in enumerate(outcomes, 1) if o is None]
    refused = [(v, o) for v, o in enumerate(outcomes, 1) if o is not None]
    assert refused, "12 shard publishes under a quota of 3 a minute were all accepted"
    assert rate <= len(accepted) <= rate + 1, outcomes
    assert all(isinstance(o, QuotaExceeded) for _, o in refused), refused
    assert "max_publishes_per_minute" in str(refused[0][1])
    for version, _ in refused:
        assert not shard_written(hub_server, "flood-shards", "mp", version, 0)


def _spend(
    stub: object, metadata: Metadata, session: int, count: int, *, at_once: bool
) -> list[TensorHubError | None]:
    """Publish `count` shards of `mp@1`: one call after another, or all at once (the hub
    commits shards waiting together in one batch: what a group call charges)."""
    requests = [shard("mp", 1, i, count, session) for i in range(count)]
    if not at_once:
        return [publish(stub, r, metadata) for r in requests]
    futures = [
        stub.Publish.future(r, metadata=metadata, timeout=20)  # type: ignore[attr-defined]
        for r in requests
    ]
    outcomes: list[TensorHubError | None] = []
    for future in futures:
        try:
            future.result()
            outcomes.append(None)
        except grpc.RpcError as exc:
            outcomes.append(from_rpc_error(exc, "Publish"))
    return outcomes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at_once", [False, True], ids=["one-rank-per-call", "all-ranks-at-once"])
def test_a_version_of_n_shards_takes_ceil_n_over_k_tokens(
    hub_server: HubServer, at_once: bool
) -> None:
    """A quota of 2 a minute pays for one version of 2·K shards, one call per rank or all
    at once alike: it lands whole, and a shard of the next version is refused (before, the
    version took one token, and the next version's shard landed). A version of 2·K + 1
    shards takes 3 tokens: its last arrival is refused."""
    rate = 2
    count = rate * SHARDS_PER_TOKEN
    name = f"ranks-{int(at_once)}"
    token = tenant(hub_server, name, max_publishes_per_minute=rate)
    with raw_client(hub_server, token) as (stub, metadata, session):
        outcomes = _spend(stub, metadata, session, count, at_once=at_once)
        assert outcomes == [None] * count, outcomes
        latest = stub.Latest(pb.LatestRequest(model="mp"), metadata=metadata, timeout=10)  # type: ignore[attr-defined]
        assert latest.version == 1  # the version is whole and visible
        refused = publish(stub, shard("mp", 2, 0, count, session), metadata)
        assert isinstance(refused, QuotaExceeded), refused
        assert not shard_written(hub_server, name, "mp", 2, 0)

    over = f"over-{int(at_once)}"
    token = tenant(hub_server, over, max_publishes_per_minute=rate)
    with raw_client(hub_server, token) as (stub, metadata, session):
        outcomes = _spend(stub, metadata, session, count + 1, at_once=at_once)
        refusals = [o for o in outcomes if o is not None]
        assert len(refusals) == 1, outcomes
        assert isinstance(refusals[0], QuotaExceeded), outcomes
        assert sum(shard_written(hub_server, over, "mp", 1, i) for i in range(count + 1)) == count


# -- row 13: companion names are reserved in the hub ---------------------------------------


def _weights(seed: int, share: float = 0.0) -> dict[str, torch.Tensor]:
    """2 x 256 KiB of bf16; with `share`, that share of the elements nudged (an RL step)."""
    g = torch.Generator().manual_seed(1)
    w = {f"w{i}": torch.randn(128 * 1024, generator=g).to(torch.bfloat16) for i in range(2)}
    if share:
        g = torch.Generator().manual_seed(seed)
        for name, t in w.items():
            mask = torch.rand(t.shape, generator=g) < share
            w[name] = torch.where(mask, (t.float() * 1.01).to(torch.bfloat16), t)
    return w


def _companion_request(
    model: str, version: int, session: int, metadata: dict[str, str] | None
) -> pb.PublishRequest:
    """What a companion publish sends: one uint8 tensor of encoded chunks, and its metadata
    (naming the model and the base) as the SDK writes it."""
    return pb.PublishRequest(
        model=companion_of(model),
        version=version,
        manifest=pb.Manifest(
            tensors=[pb.TensorEntry(name=TENSOR, dtype="uint8", shape=[4096], nbytes=4096)],
            total_bytes=4096,
            chunk_size=4096,
            chunk_xxh3=[7],
            metadata=metadata or {},
        ),
        holder=pb.Holder(
            name="squatter", endpoints={"tcp": "127.0.0.1:9"}, state=pb.COMPLETE,
            session_id=session,
        ),
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_a_raw_publish_to_a_companion_name_is_refused(hub_server: HubServer) -> None:
    """`loop.delta` published as a model of its own, with no delta publish behind it, and
    `loop.delta.delta`: `InvalidName`, nothing written (before: accepted)."""
    token = tenant(hub_server, "raw-delta")
    with raw_client(hub_server, token) as (stub, metadata, session):
        for request in (
            _companion_request("loop", 1, session, None),
            _companion_request("loop.delta", 2, session, {DELTA_OF: "loop.delta", DELTA_BASE: "1"}),
        ):
            refused = publish(stub, request, metadata)
            assert isinstance(refused, InvalidName), refused
            assert "reserved" in str(refused)
            latest = stub.Latest(pb.LatestRequest(model=request.model), metadata=metadata)  # type: ignore[attr-defined]
            assert latest.version == 0
        assert not hub_server.etcd.range(hub_server.keys.versions("raw-delta", "loop.delta"),
                                         prefix=True).kvs  # fmt: skip


@pytest.mark.timeout(90)
def test_a_squatter_cannot_make_the_publisher_fall_back_to_whole(hub_server: HubServer) -> None:
    """The trainer publishes `loop@1` with `delta=True`. Another client of the tenant (its own
    session) publishes `loop.delta@2`, and `@1000`, first, with the metadata the SDK writes:
    refused with `InvalidName`, nothing written. The trainer's `loop@2` then has its delta
    (before: the squatter's companion landed and `loop@2` went whole), and a reader holding
    `loop@1` reads only its changes."""
    token = tenant(hub_server, "squat")
    trainer = ros.connect(hub_server.address, tenant="squat", token=token)
    reader = ros.connect(hub_server.address, tenant="squat", token=token)
    try:
        w1 = _weights(1)
        trainer.publish("loop", 1, w1, chunk_size=CHUNK, delta=True)
        held = reader.fetch("loop", 1)
        with raw_client(hub_server, token) as (stub, metadata, session):
            for version in (2, 1000):
                squat = _companion_request(
                    "loop", version, session, {DELTA_OF: "loop", DELTA_BASE: "1"}
                )
                refused = publish(stub, squat, metadata)
                assert isinstance(refused, InvalidName), refused
                assert "only the session that published loop@1" in str(refused)
            assert trainer.latest(companion_of("loop")) == 0
            w2 = _weights(2, share=0.01)
            published = trainer.publish("loop", 2, w2, chunk_size=CHUNK, delta=True)
            assert published.companion is not None, "the publisher fell back to whole"
            assert trainer.latest(companion_of("loop")) == 2
            # the companion's session alone may publish it: a second one, by the squatter, too late
            again = publish(stub, _companion_request(
                "loop", 3, session, {DELTA_OF: "loop", DELTA_BASE: "2"}), metadata)  # fmt: skip
            assert isinstance(again, InvalidName), again
        tensors = held.tensors
        held.release()
        applied = reader.fetch("loop", 2, into=tensors)
        assert applied.delta is not None
        assert applied.delta.chunks > 0, applied.delta
        assert all(torch.equal(applied.tensors[k].view(torch.int16), w2[k].view(torch.int16))
                   for k in w2)  # fmt: skip
    finally:
        reader.close()
        trainer.close()


def test_a_name_that_only_contains_delta_is_an_ordinary_model(
    connect: Callable[..., ros.Hub],
) -> None:
    """A model whose name merely contains `delta` is an ordinary model."""
    hub = connect()
    hub.publish("delta.loop", 1, {"w": torch.ones(8)}).release(force=True)
    hub.publish("loop.deltas", 1, {"w": torch.ones(8)}).release(force=True)
    assert hub.latest("delta.loop") == 1
    assert hub.latest("loop.deltas") == 1
