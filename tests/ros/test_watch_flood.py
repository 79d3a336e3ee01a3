"""A tenant watching many distinct model names (issue 25, item 2): bounded, thread-free, and
harmless to other tenants; and the multiplexed etcd stream under those watches keeps every
guarantee a watch of its own had (exact start, exactly once across reconnects, compaction).

A real hub over the session's real etcd, on loopback; raw `grpc.aio` stubs open the streams
(an aio client costs no thread per stream, so the threads counted are the hub's).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import grpc.aio
import pytest

from consistency import Etcd, EtcdCluster, Keys
from consistency.watch import RawEvent, Resync
from consistency.watch_mux import WatchMux
from ros.errors import ERROR_METADATA_KEY
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import TensorHubError
from tests.ros.conftest import ADMIN
from tests.waiting import wait_until

NAMES = 300  # the old hub made ~3 threads of each: 900 threads
Metadata = tuple[tuple[str, str], ...]
Call = grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchEvent]


def _threads() -> int:
    """OS threads of this process (the hub runs in it)."""
    return len(os.listdir("/proc/self/task"))


def _meta(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def _refusal(exc: grpc.aio.AioRpcError) -> str:
    """The `tensorhub-error` class name a refused call carries."""
    for item in exc.trailing_metadata() or ():
        key, value = item[0], item[1]  # type: ignore[index]
        if key == ERROR_METADATA_KEY:
            return value if isinstance(value, str) else bytes(value).decode()
    return ""


async def _next(call: Call, timeout: float = 10) -> pb.WatchEvent:
    """The stream's next event, within `timeout` seconds."""
    event = await asyncio.wait_for(call.read(), timeout)
    assert isinstance(event, pb.WatchEvent), event
    return event


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
def test_distinct_names_are_bounded_cost_no_threads_and_leave_others_alone(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, max_watched_models_per_tenant=NAMES
    ).start()
    tenants = TenantStore(server.etcd, server.keys)
    attacker, other = _meta(tenants.create("attacker")), _meta(tenants.create("other"))
    fanout = server.servicer.hub.fanout

    async def main() -> None:
        channel = grpc.aio.insecure_channel(server.address)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]

        def watch(model: str, metadata: Metadata, start: int = 1) -> Call:
            request = pb.WatchRequest(model=model, start_revision=start)
            return stub.Watch(request, metadata=metadata)  # type: ignore[no-any-return]

        async def latest() -> float:
            started = time.monotonic()
            await stub.Latest(pb.LatestRequest(model="m"), metadata=other, timeout=5)
            return time.monotonic() - started

        await latest()  # the other tenant's token is cached, the worker pool started
        idle = _threads()
        since = server.etcd.put(keys.latest("attacker", "name-7"), "1")
        calls = [watch(f"name-{i}", attacker, since) for i in range(NAMES)]
        await _until(lambda: fanout.watchers() == NAMES, 30, f"{NAMES} etcd watches")
        grown = _threads() - idle
        assert grown <= 10, f"{NAMES} watched names grew the hub by {grown} threads"
        assert server.servicer.hub.streams.watched("attacker") == NAMES

        # One more name is refused at once, named; one more stream on a watched name is not.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(watch("one-too-many", attacker).read(), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _refusal(info.value) == "Overloaded"
        assert "--max-watched-models-per-tenant" in (info.value.details() or "")
        again = watch("name-7", attacker, since)
        assert (await _next(again)).version == 1
        # ... and the watches work: each sees its own events, from one etcd stream.
        assert (await _next(calls[7])).version == 1
        server.etcd.put(keys.latest("attacker", "name-123"), "5")
        assert (await _next(calls[123])).version == 5

        # The other tenant is not touched: its calls answer and its watch opens and works.
        assert max([await latest() for _ in range(20)]) < 2.0
        theirs = watch("m", other, server.etcd.put(keys.latest("other", "m"), "3"))
        assert (await _next(theirs)).version == 3

        # Cancelling every one of them at once stalls nobody, and frees every etcd watch.
        for call in [*calls, again]:
            call.cancel()
        slowest = max([await latest() for _ in range(10)])
        assert slowest < 2.0, f"the other tenant waited {slowest:.1f}s while they closed"
        await _until(lambda: fanout.watchers() == 1, 20, "the attacker's watches to end")
        assert server.servicer.hub.streams.watched("attacker") == 0
        # ... and the bound frees with them.
        fresh = watch("one-too-many", attacker, server.etcd.put(keys.latest("attacker", "x"), "1"))
        await _until(lambda: server.servicer.hub.streams.watched("attacker") == 1, 10, "a new name")
        for call in (fresh, theirs):
            call.cancel()
        await channel.close(None)

    try:
        asyncio.run(main())
    finally:
        server.stop(grace=0.2)


@pytest.mark.timeout(60)
def test_private_replays_are_bounded_per_tenant(etcd_cluster: EtcdCluster, keys: Keys) -> None:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys,
        max_private_watches=4, max_private_watches_per_tenant=2,
    ).start()  # fmt: skip
    tenants = TenantStore(server.etcd, server.keys)
    a, b = _meta(tenants.create("tenant-a")), _meta(tenants.create("tenant-b"))

    async def main() -> None:
        channel = grpc.aio.insecure_channel(server.address)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]

        def watch(metadata: Metadata, start: int) -> Call:
            request = pb.WatchRequest(model="m", start_revision=start)
            return stub.Watch(request, metadata=metadata)  # type: ignore[no-any-return]

        first = {t: server.etcd.put(keys.latest(t, "m"), "1") for t in ("tenant-a", "tenant-b")}
        live = {}
        for tenant, metadata in (("tenant-a", a), ("tenant-b", b)):
            live[tenant] = watch(metadata, first[tenant] + 1)  # the shared watch
            await _until(_watching(server, tenant), 10, "the live watch")
            server.etcd.put(keys.latest(tenant, "m"), "2")
            assert (await _next(live[tenant])).version == 2
        # Tenant A replays from version 1 twice (its limit), and is refused a third time.
        replays = [watch(a, first["tenant-a"]) for _ in range(2)]
        for call in replays:
            assert (await _next(call)).version == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(watch(a, first["tenant-a"]).read(), 10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _refusal(info.value) == "Overloaded"
        assert "--max-private-watches-per-tenant" in (info.value.details() or "")
        # Tenant B still gets the replica's remaining slots.
        theirs = watch(b, first["tenant-b"])
        assert (await _next(theirs)).version == 1
        # A slot frees as soon as its stream ends (no thread to wait for).
        replays[0].cancel()
        retry = watch(a, first["tenant-a"])
        assert (await _next(retry)).version == 1
        for call in [*live.values(), *replays, theirs, retry]:
            call.cancel()
        await channel.close(None)

    try:
        asyncio.run(main())
    finally:
        server.stop(grace=0.2)


def _watching(server: HubServer, tenant: str) -> Callable[[], bool]:
    return lambda: server.servicer.hub.streams.watched(tenant) == 1


class _Collector:
    """What a mux watch delivers, per watch, from the mux's thread."""

    def __init__(self) -> None:
        self.items: list[RawEvent | Resync] = []
        self.failed: list[TensorHubError] = []
        self.lock = threading.Lock()

    def deliver(self, items: Sequence[RawEvent | Resync]) -> None:
        with self.lock:
            self.items.extend(items)

    def fail(self, exc: TensorHubError) -> None:
        self.failed.append(exc)

    def values(self) -> list[int]:
        with self.lock:
            return [int(i.kv.value) for i in self.items if isinstance(i, RawEvent)]


@pytest.mark.timeout(60)
def test_mux_delivers_every_event_exactly_once_across_forced_reconnects(
    etcd: Etcd, keys: Keys
) -> None:
    prefixes = [f"{keys.prefix}/mux/{n}/" for n in range(3)]
    _, start = etcd.get(prefixes[0])
    total = 240
    mux = WatchMux(etcd, name="test-mux")
    seen = [_Collector() for _ in prefixes]
    try:
        for prefix, got in zip(prefixes, seen, strict=True):
            mux.watch(prefix, prefix=True, start_revision=start + 1, deliver=got.deliver,
                      fail=got.fail)  # fmt: skip
        # one more, cancelled at once: nothing may reach it, even from its pending create
        dropped = _Collector()
        mux.cancel(mux.watch(prefixes[0], prefix=True, start_revision=start + 1,
                             deliver=dropped.deliver, fail=dropped.fail))  # fmt: skip
        stop = threading.Event()

        def breaker() -> None:
            while not stop.wait(0.05):
                mux.force_reconnect()

        chaos = threading.Thread(target=breaker)
        chaos.start()
        try:
            for i in range(total):
                etcd.put(f"{prefixes[i % 3]}{i:05d}", str(i))
            wait_until("every event", lambda: sum(len(g.values()) for g in seen) >= total, 45)
        finally:
            stop.set()
            chaos.join(5)
        assert mux.reconnects > 0, "the test did not force any reconnect"
        for n, got in enumerate(seen):
            assert got.values() == list(range(n, total, 3)), "lost, repeated or reordered"
            assert not got.failed
        assert dropped.items == []
        assert len(mux) == 3
    finally:
        mux.close()


@pytest.mark.timeout(30)
def test_mux_relists_a_compacted_watch_and_resumes_while_others_go_on(
    etcd: Etcd, keys: Keys
) -> None:
    prefix, other = f"{keys.prefix}/mux-compact/", f"{keys.prefix}/mux-other/"
    _, start = etcd.get(prefix)
    for i in range(5):
        etcd.put(f"{prefix}k{i}", f"old{i}")
    etcd.delete(f"{prefix}k0")
    revision = etcd.put(f"{prefix}k1", "new1")
    etcd.compact(revision)
    mux = WatchMux(etcd, name="test-mux")
    compacted, live = _Collector(), _Collector()
    try:
        mux.watch(other, prefix=True, start_revision=revision + 1, deliver=live.deliver,
                  fail=live.fail)  # fmt: skip
        mux.watch(prefix, prefix=True, start_revision=start + 1, deliver=compacted.deliver,
                  fail=compacted.fail)  # fmt: skip
        wait_until("the re-list", lambda: bool(compacted.items), 10)
        first = compacted.items[0]
        assert isinstance(first, Resync)
        assert first.revision >= revision
        state = {kv.key.decode().rsplit("/", 1)[1]: kv.value.decode() for kv in first.kvs}
        assert state == {"k1": "new1", "k2": "old2", "k3": "old3", "k4": "old4"}
        etcd.put(f"{prefix}k9", "9")
        etcd.put(f"{other}x", "7")
        wait_until("the events after it", lambda: compacted.values() and live.values(), 10)
        time.sleep(0.3)
        assert compacted.values() == [9], "an event was repeated after the re-list"
        assert live.values() == [7]
        assert not compacted.failed
        assert not live.failed
    finally:
        mux.close()


@pytest.mark.timeout(60)
def test_mux_reopens_its_stream_when_a_later_create_finds_its_token_expired() -> None:
    # etcd checks a watch's auth token at each create, on the token the stream opened with:
    # a mux stream outlives that token, so a create refused for it reopens the stream (with
    # the fresh token) and every watch on it resumes after its last event.
    with (
        EtcdCluster(size=1, auth=True, extra_args=["--auth-token-ttl=1"]) as cluster,
        Etcd(cluster.endpoints, credentials=cluster.credentials, stream_token_age=0.5) as etcd,
    ):
        start = etcd.put("/ttl/a/k", "1")
        mux = WatchMux(etcd, name="test-mux")
        early, late = _Collector(), _Collector()
        try:
            mux.watch("/ttl/a/", prefix=True, start_revision=start, deliver=early.deliver,
                      fail=early.fail)  # fmt: skip
            wait_until("the first watch's event", lambda: early.values() == [1])
            time.sleep(2.5)  # the stream's token expires on the member
            etcd.put("/ttl/a/k", "2")  # a call renews the client's token
            mux.watch("/ttl/b/", prefix=True, start_revision=start, deliver=late.deliver,
                      fail=late.fail)  # fmt: skip
            etcd.put("/ttl/b/k", "3")
            wait_until("both watches' events", lambda: late.values() == [3], 20)
            wait_until("the first watch's next event", lambda: early.values() == [1, 2])
            assert mux.reconnects >= 1  # the refused create reopened the stream
            assert not early.failed
            assert not late.failed
        finally:
            mux.close()
