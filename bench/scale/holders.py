"""Holders of one version: Resolve at 16 and at 1,024 holders, and one simulated step of
1,024 readers (what each reader asks of the hub, without moving bytes).

Holders are registered through the hub's RegisterHolder under a few sessions. The Resolve
caller is itself the newest PARTIAL holder and sends its topology, fence and name (the
fields a pipelining reader sends), so the hub answers with its bounded candidate set. The
step is the SDK's fetch path (`ros.client`) call by call: Resolve,
RegisterHolder PARTIAL (its record pins the version; its answer carries the candidates, and
only a hub that sends none gets a second Resolve), UpdateHolder COMPLETE; each reader then
releases the version it held before. etcd writes per step are the etcd revision's delta.
"""

from __future__ import annotations

import asyncio
import functools
import time
import zlib
from typing import Any

from bench.scale.load import percentile
from bench.scale.rpc import (
    Hub,
    bounded,
    failures,
    first_error,
    holder,
    resolve_request,
    timed,
    tiny_manifest,
)
from bench.scale.world import World
from ros.proto.tensorhub.v1 import hub_pb2 as pb

MODEL = "holders"
SESSIONS = 8
CONCURRENCY = 64
SAMPLES = 100


def _topology(i: int) -> dict[str, str]:
    return {"dc": f"dc{i % 2}", "rack": f"r{i % 16}", "host": f"h{i % 128}"}


def _owner(name: str, sessions: list[int]) -> int:
    """The session a holder name registers under, the same at every step (a release must
    name the session that owns the record)."""
    return sessions[zlib.crc32(name.encode()) % len(sessions)]


async def _register(
    hub: Hub, names: list[str], sessions: list[int], version: int, complete: bool
) -> list[Any]:
    calls = [
        lambda i=i, n=n: hub.call(
            "RegisterHolder",
            pb.RegisterHolderRequest(
                model=MODEL,
                version=version,
                holder=holder(n, _owner(n, sessions), complete=complete, topology=_topology(i)),
            ),
        )
        for i, n in enumerate(names)
    ]
    return await bounded(calls, CONCURRENCY)


async def _resolve_latency(hub: Hub, session: int, caller: str) -> dict[str, Any]:
    """Register `caller` as the newest PARTIAL holder, then time Resolve as it would call it."""
    me = _topology(7)
    reg = await hub.call(
        "RegisterHolder",
        pb.RegisterHolderRequest(
            model=MODEL, version=1, holder=holder(caller, session, complete=False, topology=me)
        ),
    )
    request = resolve_request(
        model=MODEL, version=1, topology=me, fence=int(reg.fence), holder=caller, omit_manifest=True
    )
    last: list[Any] = []

    async def one() -> None:
        last[:] = [await hub.call("Resolve", request)]

    await timed(one, 5)  # warm-up
    ms = await timed(one, SAMPLES)
    await hub.call(
        "ReleaseHolder",
        pb.ReleaseHolderRequest(
            model=MODEL, version=1, holder=caller, force=True, session_id=session
        ),
    )
    reply = last[0]
    return {
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "candidates": len(reply.holders),
        "total_holders": int(getattr(reply, "total_holders", 0)) or len(reply.holders),
        "reply_bytes": reply.ByteSize(),
    }


async def _step(hub: Hub, sessions: list[int], readers: list[str]) -> dict[str, Any]:
    """Every reader fetches version 2 (hub calls only) and releases version 1."""
    counts: dict[str, int] = {}

    async def reader(i: int, name: str) -> None:
        session, me = _owner(name, sessions), _topology(i)
        calls = 0
        await hub.call("Resolve", resolve_request(model=MODEL, version=2, topology=me, holder=name))
        reg = await hub.call(
            "RegisterHolder",
            pb.RegisterHolderRequest(
                model=MODEL, version=2, holder=holder(name, session, complete=False, topology=me)
            ),
        )
        calls += 2
        if not len(getattr(reg, "candidates", ())):
            await hub.call(
                "Resolve",
                resolve_request(
                    model=MODEL,
                    version=2,
                    topology=me,
                    fence=int(reg.fence),
                    holder=name,
                    omit_manifest=True,
                ),
            )
            calls += 1
        await hub.call(
            "UpdateHolder",
            pb.UpdateHolderRequest(
                model=MODEL,
                version=2,
                holder=holder(name, session, complete=True, fence=int(reg.fence), topology=me),
            ),
        )
        await hub.call(
            "ReleaseHolder",
            pb.ReleaseHolderRequest(model=MODEL, version=1, holder=name, session_id=session),
        )
        counts[name] = calls + 2

    results = await bounded(
        [functools.partial(reader, i, n) for i, n in enumerate(readers)], CONCURRENCY
    )
    return {
        "failures": failures(results),
        "first_error": first_error(results),
        "rpcs": sum(counts.values()),
    }


async def _run(world: World, small: int, large: int) -> dict[str, Any]:
    hub = Hub(world.address, world.token)
    try:
        sessions = [await hub.session() for _ in range(SESSIONS)]
        await hub.call(
            "Publish",
            pb.PublishRequest(
                model=MODEL,
                version=1,
                manifest=tiny_manifest(),
                holder=holder("publisher", sessions[0], complete=True),
            ),
        )
        names = [f"h{i:05d}" for i in range(large)]
        out: dict[str, Any] = {}
        done = await _register(hub, names[: small - 2], sessions, 1, True)
        out["small"] = await _resolve_latency(hub, sessions[0], "caller")
        done += await _register(hub, names[small - 2 : large - 2], sessions, 1, True)
        out["large"] = await _resolve_latency(hub, sessions[0], "caller")
        out["register_failures"] = failures(done)
        out["register_first_error"] = first_error(done)
        # the step: `large` readers, each holding v1, fetch v2 and release v1
        await hub.call(
            "Publish",
            pb.PublishRequest(
                model=MODEL,
                version=2,
                manifest=tiny_manifest(),
                holder=holder("publisher", sessions[0], complete=True),
            ),
        )
        extras = ["extra-a", "extra-b"]  # with the publisher's and caller's slots: `large`
        await _register(hub, extras, sessions, 1, True)
        readers = names[: large - 2] + extras
        rev0, cpu0, ecpu0 = world.status()["revision"], world.hub_stats(), world.etcd_stats()
        t0 = time.monotonic()
        step = await _step(hub, sessions, readers)
        step["seconds"] = time.monotonic() - t0
        rev1, cpu1, ecpu1 = world.status()["revision"], world.hub_stats(), world.etcd_stats()
        step.update(
            readers=len(readers),
            etcd_writes=rev1 - rev0,
            hub_cpu_s=cpu1.cpu_s - cpu0.cpu_s,
            etcd_cpu_s=ecpu1.cpu_s - ecpu0.cpu_s,
        )
        out["step"] = step
        return out
    finally:
        await hub.close()


def run(small: int = 16, large: int = 1024) -> dict[str, Any]:
    """The holders part on its own etcd and hub (see the module docstring)."""
    with World() as world:
        return asyncio.run(_run(world, small, large))
