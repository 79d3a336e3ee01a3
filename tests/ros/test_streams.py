"""The hub holds many streams without a thread each, and refuses past its explicit limits.

A real hub over the session's real etcd; raw `grpc.aio` client stubs open the streams (an
aio client costs no thread per stream either, so the threads counted are the hub's).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

import ros
from consistency import Etcd, EtcdCluster, Keys
from ros.errors import ERROR_METADATA_KEY, from_rpc_error
from ros.hub.call import CallContext
from ros.hub.rpc import unary
from ros.hub.server import HubServer, call_guard
from ros.hub.servicer import HubServicer
from ros.hub.tenants import TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import InternalError, Overloaded
from tests.ros.conftest import ADMIN
from tests.ros.helpers import make_model

SESSIONS = 10
KEEPALIVES = 1000
WATCHES = 1000  # 2,000 streams in all: the old server answered nothing past ~280


def _threads() -> int:
    """OS threads of this process (the hub runs in it)."""
    return len(os.listdir("/proc/self/task"))


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _hold(
    first: pb.KeepAliveRequest, done: asyncio.Event
) -> AsyncIterator[pb.KeepAliveRequest]:
    """A KeepAlive request side: one renewal, then open (silent) until `done`."""
    yield first
    await done.wait()


def _refusal(exc: grpc.aio.AioRpcError) -> str:
    """The `tensorhub-error` class name a refused call carries."""
    for item in exc.trailing_metadata() or ():
        key, value = item[0], item[1]
        if key == ERROR_METADATA_KEY:
            return value if isinstance(value, str) else bytes(value).decode()
    return ""


async def _wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
def test_many_streams_cost_no_threads_and_calls_still_answer(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    token = make_tenant("team-s")
    metadata = _meta(token)
    trainer = ros.connect(hub_server.address, tenant="team-s", token=token)
    first = trainer.publish("policy", 1, make_model(1))

    async def main() -> None:
        channel = grpc.aio.insecure_channel(hub_server.address)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        health = health_pb2_grpc.HealthStub(channel)
        sessions = [
            (await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=metadata))
            for _ in range(SESSIONS)
        ]
        done = asyncio.Event()
        baseline = hub_server.servicer.hub.streams.active()
        # Warm up: one stream of each kind starts whatever threads the hub keeps for good
        # (the shared etcd watch of the model, the keepalive multiplexer).
        warm = stub.KeepAlive(
            _hold(pb.KeepAliveRequest(session_id=sessions[0].session_id), done),
            metadata=metadata,
        )
        assert (await warm.read()).ttl_seconds > 0
        threads_before = _threads()

        keepalives = [
            stub.KeepAlive(
                _hold(pb.KeepAliveRequest(session_id=sessions[i % SESSIONS].session_id), done),
                metadata=metadata,
            )
            for i in range(KEEPALIVES)
        ]
        watch_from = int(first.revision) + 1
        watches = [
            stub.Watch(
                pb.WatchRequest(model="policy", start_revision=watch_from, versions_only=True),
                metadata=metadata,
            )
            for _ in range(WATCHES)
        ]
        renewed = await asyncio.wait_for(
            asyncio.gather(*(call.read() for call in keepalives)), timeout=30
        )
        assert all(r.ttl_seconds > 0 for r in renewed)  # every stream renewed its session
        total = KEEPALIVES + WATCHES + 1
        await _wait_for(
            lambda: hub_server.servicer.hub.streams.active() >= baseline + total, 20, "streams"
        )

        # With 2,000 streams open, unary calls and the health check answer at once.
        started = time.monotonic()
        latest = await stub.Latest(pb.LatestRequest(model="policy"), metadata=metadata, timeout=5)
        assert latest.version == 1
        check = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < 5

        threads_after = _threads()
        # The old server had a thread per stream (and stopped answering at ~140 clients);
        # here only the worker pool may still have grown to its fixed size.
        grown = threads_after - threads_before
        assert grown <= hub_server.limits.workers + 8, (threads_before, threads_after)

        # Every watch stream gets the next version, from the one shared etcd watch.
        await asyncio.to_thread(trainer.publish, "policy", 2, make_model(2))
        events = await asyncio.wait_for(
            asyncio.gather(*(call.read() for call in watches)), timeout=30
        )
        assert {(e.kind, e.version) for e in events} == {(pb.WatchEvent.VERSION_PUBLISHED, 2)}
        assert len(hub_server.servicer.hub.fanout._shared) == 1

        for call in [warm, *keepalives, *watches]:
            call.cancel()
        done.set()
        await _wait_for(
            lambda: hub_server.servicer.hub.streams.active() <= baseline, 20, "slots to free"
        )
        await channel.close(None)

    try:
        asyncio.run(main())
    finally:
        trainer.close()


@pytest.mark.timeout(60)
def test_a_tenant_at_its_stream_limit_is_overloaded_and_another_is_not(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, max_streams_per_tenant=4
    ).start()
    tenants = TenantStore(server.etcd, server.keys)
    a, b = _meta(tenants.create("tenant-a")), _meta(tenants.create("tenant-b"))
    refused = (
        REGISTRY.get_sample_value("tensorhub_hub_streams_refused_total", {"scope": "tenant"}) or 0.0
    )

    def watch(stub: hub_pb2_grpc.TensorHubStub, metadata: tuple[tuple[str, str], ...]) -> object:
        return stub.Watch(pb.WatchRequest(model="m", start_revision=1), metadata=metadata)

    async def main() -> None:
        channel = grpc.aio.insecure_channel(server.address)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        held = [watch(stub, a) for _ in range(4)]
        await _wait_for(
            lambda: server.servicer.hub.streams.active("tenant-a") == 4, 10, "4 streams"
        )
        # A fifth stream of tenant A fails at once, with the named error and the limit.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(watch(stub, a).read(), timeout=5)  # type: ignore[attr-defined]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _refusal(info.value) == "Overloaded"
        assert isinstance(from_rpc_error(info.value), Overloaded)  # not QuotaExceeded
        assert "--max-streams-per-tenant" in (info.value.details() or "")
        session = await stub.OpenSession(pb.OpenSessionRequest(), metadata=a)
        # A KeepAlive stream takes its slot when its first renewal arrives (a silent one holds
        # none: `ros.hub.guard`), and is refused then.
        first = pb.KeepAliveRequest(session_id=session.session_id)
        keepalive = stub.KeepAlive(iter([first]), metadata=a)
        code = await asyncio.wait_for(keepalive.code(), timeout=5)  # type: ignore[attr-defined]
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = await keepalive.trailing_metadata()  # type: ignore[attr-defined]
        assert dict(trailing or ()).get(ERROR_METADATA_KEY) == "Overloaded"
        assert session.session_id  # the session itself opened: only its stream is refused
        # Tenant B is not affected: its streams open and its calls answer.
        other = watch(stub, b)
        await _wait_for(
            lambda: server.servicer.hub.streams.active("tenant-b") == 1, 10, "B's stream"
        )
        await stub.Latest(pb.LatestRequest(model="m"), metadata=b, timeout=5)
        for call in [*held, other]:
            call.cancel()  # type: ignore[attr-defined]
        await _wait_for(lambda: server.servicer.hub.streams.active() == 0, 10, "slots to free")
        # A's slot is free again.
        again = watch(stub, a)
        await _wait_for(lambda: server.servicer.hub.streams.active("tenant-a") == 1, 10, "reopen")
        again.cancel()  # type: ignore[attr-defined]
        await channel.close(None)

    try:
        asyncio.run(main())
    finally:
        server.stop(grace=0.2)
    after = REGISTRY.get_sample_value("tensorhub_hub_streams_refused_total", {"scope": "tenant"})
    assert after is not None
    assert after >= refused + 2
    assert REGISTRY.get_sample_value("tensorhub_hub_stream_limit", {"scope": "tenant"}) == 4


@pytest.fixture
def serve_process(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
         "--etcd", ",".join(etcd_cluster.endpoints), "--admin-token", ADMIN,
         "--prefix", keys.prefix, "--ready-file", str(ready), "--grace", "1",
         "--max-streams", "100", "--workers", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "serve exited"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield proc, json.loads(ready.read_text())["address"]
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_sigterm_stops_serve_within_its_grace_with_streams_open(
    serve_process: tuple[subprocess.Popen[str], str], etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    proc, address = serve_process
    with Etcd(etcd_cluster.endpoints) as etcd:
        metadata = _meta(TenantStore(etcd, keys).create("team-t"))

    async def main() -> None:
        channel = grpc.aio.insecure_channel(address)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        calls = [
            stub.Watch(pb.WatchRequest(model="m", start_revision=1), metadata=metadata)
            for _ in range(20)
        ]
        await stub.Latest(pb.LatestRequest(model="m"), metadata=metadata, timeout=5)
        await asyncio.sleep(0.3)  # let the watches attach
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 10)
        took = time.monotonic() - started
        assert code == 0
        assert took < 1 + 3, f"serve took {took:.1f}s to stop with --grace 1"
        for call in calls:
            call.cancel()
        await channel.close(None)

    asyncio.run(main())


def test_serve_help_lists_the_stream_limits() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--help"], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    for flag in ("--max-streams", "--max-streams-per-tenant", "--workers", "--grace"):
        assert flag in out


class _Failing(HubServicer):
    """The real servicer with one handler body that fails the way a bug would."""

    @unary
    def Latest(self, request: pb.LatestRequest, context: CallContext) -> pb.LatestResponse:  # noqa: N802 - the proto's name
        raise ValueError("a bug, not a TensorHubError")


def test_an_unexpected_failure_answers_internal_with_its_name(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    async def main() -> None:
        etcd = Etcd(etcd_cluster.endpoints)
        servicer = _Failing(etcd, keys, admin_token=ADMIN).start()
        server = grpc.aio.server(interceptors=[call_guard(servicer)])
        hub_pb2_grpc.add_TensorHubServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        token = TenantStore(etcd, keys).create("team-x")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Latest(pb.LatestRequest(model="m"), metadata=_meta(token), timeout=5)
            assert info.value.code() == grpc.StatusCode.INTERNAL  # not UNKNOWN
            assert _refusal(info.value) == "InternalError"
            assert isinstance(from_rpc_error(info.value), InternalError)
        finally:
            await channel.close(None)
            await server.stop(0)
            servicer.close()
            etcd.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_replays_from_old_revisions_are_bounded(etcd_cluster: EtcdCluster, keys: Keys) -> None:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, max_private_watches=1
    ).start()
    metadata = _meta(TenantStore(server.etcd, server.keys).create("tenant-p"))
    latest = keys.latest("tenant-p", "m")

    async def main() -> None:
        channel = grpc.aio.insecure_channel(server.address)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]

        def watch(start: int) -> grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchEvent]:
            return stub.Watch(pb.WatchRequest(model="m", start_revision=start), metadata=metadata)  # type: ignore[no-any-return]

        first = server.etcd.put(latest, "1")
        live = watch(first + 1)  # joins (creates) the shared watch
        await _wait_for(lambda: server.servicer.hub.streams.active() == 1, 10, "the live watch")
        server.etcd.put(latest, "2")
        assert (await asyncio.wait_for(live.read(), 10)).version == 2  # the shared one passed
        replay = watch(first)  # older than the shared watch: a private replay, the only slot
        assert (await asyncio.wait_for(replay.read(), 10)).version == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(watch(first).read(), 10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _refusal(info.value) == "Overloaded"
        assert "--max-private-watches" in (info.value.details() or "")
        replay.cancel()
        await asyncio.sleep(1.0)  # its thread closes the etcd watch and frees the slot
        again = watch(first)
        assert (await asyncio.wait_for(again.read(), 10)).version == 1
        for call in (live, again):
            call.cancel()
        await channel.close(None)

    try:
        asyncio.run(main())
    finally:
        server.stop(grace=0.2)


@pytest.mark.timeout(60)
def test_the_sdk_waits_out_an_overloaded_hub_and_then_watches(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, max_streams_per_tenant=2
    ).start()
    token = TenantStore(server.etcd, server.keys).create("tenant-o")
    client = ros.connect(server.address, tenant="tenant-o", token=token)  # its keepalive: 1
    channel = grpc.insecure_channel(server.address)
    try:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        since = server.etcd.put(keys.latest("tenant-o", "m"), "1") + 1
        hog = stub.Watch(pb.WatchRequest(model="m", start_revision=since), metadata=_meta(token))
        deadline = time.monotonic() + 10
        while server.servicer.hub.streams.active("tenant-o") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        watch = client.watch("m", since=since)  # refused (Overloaded): the SDK backs off
        time.sleep(1.0)
        assert watch.get(timeout=0.1) is None
        assert watch.reconnects >= 1
        hog.cancel()  # a slot frees; the SDK's next try gets it
        server.etcd.put(keys.latest("tenant-o", "m"), "2")
        event = watch.get(timeout=15)
        assert event is not None
        assert event.version == 2
        watch.close()
    finally:
        channel.close()
        client.close()
        server.stop(grace=0.2)


@pytest.mark.timeout(60)
def test_a_refused_session_keepalive_retries_before_its_lease_runs_out(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, max_streams_per_tenant=1
    ).start()
    token = TenantStore(server.etcd, server.keys).create("tenant-k")
    channel = grpc.insecure_channel(server.address)
    try:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        hog = stub.Watch(pb.WatchRequest(model="m", start_revision=1), metadata=_meta(token))
        deadline = time.monotonic() + 10
        while server.servicer.hub.streams.active("tenant-k") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = ros.connect(server.address, tenant="tenant-k", token=token, session_ttl=3)
        try:
            time.sleep(1.0)  # its keepalive stream is refused meanwhile, and retried
            hog.cancel()
            time.sleep(3.5)  # past the TTL: only a renewal after the refusals keeps it
            assert not client.session.lost.is_set()
            assert server.etcd.lease_ttl(client.session.id) > 0
        finally:
            client.close()
    finally:
        channel.close()
        server.stop(grace=0.2)
