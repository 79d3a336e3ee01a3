"""History: many steps of a simulated trainer and 8 readers, etcd auto-compaction off, the
hub's own compactor (`tensorhub serve --compact-interval S`) bounding etcd's history.

A step is what those clients ask of the hub, with raw RPCs and no bytes moved: Publish of a
one-tensor version, then each reader registers PARTIAL, updates to COMPLETE and releases the
version before. etcd's in-use DB size (Maintenance Status dbSizeInUse) is sampled every
`sample_every` steps; the target is a flat size after the first compaction (within 10 %).
A hub without the compactor flag runs without it, and the figure then shows the growth.
The run stops at `steps` or at `seconds`, whichever comes first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import urllib.error
import urllib.request
from typing import Any

from bench.scale.procs import etcd_key_count
from bench.scale.rpc import Hub, failures, first_error, holder, tiny_manifest
from bench.scale.world import World, serve_flags
from ros.proto.tensorhub.v1 import hub_pb2 as pb

MODEL = "history"
READERS = 8
TTL = 60


def readable(endpoint: str, revision: int) -> bool:
    """Whether etcd still serves reads at `revision` (a compacted one is refused)."""
    body = json.dumps({"key": base64.b64encode(b"\0").decode(), "revision": revision}).encode()
    req = urllib.request.Request(
        f"http://{endpoint}/v3/kv/range",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
        return True
    except urllib.error.HTTPError as exc:
        return "compacted" not in exc.read().decode(errors="replace")


def compacted(endpoint: str) -> bool:
    """Whether etcd has compacted away revision 2."""
    return not readable(endpoint, 2)


def oldest_readable(endpoint: str, current: int) -> int:
    """The oldest revision etcd still serves (binary search, about 17 reads at 100k)."""
    lo, hi = 1, max(1, current)
    while lo < hi:
        mid = (lo + hi) // 2
        if readable(endpoint, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


async def _keepalive(hub: Hub, sessions: list[int], stop: asyncio.Event) -> None:
    """Renew every session each TTL/3 over one KeepAlive stream."""
    call = hub.stub.KeepAlive(metadata=hub.metadata)
    try:
        while not stop.is_set():
            for s in sessions:
                await call.write(pb.KeepAliveRequest(session_id=s))
                await asyncio.wait_for(call.read(), 10)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), TTL / 3)
    finally:
        call.cancel()


async def _step(hub: Hub, v: int, trainer: int, readers: list[int]) -> list[Any]:
    await hub.call(
        "Publish",
        pb.PublishRequest(
            model=MODEL,
            version=v,
            manifest=tiny_manifest(),
            holder=holder("trainer", trainer, complete=True),
        ),
    )

    async def reader(i: int, session: int) -> None:
        name = f"reader-{i}"
        reg = await hub.call(
            "RegisterHolder",
            pb.RegisterHolderRequest(
                model=MODEL, version=v, holder=holder(name, session, complete=False)
            ),
        )
        await hub.call(
            "UpdateHolder",
            pb.UpdateHolderRequest(
                model=MODEL,
                version=v,
                holder=holder(name, session, complete=True, fence=int(reg.fence)),
            ),
        )
        if v > 1:
            await hub.call(
                "ReleaseHolder",
                pb.ReleaseHolderRequest(
                    model=MODEL, version=v - 1, holder=name, session_id=session
                ),
            )

    return list(
        await asyncio.gather(*(reader(i, s) for i, s in enumerate(readers)), return_exceptions=True)
    )


async def _run(world: World, steps: int, seconds: float, sample_every: int) -> dict[str, Any]:
    hub = Hub(world.address, world.token)
    stop = asyncio.Event()
    samples: list[dict[str, Any]] = []
    errors: list[Any] = []
    try:
        trainer = await hub.session(TTL)
        readers = [await hub.session(TTL) for _ in range(READERS)]
        renew = asyncio.create_task(_keepalive(hub, [trainer, *readers], stop))
        t0 = time.monotonic()
        done = 0

        def sample() -> None:
            st = world.status()
            samples.append(
                {
                    "step": done,
                    "t_s": round(time.monotonic() - t0, 1),
                    "db_size_in_use": st["db_size_in_use"],
                    "db_size": st["db_size"],
                    "revision": st["revision"],
                    "compacted": compacted(world.etcd_endpoint),
                    "keys": etcd_key_count(world.etcd_endpoint),
                    # history kept: the compactor keeps one to two intervals of it
                    "retained_revisions": st["revision"]
                    - oldest_readable(world.etcd_endpoint, st["revision"]),
                }
            )

        sample()
        for v in range(1, steps + 1):
            if time.monotonic() - t0 > seconds:
                break
            try:
                errors.extend(r for r in await _step(hub, v, trainer, readers) if r is not None)
            except Exception as exc:  # a failed publish ends the run, reported
                errors.append(exc)
                break
            done = v
            if v % sample_every == 0:
                sample()
            if len(errors) > 100:
                break
        if done % sample_every:
            sample()
        stop.set()
        renew.cancel()
        with contextlib.suppress(BaseException):
            await renew
        return {
            "steps": done,
            "seconds": time.monotonic() - t0,
            "samples": samples,
            "failures": failures(errors),
            "first_error": first_error(errors),
        }
    finally:
        await hub.close()


def flatness(samples: list[dict[str, Any]]) -> float | None:
    """(max - min) / min of the in-use size over the samples after the first compaction."""
    after = [s["db_size_in_use"] for s in samples if s["compacted"]]
    if len(after) < 2:
        return None
    return float(max(after) - min(after)) / float(min(after))


def per_revision_flatness(samples: list[dict[str, Any]]) -> float | None:
    """The same spread of in-use bytes per revision of history kept: the compactor keeps one
    to two intervals of history, so a sample's in-use size depends on when in that cycle it
    was taken; per revision kept, that phase drops out and only growth remains."""
    after: list[float] = [
        s["db_size_in_use"] / s["retained_revisions"]
        for s in samples
        if s["compacted"] and s.get("retained_revisions")
    ]
    if len(after) < 2:
        return None
    return (max(after) - min(after)) / min(after)


def run(
    steps: int = 10_000, seconds: float = 300.0, interval: float = 5.0, sample_every: int = 1000
) -> dict[str, Any]:
    """The history part on its own etcd (no auto-compaction) and hub (with its compactor)."""
    has_flag = "--compact-interval" in serve_flags()
    flags = ["--compact-interval", f"{interval:g}"] if has_flag else []
    with World(flags) as world:
        out = asyncio.run(_run(world, steps, seconds, sample_every))
    out["compactor_flag"] = has_flag
    out["flatness"] = flatness(out["samples"])
    out["per_revision_flatness"] = per_revision_flatness(out["samples"])
    return out
