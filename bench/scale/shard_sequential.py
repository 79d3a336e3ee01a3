"""The shards part's sequential case: N shards of one version from one client, one after
another (each sent when the one before it has replied), as a pipeline-parallel trainer's
stages arrive apart, with a one-shard version published alone every `SINGLE_EVERY` shards
so that the baseline shares the run's load (the figures and checks: `bench.scale.shards`).

Apart from the barrier and in-flight cases: no worker processes, one client's channels to
each replica, and latency figures per shard rather than a time until visible.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import grpc

from bench.scale.rpc import Hub, first_error, holder, tiny_manifest
from bench.scale.shard_ranks import SESSION_TTL, shard_request
from bench.scale.world import World
from ros.proto.tensorhub.v1 import hub_pb2 as pb

SEQUENTIAL_SESSIONS = 4
SINGLE_EVERY = 32  # sequential shards between two one-shard versions published alone


async def _sessions(addresses: list[str], token: str, count: int) -> list[int]:
    """`count` sessions, session j opened on replica j mod R."""
    hubs = [Hub(a, token) for a in addresses]
    try:
        return [await hubs[j % len(hubs)].session(SESSION_TTL) for j in range(count)]
    finally:
        for hub in hubs:
            await hub.close()


async def _sequential(
    addresses: list[str], token: str, count: int, opened: list[int], timeout: float
) -> dict[str, Any]:
    """The sequential case's publishes (one client, raw gRPC): shard i to replica i mod R
    under session i mod S, one after another, and the interleaved one-shard versions of
    model `sequential-single` (versions 1, 2, ...) on the first replica."""
    sessions = len(opened)
    hubs = [Hub(a, token) for a in addresses]
    try:
        shard_ms: list[float] = []
        single_ms: list[float] = []
        last: pb.PublishResponse | None = None
        visible_early = 0
        latest_before = 0
        revisions: set[int] = set()  # the transactions that committed the version's shards
        for i in range(count):
            if i == count - 1:
                latest_before = int(
                    (await hubs[0].call("Latest", pb.LatestRequest(model="sequential"))).version
                )
            request = shard_request("sequential", i, count, opened[i % sessions])
            t0 = time.monotonic()
            reply = await hubs[i % len(hubs)].call("Publish", request, timeout)
            shard_ms.append((time.monotonic() - t0) * 1000)
            revisions.add(int(reply.revision))
            if i == count - 1:
                last = reply
            elif reply.visible:
                visible_early += 1
            if i % SINGLE_EVERY == SINGLE_EVERY - 1:
                single = pb.PublishRequest(
                    model="sequential-single", version=len(single_ms) + 1,
                    manifest=tiny_manifest(), holder=holder("single", opened[0], complete=True),
                )  # fmt: skip
                t0 = time.monotonic()
                await hubs[0].call("Publish", single, timeout)
                single_ms.append((time.monotonic() - t0) * 1000)
        latest_after = int(
            (await hubs[0].call("Latest", pb.LatestRequest(model="sequential"))).version
        )
        return {
            "shard_ms": shard_ms, "single_ms": single_ms, "visible_early": visible_early,
            "last_visible": bool(last is not None and last.visible),
            "latest_before": latest_before, "latest_after": latest_after,
            "transactions": len(revisions),
        }  # fmt: skip
    finally:
        for hub in hubs:
            await hub.close()


def sequential_case(world: World, count: int, sessions: int, timeout: float) -> dict[str, Any]:
    """N shards one after another from one client; see the module docstring."""
    out: dict[str, Any] = {
        "case": "sequential", "shards": count, "sessions": sessions, "replicas": len(world.hubs),
    }  # fmt: skip
    opened = asyncio.run(_sessions(world.addresses, world.token, sessions))
    rev0 = world.status()["revision"]
    t0 = time.monotonic()
    try:
        got = asyncio.run(_sequential(world.addresses, world.token, count, opened, timeout))
    except grpc.aio.AioRpcError as exc:
        out.update(ok=False, failed=first_error([exc]))
        return out
    out["seconds"] = time.monotonic() - t0
    # every revision of the run (the one-shard versions and their retention's included)
    out["etcd_writes"] = world.status()["revision"] - rev0
    shard_ms = sorted(got.pop("shard_ms"))
    single_ms = got.pop("single_ms")
    out.update(got)
    out["shard_ms_median"] = statistics.median(shard_ms)
    out["shard_ms_mean"] = statistics.fmean(shard_ms)
    out["shard_ms_p95"] = shard_ms[min(len(shard_ms) - 1, int(0.95 * len(shard_ms)))]
    out["single_ms_median"] = statistics.median(single_ms) if single_ms else None
    out["published"] = count
    out["failures"] = {}
    out["ok"] = bool(
        out["last_visible"]
        and out["visible_early"] == 0
        and out["latest_before"] == 0
        and out["latest_after"] == 1
    )
    return out
