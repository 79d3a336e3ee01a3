"""Hostile publishers of one tenant against a real hub (issue 38, row 12), each by
raw gRPC calls where the SDK would refuse to send them, over the session's real etcd.

- Row 12: shards against the publish-rate quota. A version of N shards takes
  ceil(N / `SHARDS_PER_TOKEN`) tokens, one per K-th arrival, so one shard each of many
  versions costs a token each (it cost 1 / N: 11,444 shard publishes a minute passed a
  quota of 600), and a version costs the same one rank per call or all ranks at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from consistency.manifests import MAX_SHARDS
from consistency.usage import SHARDS_PER_TOKEN, shard_tokens
from ros.errors import from_rpc_error
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import QuotaExceeded, TensorHubError

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
