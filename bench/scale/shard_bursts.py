"""The shards part's burst cases: N ranks at one barrier, a channel and a session each
(`ranks_case`), and N shards with K in flight then the last one alone (`inflight_case`),
driven through the rank worker processes (`bench.scale.shard_ranks`), with what each checks:
one transaction said visible, no shard committed after it, Latest 0 before and 1 after. And
the in-flight burst against do-nothing gRPC servers (`ceiling_inflight`): what Python's gRPC
alone costs on the machine.

Apart from the part's loop and report line (`bench.scale.shards`) and the sequential case
(`bench.scale.shard_sequential`): the cases that send from many processes at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from bench.scale.clients import Fleet, WorkerLost
from bench.scale.procs import ServerStartError, ceiling_server
from bench.scale.rpc import Hub, first_error
from bench.scale.shard_ranks import SESSION_TTL, shard_request
from bench.scale.world import World
from ros.proto.tensorhub.v1 import hub_pb2 as pb

BARRIER_SECONDS = 1.0


async def _latest(address: str, token: str, model: str) -> tuple[int, int]:
    hub = Hub(address, token)
    try:
        reply = await hub.call("Latest", pb.LatestRequest(model=model))
        return int(reply.version), int(reply.revision)
    finally:
        await hub.close()


async def _session(address: str, token: str) -> int:
    hub = Hub(address, token)
    try:
        return await hub.session(SESSION_TTL)
    finally:
        await hub.close()


async def _last_shard(
    address: str, token: str, model: str, index: int, count: int, session: int, timeout: float
) -> tuple[pb.PublishResponse | None, str, float]:
    """The last shard alone, under `session`: (reply or None, error, reply time)."""
    hub = Hub(address, token)
    try:
        try:
            reply = await hub.call("Publish", shard_request(model, index, count, session), timeout)
            return reply, "", time.monotonic()
        except Exception as exc:  # the figure says it failed, and why
            return None, first_error([exc]), time.monotonic()
    finally:
        await hub.close()


def _merge(replies: list[dict[str, Any]]) -> dict[str, Any]:
    failures: Counter[str] = Counter()
    for r in replies:
        failures.update(r.get("failures", {}))
        if "failed" in r:
            failures[f"worker: {r['failed']}"] += 1
    return {
        "published": sum(int(r.get("published", 0)) for r in replies),
        "failures": dict(failures),
        "first_error": next((r["first_error"] for r in replies if r.get("first_error")), ""),
        "visible": sorted(v for r in replies for v in r.get("visible", [])),
        "max_revision": max((int(r.get("max_revision", 0)) for r in replies), default=0),
    }


def _split(indices: list[int], parts: int) -> list[list[int]]:
    return [indices[w::parts] for w in range(parts)]


def ranks_case(world: World, fleet: Fleet, ranks: int, timeout: float) -> dict[str, Any]:
    """N ranks, a channel and a session each, at one barrier; see the module docstring."""
    model = "ranks"
    workers = fleet.workers
    out: dict[str, Any] = {"case": "ranks", "shards": ranks, "replicas": len(world.hubs)}
    prepared = fleet.call(
        "prepare",
        [{"targets": world.addresses, "token": world.token, "indices": part, "count": ranks,
          "model": model, "per_rank": True} for part in _split(list(range(ranks)), len(workers))],
        300.0,
    )  # fmt: skip
    out["sessions"] = sum(int(p.get("ready", 0)) for p in prepared)
    out["latest_before"], _ = asyncio.run(_latest(world.address, world.token, model))
    rev0 = world.status()["revision"]
    start_at = time.monotonic() + BARRIER_SECONDS
    replies = fleet.call(
        "go", [{"start_at": start_at, "inflight": None, "timeout": timeout}] * len(workers),
        BARRIER_SECONDS + timeout + 60,
    )  # fmt: skip
    out["etcd_writes"] = world.status()["revision"] - rev0
    out["latest_after"], latest_revision = asyncio.run(_latest(world.address, world.token, model))
    fleet.call("close", [{}] * len(workers), 60.0)
    merged = _merge(replies)
    out.update(merged)
    visible = merged["visible"]
    out["visible_replies"] = len(visible)
    if visible:  # the first reply that says visible: when the version became visible
        revision = min(v[1] for v in visible)
        out["seconds"] = min(v[2] for v in visible) - start_at
        out["visible_revision"] = revision
        # one transaction (a group commit) may carry several shards: did every reply that
        # said visible come from the one that moved Latest?
        out["visible_transactions"] = len({v[1] for v in visible})
        out["ordered"] = merged["max_revision"] <= revision <= latest_revision
    else:
        out["seconds"], out["ordered"] = None, False
    out["ok"] = bool(
        out["ordered"]
        and out["visible_transactions"] == 1
        and out["sessions"] == ranks
        and merged["published"] == ranks
        and not merged["failures"]
        and out["latest_before"] == 0
        and out["latest_after"] == 1
    )
    return out


def inflight_case(
    world: World, fleet: Fleet, count: int, inflight: int, timeout: float
) -> dict[str, Any]:
    """N-1 shards with `inflight` in flight, then the last alone; see the module docstring."""
    model = "shards"
    workers = fleet.workers
    out: dict[str, Any] = {
        "case": "inflight", "shards": count, "inflight": inflight, "replicas": len(world.hubs),
    }  # fmt: skip
    fleet.call(
        "prepare",
        [{"targets": world.addresses, "token": world.token, "indices": part, "count": count,
          "model": model, "per_rank": False}
         for part in _split(list(range(count - 1)), len(workers))],
        300.0,
    )  # fmt: skip
    out["latest_at_start"], _ = asyncio.run(_latest(world.address, world.token, model))
    last_address = world.addresses[(count - 1) % len(world.addresses)]
    last_session = asyncio.run(_session(last_address, world.token))  # before rev0
    each = max(1, inflight // len(workers))
    rev0 = world.status()["revision"]
    start_at = time.monotonic() + BARRIER_SECONDS
    replies = fleet.call(
        "go", [{"start_at": start_at, "inflight": each, "timeout": timeout}] * len(workers),
        BARRIER_SECONDS + timeout * count / max(1, inflight) + 120,
    )  # fmt: skip
    merged = _merge(replies)
    out["latest_before"], _ = asyncio.run(_latest(world.address, world.token, model))
    reply, error, at = asyncio.run(
        _last_shard(last_address, world.token, model, count - 1, count, last_session, timeout)
    )
    out["etcd_writes"] = world.status()["revision"] - rev0
    out["latest_after"], latest_revision = asyncio.run(_latest(world.address, world.token, model))
    fleet.call("close", [{}] * len(workers), 60.0)
    out.update(merged)
    out["visible_before_last"] = len(merged["visible"])
    out["last_visible"] = bool(reply is not None and reply.visible)
    out["visible_replies"] = len(merged["visible"]) + int(out["last_visible"])
    if error:
        out["last_error"] = error
    out["seconds"] = at - start_at if out["last_visible"] else None
    revision = int(reply.revision) if reply is not None else 0
    out["ordered"] = out["last_visible"] and merged["max_revision"] <= revision <= latest_revision
    out["published"] = merged["published"] + (1 if reply is not None else 0)
    out["ok"] = bool(
        out["ordered"]
        and out["visible_before_last"] == 0
        and out["published"] == count
        and not merged["failures"]
        and out["latest_at_start"] == 0
        and out["latest_before"] == 0
        and out["latest_after"] == 1
    )
    return out


def ceiling_inflight(
    fleet: Fleet, count: int, inflight: int, replicas: int, timeout: float
) -> float | None:
    """The in-flight burst's N publishes, from the same worker processes, against
    `replicas` do-nothing grpc.aio servers (`bench.scale.ceiling`): the seconds until the
    last reply, what Python's gRPC alone costs on this machine (None if it could not run)."""
    servers = [ceiling_server() for _ in range(replicas)]
    try:
        for server in servers:
            server.start()
        workers = fleet.workers
        fleet.call(
            "prepare",
            [{"targets": [s.address for s in servers], "token": "ceiling.none", "indices": part,
              "count": count, "model": "shards", "per_rank": False}
             for part in _split(list(range(count)), len(workers))],
            300.0,
        )  # fmt: skip
        start_at = time.monotonic() + BARRIER_SECONDS
        replies = fleet.call(
            "go",
            [{"start_at": start_at, "inflight": max(1, inflight // len(workers)),
              "timeout": timeout}] * len(workers),
            BARRIER_SECONDS + timeout * count / max(1, inflight) + 120,
        )  # fmt: skip
        fleet.call("close", [{}] * len(workers), 60.0)
        if any(r.get("failures") for r in replies):
            return None
        return max(float(r["last_reply_at"]) for r in replies) - start_at
    except (ServerStartError, WorkerLost):
        return None
    finally:
        for server in servers:
            server.stop()
