"""Made-up tokens cost the hub a bounded number of etcd reads (issue 12, item 1).

Checking a token means reading its tenant's record. Before, every call with a token the
replica had not cached read etcd in the worker pool, so a client without any token could
keep the 16 workers busy with made-up ones (`nobody.x`, `team-a.wrong`, a new name each
time), and legitimate calls queued behind them. Now a fresh record answers a wrong secret
from memory, a name found missing is refused from memory for a second, and names never seen
are read by at most `MAX_UNKNOWN_LOOKUPS` callers at once (the rest are `Overloaded`).

Real hub, real etcd, raw `grpc.aio` calls on loopback; the count of reads is the hub's own
metric.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

import ros
from consistency import Etcd, EtcdCluster, Keys
from ros.errors import ERROR_METADATA_KEY
from ros.hub.server import HubServer
from ros.hub.tenants import MAX_UNKNOWN_LOOKUPS, Tenant, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.helpers import make_model

CALLS = 300
FLOOD = 1000


def _reads() -> float:
    value = REGISTRY.get_sample_value("tensorhub_hub_tenant_record_reads_total")
    return value or 0.0


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _codes(address: str, tokens: list[str]) -> list[tuple[grpc.StatusCode, str]]:
    """Send one Latest per token, all at once; the status and error class of each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]

        async def one(token: str) -> tuple[grpc.StatusCode, str]:
            try:
                request = pb.LatestRequest(model="policy")
                await stub.Latest(request, metadata=_meta(token), timeout=20)
            except grpc.aio.AioRpcError as exc:
                names = [m[1] for m in exc.trailing_metadata() or () if m[0] == ERROR_METADATA_KEY]
                return exc.code(), str(names[0]) if names else ""
            return grpc.StatusCode.OK, ""

        return await asyncio.gather(*(one(t) for t in tokens))


@pytest.mark.timeout(120)
def test_wrong_secrets_and_missing_names_are_refused_from_memory(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    token = make_tenant("team-a")
    client = ros.connect(hub_server.address, tenant="team-a", token=token)
    try:
        client.publish("policy", 1, make_model(1))
        # A wrong secret for a tenant whose record the replica holds: no read at all.
        before = _reads()
        wrong = [f"team-a.{secrets.token_urlsafe(32)}" for _ in range(CALLS)]
        outcomes = asyncio.run(_codes(hub_server.address, wrong))
        assert {code for code, _ in outcomes} == {grpc.StatusCode.PERMISSION_DENIED}
        assert _reads() - before <= 1  # the record may have gone stale once meanwhile

        # The same made-up name over and over: one read per second at most.
        before, started = _reads(), time.monotonic()
        ghost = [f"ghost.{secrets.token_urlsafe(32)}" for _ in range(CALLS)]
        outcomes = asyncio.run(_codes(hub_server.address, ghost))
        elapsed = time.monotonic() - started
        assert {code for code, _ in outcomes} <= {
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        }
        assert _reads() - before <= 2 + elapsed, (_reads() - before, elapsed)
        assert client.latest("policy") == 1
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_flood_of_made_up_names_leaves_known_tenants_served(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    token = make_tenant("team-a")
    client = ros.connect(hub_server.address, tenant="team-a", token=token)
    try:
        client.publish("policy", 1, make_model(1))
        made_up = [f"n{secrets.token_hex(8)}.{secrets.token_urlsafe(32)}" for _ in range(FLOOD)]
        # The known tenant's calls go in the same burst, interleaved with the flood.
        tokens = [t for pair in zip(made_up, [token] * FLOOD, strict=True) for t in pair][
            : FLOOD + FLOOD // 10
        ]
        outcomes = asyncio.run(_codes(hub_server.address, tokens))
        mine = [o for t, o in zip(tokens, outcomes, strict=True) if t == token]
        theirs = [o for t, o in zip(tokens, outcomes, strict=True) if t != token]
        assert mine
        failed = [o for o in mine if o[0] != grpc.StatusCode.OK]
        assert not failed, (len(failed), len(mine), failed[:5])
        # Every made-up token is refused: unknown, or Overloaded while the bound was full.
        assert {code for code, _ in theirs} <= {
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        }
        assert {name for code, name in theirs if code == grpc.StatusCode.RESOURCE_EXHAUSTED} <= {
            "Overloaded"
        }
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_tenant_whose_record_was_dropped_is_not_refused_with_the_made_up_names() -> None:
    """A tenant's record leaves the cache whenever the watch of the tenant records sees it
    change, even its own creation seen after the first read (`forget`), or has a gap. Before,
    the tenant then counted as a name never seen, so while made-up names held every place
    for those, its calls were `Overloaded`: this failed CI once, two of 550 calls refused.
    Here etcd is frozen (SIGSTOP) while made-up names hold the places; the known tenant's
    read waits for etcd like any read instead of being refused."""
    with EtcdCluster(size=1) as cluster, Etcd(cluster.endpoints, timeout=5.0) as etcd:
        store = TenantStore(etcd, Keys(f"/dropped/{os.getpid()}"))
        token = store.create("team-a")
        assert store.authenticate(token).name == "team-a"
        store.forget("team-a")  # what the watch does when it sees the record change
        process = cluster.members[0].process
        assert process is not None
        results: dict[str, Tenant | BaseException] = {}

        def auth(label: str, token: str) -> None:
            try:
                results[label] = store.authenticate(token)
            except BaseException as exc:  # the test reads what was raised
                results[label] = exc

        before = _reads()
        os.kill(process.pid, signal.SIGSTOP)
        try:
            ghosts = [
                threading.Thread(
                    target=auth, args=(f"ghost{i}", f"ghost{i}.{secrets.token_urlsafe(32)}")
                )
                for i in range(MAX_UNKNOWN_LOOKUPS)
            ]
            for thread in ghosts:
                thread.start()
            deadline = time.monotonic() + 10
            while _reads() - before < MAX_UNKNOWN_LOOKUPS and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _reads() - before == MAX_UNKNOWN_LOOKUPS  # every place taken, reads stuck
            mine = threading.Thread(target=auth, args=("mine", token))
            mine.start()
            mine.join(0.5)
            assert "mine" not in results, results.get("mine")  # waiting on etcd, not refused
        finally:
            os.kill(process.pid, signal.SIGCONT)
        for thread in [*ghosts, mine]:
            thread.join(20)
        assert isinstance(results["mine"], Tenant), results["mine"]
        assert results["mine"].name == "team-a"
