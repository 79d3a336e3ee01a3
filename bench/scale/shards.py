"""Shards: one version of 4,096 model-parallel shards against etcd's default --max-txn-ops.

Every shard is one PublishRequest (shard_index/shard_count) of its own rank's holder, under a
few sessions. All but the last are sent with bounded concurrency; the last goes alone, so
"the last shard's publish reports visible and Latest moves" is a crisp pass condition:
Latest must not move before it and must move with it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from bench.scale.rpc import Hub, bounded, failures, first_error, holder, tiny_manifest
from bench.scale.world import World
from ros.proto.tensorhub.v1 import hub_pb2 as pb

MODEL = "shards"
SESSIONS = 4
CONCURRENCY = 32


def _request(i: int, count: int, session: int) -> pb.PublishRequest:
    return pb.PublishRequest(
        model=MODEL,
        version=1,
        manifest=tiny_manifest(),
        holder=holder(f"rank-{i:05d}", session, complete=True, shard=i),
        shard_index=i,
        shard_count=count,
    )


async def _run(world: World, count: int) -> dict[str, Any]:
    hub = Hub(world.address, world.token)
    try:
        sessions = [await hub.session() for _ in range(SESSIONS)]
        rev0 = world.status()["revision"]
        t0 = time.monotonic()
        results = await bounded(
            [
                functools.partial(hub.call, "Publish", _request(i, count, sessions[i % SESSIONS]))
                for i in range(count - 1)
            ],
            CONCURRENCY,
        )
        early_visible = sum(1 for r in results if isinstance(r, pb.PublishResponse) and r.visible)
        before = await hub.call("Latest", pb.LatestRequest(model=MODEL))
        out: dict[str, Any] = {
            "shards": count,
            "failures": failures(results),
            "first_error": first_error(results),
            "visible_before_last": early_visible,
            "latest_before_last": int(before.version),
        }
        try:
            last = await hub.call("Publish", _request(count - 1, count, sessions[0]))
            out["last_visible"] = bool(last.visible)
        except Exception as exc:  # the figure says it failed, and why
            out["last_visible"] = False
            out["last_error"] = first_error([exc])
        out["seconds"] = time.monotonic() - t0
        after = await hub.call("Latest", pb.LatestRequest(model=MODEL))
        out["latest_after"] = int(after.version)
        out["etcd_writes"] = world.status()["revision"] - rev0
        out["ok"] = (
            out["last_visible"]
            and out["latest_before_last"] == 0
            and out["latest_after"] == 1
            and not out["failures"]
        )
        return out
    finally:
        await hub.close()


def run(count: int = 4096) -> dict[str, Any]:
    """The shards part on its own etcd and hub (default limits)."""
    with World() as world:
        return asyncio.run(_run(world, count))
