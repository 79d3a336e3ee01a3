"""Bursts through a real hub (gRPC on loopback, real etcd): shards of one version and session
opens arriving at once commit in batches (`ros.hub.group_commit`), and every guarantee holds.

The batches are made deterministic with a failpoint, not a timer: the hub's etcd client
holds the first transaction that writes a chosen key until the test releases it, the test
waits until the rest of the burst is queued behind it, then lets go.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from consistency import Keys
from consistency.shard_entries import FIXED_OPS, MAX_TXN_OPS
from ros.errors import ERROR_METADATA_KEY
from ros.hub.server import HubServer
from ros.hub.session_marks import MAX_BATCH as MARK_BATCH
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.failpoints import HeldTxn

SHARD_BATCH = (MAX_TXN_OPS - FIXED_OPS) // 2  # inline shards: 2 puts each


def tenant(hub: HubServer, name: str, **quotas: int) -> str:
    return TenantStore(hub.etcd, hub.keys).create(name, Quotas(**quotas))


def wait_until(what: str, predicate: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def shard_request(index: int, count: int, session: int, model: str = "mp") -> pb.PublishRequest:
    return pb.PublishRequest(
        model=model,
        version=1,
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


def error_name(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError | grpc.RpcError):
        for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
            if key == ERROR_METADATA_KEY:
                return str(value)
    return type(exc).__name__


async def gather(calls: list[Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*calls, return_exceptions=True))


def run_burst(addresses: list[str], token: str, body: Callable[[list[Any]], Awaitable[Any]]) -> Any:
    """Run `body(stubs)` on a fresh loop with one aio channel per address."""

    async def main() -> Any:
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        stubs = [hub_pb2_grpc.TensorHubStub(c) for c in channels]  # type: ignore[no-untyped-call]
        try:
            return await body(stubs)
        finally:
            for channel in channels:
                await channel.close(0)

    return asyncio.run(main())


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def transactions(hub: HubServer, prefix: str) -> int:
    """How many etcd transactions wrote the keys under `prefix` (each written once)."""
    return len({kv.mod_revision for kv in hub.etcd.range(prefix, prefix=True).kvs})


def test_a_burst_of_shards_commits_in_full_batches_and_shows_once(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    count = 3 * SHARD_BATCH + 7
    token = tenant(hub_server, "burst")
    keys: Keys = hub_server.keys
    group = hub_server.servicer.hub.shard_batches.group
    failpoint = HeldTxn(hub_server.etcd, keys.shards("burst", "mp", 1))
    held.append(failpoint)
    md = metadata(token)

    async def body(stubs: list[Any]) -> list[Any]:
        stub = stubs[0]
        session = await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)
        calls = [
            stub.Publish(shard_request(i, count, session.session_id), metadata=md, timeout=60)
            for i in range(count)
        ]
        results = asyncio.ensure_future(gather(calls))
        await asyncio.to_thread(failpoint.reached.wait, 30)
        held_shards.append(len(failpoint.keys))  # the first batch (what had arrived by then)
        await asyncio.to_thread(
            wait_until,
            "the burst is queued",
            lambda: group.waiting(("burst", "mp", 1)) == count - held_shards[0],
        )
        latest = await stub.Latest(pb.LatestRequest(model="mp"), metadata=md)
        assert latest.version == 0  # nothing visible while shards are missing
        failpoint.release()
        return await results

    held_shards: list[int] = []
    results = run_burst([hub_server.address], token, body)
    errors = [error_name(r) for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    visible = [r for r in results if r.visible]
    assert len({r.revision for r in visible}) == 1  # one transaction made it visible
    assert {r.revision for r in visible} == {max(r.revision for r in results)}
    batches = 1 + math.ceil((count - held_shards[0]) / SHARD_BATCH)
    assert transactions(hub_server, keys.shards("burst", "mp", 1)) == batches
    assert group.largest == SHARD_BATCH


def test_unrelated_models_of_a_tenant_do_not_wait_for_each_other(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    """While model A's publish transaction is held at the door, model B's publish of the
    same tenant completes; then A's does too."""
    token = tenant(hub_server, "two-models")
    keys = hub_server.keys
    failpoint = HeldTxn(hub_server.etcd, keys.latest("two-models", "model-a"))
    held.append(failpoint)
    md = metadata(token)
    channel = grpc.insecure_channel(hub_server.address)
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    try:
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md).session_id

        def publish(model: str) -> Any:
            request = shard_request(0, 1, session, model)
            request.ClearField("shard_count")
            request.ClearField("shard_index")
            request.holder.ClearField("shard")
            return stub.Publish(request, metadata=md, timeout=20)

        outcome: list[Any] = []
        a = threading.Thread(target=lambda: outcome.append(publish("model-a")))
        a.start()
        assert failpoint.reached.wait(20), "model A's transaction never reached etcd"
        b = publish("model-b")  # completes while A's transaction is held
        assert b.visible
        assert stub.Latest(pb.LatestRequest(model="model-a"), metadata=md).version == 0
        failpoint.release()
        a.join(30)
        assert outcome
        assert outcome[0].visible
    finally:
        channel.close()


def test_shards_spread_over_two_replicas_show_the_version_once(
    hub_server: HubServer, etcd_cluster: Any
) -> None:
    count = 150
    token = tenant(hub_server, "spread")
    other = HubServer(etcd_cluster.endpoints, admin_token="x", keys=hub_server.keys).start()
    md = metadata(token)
    try:

        async def body(stubs: list[Any]) -> list[Any]:
            sessions = [
                (await s.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)).session_id
                for s in stubs
            ]
            return await gather(
                [
                    stubs[i % 2].Publish(
                        shard_request(i, count, sessions[i % 2]), metadata=md, timeout=60
                    )
                    for i in range(count)
                ]
            )

        results = run_burst([hub_server.address, other.address], token, body)
    finally:
        other.stop(grace=0.2)
    errors = [error_name(r) for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    visible = {r.revision for r in results if r.visible}
    assert len(visible) == 1
    header = hub_server.servicer.hub.versions(
        hub_server.servicer.hub.tenants.authenticate(token)
    ).header("spread", "mp", 1)
    assert header.shard_count == count
    assert header.published_revision == visible.pop()


def test_a_dead_session_in_a_hub_batch_fails_alone(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    count = 12
    token = tenant(hub_server, "dying")
    failpoint = HeldTxn(hub_server.etcd, hub_server.keys.shards("dying", "mp", 1))
    held.append(failpoint)
    group = hub_server.servicer.hub.shard_batches.group
    md = metadata(token)

    async def body(stubs: list[Any]) -> list[Any]:
        stub = stubs[0]
        live, dying = [
            (await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=ttl), metadata=md)).session_id
            for ttl in (60, 5)
        ]
        first = asyncio.ensure_future(
            stub.Publish(shard_request(0, count, live), metadata=md, timeout=30)
        )
        await asyncio.to_thread(failpoint.reached.wait, 30)
        rest = asyncio.ensure_future(
            gather(
                [
                    stub.Publish(
                        shard_request(i, count, dying if i % 4 == 1 else live),
                        metadata=md,
                        timeout=30,
                    )
                    for i in range(1, count)
                ]
            )
        )
        await asyncio.to_thread(
            wait_until, "the rest is queued", lambda: group.waiting(("dying", "mp", 1)) == count - 1
        )
        hub_server.etcd.lease_revoke(dying)  # the session dies while its shards wait
        failpoint.release()
        return [await first, *(await rest)]

    results = run_burst([hub_server.address], token, body)
    for i, result in enumerate(results):
        if i % 4 == 1:
            assert error_name(result) == "SessionExpired", (i, result)
        else:
            assert not isinstance(result, BaseException), (i, error_name(result))
    keys = hub_server.keys
    left = hub_server.etcd.range(keys.shards("dying", "mp", 1), prefix=True).kvs
    assert len(left) == count - len(range(1, count, 4))  # the dead session's shards: none
    assert hub_server.etcd.get(keys.latest("dying", "mp"))[0] is None


def test_a_herd_of_session_opens_commits_in_batches_within_the_quota(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    opens, quota = 2 * MARK_BATCH + 30, 2 * MARK_BATCH
    token = tenant(hub_server, "herd", max_sessions=quota)
    keys = hub_server.keys
    failpoint = HeldTxn(hub_server.etcd, keys.sessions("herd"))
    held.append(failpoint)
    group = hub_server.servicer.hub.session_marks.group
    md = metadata(token)

    async def body(stubs: list[Any]) -> list[Any]:
        calls = [
            stubs[0].OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=md, timeout=60)
            for _ in range(opens)
        ]
        results = asyncio.ensure_future(gather(calls))
        await asyncio.to_thread(failpoint.reached.wait, 30)
        await asyncio.to_thread(
            wait_until, "the herd is queued", lambda: group.waiting("herd") == opens - 1
        )
        failpoint.release()
        return await results

    results = run_burst([hub_server.address], token, body)
    opened = [r for r in results if not isinstance(r, BaseException)]
    refused = [error_name(r) for r in results if isinstance(r, BaseException)]
    assert len(opened) == quota
    assert refused == ["QuotaExceeded"] * (opens - quota)
    assert hub_server.etcd.count(keys.sessions("herd")) == quota
    assert transactions(hub_server, keys.sessions("herd")) == 1 + math.ceil(
        (quota - 1) / MARK_BATCH
    )
    assert group.largest == MARK_BATCH


def test_a_shard_whose_caller_left_before_its_batch_is_not_written(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    """A paged shard whose deadline passes while it waits behind a held batch: its caller
    hears DEADLINE_EXCEEDED, the shard is left out of the next batch, and its staged pages
    are deleted (not left under the session's lease for as long as it lives)."""
    token = tenant(hub_server, "leaver")
    keys = hub_server.keys
    failpoint = HeldTxn(hub_server.etcd, keys.shards("leaver", "mp", 1))
    held.append(failpoint)
    md = metadata(token)
    big = shard_request(1, 3, 0)
    big.manifest.CopyFrom(
        pb.Manifest(
            tensors=[  # > 1 KiB of manifest: paged before its batch
                pb.TensorEntry(
                    name=f"layer.{i}.weight", dtype="float32", shape=[16], offset=64 * i, nbytes=64
                )
                for i in range(60)
            ],
            total_bytes=3840,
            chunk_size=4096,
            chunk_xxh3=[1],
        )
    )

    async def body(stubs: list[Any]) -> list[Any]:
        stub = stubs[0]
        session = (
            await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)
        ).session_id
        big.holder.session_id = session
        first = asyncio.ensure_future(
            stub.Publish(shard_request(0, 3, session), metadata=md, timeout=30)
        )
        await asyncio.to_thread(failpoint.reached.wait, 30)
        try:
            await stub.Publish(big, metadata=md, timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            late = exc.code()
        failpoint.release()
        return [await first, late]

    first, late = run_burst([hub_server.address], token, body)
    assert late == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not first.visible
    pages = keys.manifest_part("leaver", "mp", 1, 1)
    wait_until("the left shard's pages are deleted", lambda: hub_server.etcd.count(pages) == 0)
    assert hub_server.etcd.get(keys.shard("leaver", "mp", 1, 1))[0] is None
