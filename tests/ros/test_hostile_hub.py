"""Hostile clients against a real hub (issue 12, items 1 and 2): silent streams with and
without a token, calls past gRPC's own call limit, and a shard bomb.

Raw `grpc.aio` calls open HTTP/2 streams that never send their request message (the server
sees the headers only), to any method name; everything runs on loopback over the session's
real etcd.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ros
from consistency import Etcd, EtcdCluster, Keys
from ros.errors import ERROR_METADATA_KEY, from_rpc_error
from ros.hub.server import SERVICE_NAME, HubServer, call_guard
from ros.hub.servicer import HubServicer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import InvalidArgument, Overloaded
from tests.ros.conftest import ADMIN
from tests.ros.helpers import make_model
from tests.waiting import wait_until

SILENT = 2000  # the attack froze the old server with 256
CONNECTIONS = 4
TENANT_METHODS = [
    f"/{SERVICE_NAME}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["TensorHub"].methods
]
OPEN_METHODS = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
]
Metadata = tuple[tuple[str, str], ...]


def _meta(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def _silent(channel: grpc.aio.Channel, method: str, metadata: Metadata | None) -> Any:
    """A call to `method` that sends its headers and never a message."""
    call = channel.stream_stream(method, request_serializer=bytes, response_deserializer=bytes)
    return call(metadata=metadata)  # type: ignore[call-arg]


def _channels(address: str, count: int) -> list[grpc.aio.Channel]:
    """`count` channels, each its own TCP connection."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(address, options) for _ in range(count)]


async def _outcome(call: Any, timeout: float) -> tuple[grpc.StatusCode, str]:
    """The status code a call ended with and the `tensorhub-error` class it named."""
    code = await asyncio.wait_for(call.code(), timeout)
    trailing = await call.trailing_metadata()
    return code, str(dict(trailing or ()).get(ERROR_METADATA_KEY, ""))


@pytest.fixture
def guarded_hub(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    """A hub that waits 8 s for a first message: long enough to attack it and serve
    another tenant meanwhile (that took 2.1 s at a load of 10 on 2 cores), and what the
    test then waits for the held calls to end."""
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, first_message_seconds=8.0
    ).start()
    yield server
    server.stop(grace=0.2)


@pytest.mark.timeout(120)
def test_silent_calls_without_a_valid_token_are_refused_at_once_and_freeze_nobody(
    guarded_hub: HubServer,
) -> None:
    """2,000 silent calls over 4 connections, to every method: those of the TensorHub
    service (no token, or a forged one) end at once with PermissionDenied; the health and
    reflection calls are held at most until the first-message deadline. Meanwhile another
    tenant publishes and reads, and the health check answers."""
    tenants = TenantStore(guarded_hub.etcd, guarded_hub.keys)
    token_b = tenants.create("team-b")
    forged = _meta("team-b.not-the-secret")
    methods = TENANT_METHODS + OPEN_METHODS

    async def main() -> None:
        channels = _channels(guarded_hub.address, CONNECTIONS)
        calls = [
            (m, _silent(channels[i % CONNECTIONS], m, forged if i % 3 == 0 else None))
            for i in range(SILENT)
            for m in [methods[i % len(methods)]]
        ]
        tenant_calls = [c for m, c in calls if m in TENANT_METHODS]
        open_calls = [c for m, c in calls if m in OPEN_METHODS]
        refused = await asyncio.gather(*(_outcome(c, 30) for c in tenant_calls))
        assert set(refused) == {(grpc.StatusCode.PERMISSION_DENIED, "PermissionDenied")}

        # Another tenant is served while the open-method calls are still held.
        def tenant_b_works() -> int:
            with ros.connect(guarded_hub.address, tenant="team-b", token=token_b) as hub:
                hub.publish("policy", 1, make_model(1)).release(force=True)
                return hub.latest("policy")

        assert await asyncio.wait_for(asyncio.to_thread(tenant_b_works), 15) == 1
        health = health_pb2_grpc.HealthStub(channels[0])
        check = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert not all(c.done() for c in open_calls), "the attack was over before B was served"

        # The held ones end at their first-message deadline, with the named error.
        ended = await asyncio.gather(*(_outcome(c, 60) for c in open_calls))
        assert set(ended) == {(grpc.StatusCode.DEADLINE_EXCEEDED, "DeadlineExceeded")}
        for channel in channels:
            await channel.close(None)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_tenants_silent_streams_take_no_slot_and_end_at_the_first_message_deadline(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    """Tenant A opens 600 silent KeepAlive, Watch and Latest calls, far past its stream
    limit of 16: none takes a stream slot (a stream's first message comes before its slot),
    at most 16 wait for their first message at once (the rest are refused at once with
    Overloaded, so A cannot take the replica's call budget), tenant B's streams and calls
    are served, and A's waiting calls end with DeadlineExceeded."""
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, max_streams_per_tenant=16,
        first_message_seconds=3.0,
    ).start()  # fmt: skip
    tenants = TenantStore(server.etcd, server.keys)
    a, b = _meta(tenants.create("team-a")), _meta(tenants.create("team-b"))
    names = [f"/{SERVICE_NAME}/{m}" for m in ("KeepAlive", "Watch", "Latest")]

    async def main() -> None:
        (channel,) = _channels(server.address, 1)
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        silent = [_silent(channel, names[i % 3], a) for i in range(600)]
        session = await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=b)
        keepalive = stub.KeepAlive(metadata=b)
        await keepalive.write(pb.KeepAliveRequest(session_id=session.session_id))
        assert (await asyncio.wait_for(keepalive.read(), 10)).ttl_seconds > 0
        watch = stub.Watch(pb.WatchRequest(model="m", start_revision=1), metadata=b)
        latest = await stub.Latest(pb.LatestRequest(model="m"), metadata=b, timeout=10)
        assert latest.version == 0
        assert server.servicer.hub.streams.active("team-a") == 0
        assert server.servicer.hub.streams.active("team-b") >= 1

        ended = await asyncio.gather(*(_outcome(c, 60) for c in silent))
        timed_out = (grpc.StatusCode.DEADLINE_EXCEEDED, "DeadlineExceeded")
        overloaded = (grpc.StatusCode.RESOURCE_EXHAUSTED, "Overloaded")
        assert set(ended) == {timed_out, overloaded}
        assert ended.count(timed_out) < 300  # 16 at a time: 300 would take 56 s of opening
        assert not keepalive.done()  # B's streams are untouched
        assert not watch.done()
        keepalive.cancel()
        watch.cancel()
        await channel.close(None)

    try:
        asyncio.run(main())
    finally:
        server.stop(grace=0.2)


class _LoopThread:
    """An asyncio loop in a thread (a raw aio server beside a synchronous SDK client)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.mark.timeout(60)
def test_connect_past_grpcs_own_call_limit_is_overloaded_not_a_quota(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    """gRPC refuses calls past `maximum_concurrent_rpcs` with RESOURCE_EXHAUSTED and no
    tensorhub-error name: `ros.connect` backs off, then says Overloaded (it said
    QuotaExceeded, a quota the tenant never reached); once calls free up, it connects."""
    etcd = Etcd(etcd_cluster.endpoints)
    token = TenantStore(etcd, keys).create("team-c")
    loop = _LoopThread()
    servicer = HubServicer(etcd, keys, admin_token=ADMIN).start()

    async def serve() -> tuple[grpc.aio.Server, int, grpc.aio.Channel, list[Any]]:
        server = grpc.aio.server(interceptors=[call_guard(servicer)], maximum_concurrent_rpcs=2)
        hub_pb2_grpc.add_TensorHubServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        held = [_silent(channel, f"/{SERVICE_NAME}/KeepAlive", _meta(token)) for _ in range(2)]
        await asyncio.sleep(0.5)  # the held calls reach the server
        return server, port, channel, held

    server, port, channel, held = loop.run(serve())
    try:
        with pytest.raises(Overloaded):
            ros.connect(f"127.0.0.1:{port}", tenant="team-c", token=token, timeout=2.0)
        for call in held:
            call.cancel()
        with ros.connect(f"127.0.0.1:{port}", tenant="team-c", token=token) as hub:
            assert hub.latest("nothing") == 0
    finally:
        loop.run(channel.close(None))
        loop.run(server.stop(0))
        loop.close()
        servicer.close()
        etcd.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def serve(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`tensorhub serve` in its own process, with a grace of 1 s."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
         "--etcd", ",".join(etcd_cluster.endpoints), "--prefix", keys.prefix,
         "--ready-file", str(ready), "--grace", "1", "--workers", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TENSORHUB_ADMIN_TOKEN": ADMIN},
    )  # fmt: skip
    try:
        wait_until("serve is ready", lambda: ready.exists() or proc.poll() is not None, 30)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "serve exited"
        yield proc, json.loads(ready.read_text())["address"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def _publish_request(session: int, shard_count: int = 0, tensors: int = 1) -> pb.PublishRequest:
    """A valid publish of `tensors` float32 scalars; with many, a big manifest (each name
    is 1,000 bytes: 36,000 tensors make a 37 MB manifest, 36 etcd pages)."""
    chunk = 1 << 20
    total = tensors * 64
    manifest = pb.Manifest(
        tensors=[
            pb.TensorEntry(
                name=f"{i:08d}" + "x" * 992, dtype="float32", shape=[1], offset=i * 64, nbytes=4
            )
            for i in range(tensors)
        ],
        total_bytes=total, chunk_size=chunk, chunk_xxh3=[0] * -(-total // chunk),
    )  # fmt: skip
    holder = pb.Holder(name="h", endpoints={"tcp": "127.0.0.1:1"}, session_id=session)
    return pb.PublishRequest(
        model="bomb", version=1, manifest=manifest, holder=holder, shard_count=shard_count
    )


@pytest.mark.timeout(90)
def test_a_shard_bomb_is_refused_at_once_and_sigterm_stops_serve_mid_publish(
    serve: tuple[subprocess.Popen[str], str], etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    """Publish with shard_count 2**31-1 (it grew the old hub by 160 MB/s, past its caller's
    deadline and through SIGTERM): InvalidArgument at once, 20 times over, nothing written,
    and the serving process does not grow. Then SIGTERM while 8 publishes of 37 MB manifests
    are in flight (one is writing its pages to etcd) stops `tensorhub serve` within its
    grace (1 s) and a margin."""
    proc, address = serve
    with Etcd(etcd_cluster.endpoints) as etcd:
        token = TenantStore(etcd, keys).create("team-bomb", Quotas(max_etcd_bytes=1 << 34))
        metadata = _meta(token)
    with grpc.insecure_channel(address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=metadata)
        bomb = _publish_request(session.session_id, shard_count=2**31 - 1)
        stub.Latest(pb.LatestRequest(model="bomb"), metadata=metadata, timeout=10)  # warm
        before = _rss_bytes(proc.pid)
        started = time.monotonic()
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as info:
                stub.Publish(bomb, metadata=metadata, timeout=10)
            assert isinstance(from_rpc_error(info.value), InvalidArgument)
            assert "shard count" in (info.value.details() or "")
        took = time.monotonic() - started
        grown = _rss_bytes(proc.pid) - before
        latest = stub.Latest(pb.LatestRequest(model="bomb"), metadata=metadata, timeout=10)
        assert latest.version == 0  # nothing was written
        assert took < 20, f"20 refusals took {took:.1f}s"
        assert grown < 32 << 20, f"serve grew by {grown >> 20} MB"

    big = _publish_request(session.session_id, tensors=36_000)
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(address, options) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        futures = [stub.Publish.future(big, metadata=metadata, timeout=60) for _ in range(8)]
        with Etcd(etcd_cluster.endpoints) as etcd:
            pages = f"{keys.tenant('team-bomb')}mp/"
            wait_until(
                "a publish is writing its manifest pages",
                lambda: bool(etcd.range(pages, prefix=True, keys_only=True).kvs),
                30,
            )
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        stopped = time.monotonic() - signalled
        for future in futures:
            future.cancel()
    assert code == 0
    assert stopped < 1 + 4, f"serve took {stopped:.1f}s to stop with --grace 1"
