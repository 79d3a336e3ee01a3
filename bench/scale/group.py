"""The shards part's group cases: a process group's shards of one version in one PublishShards
call (`publish(..., group=PG)`: the ranks gather their requests, one rank sends them all).

Only the hub's side is measured here: the gather runs in the trainer's own process group, and
is measured apart (tests/ros/test_group_publish.py; docs/design-notes.md, "One hub call per
version"). One client streams every shard's PublishRequest, as the group's first rank does:
the requests as the ranks serialized them, `frame` (32) a message
(`ros.client.shard_frames`; 1: a message each, as a hub without `PublishRequest.shards` reads
them):

- group-shards: N shards (4,096) under a few sessions (4);
- group-ranks: N ranks (1,024), each shard under its own session (a rank's own lease), all
  opened before the call.

Each shard carries a manifest of `tensors` (200) tensors, a transformer layer's worth (names
as a Llama layer's, 64 x 64 float32 each), so that 4,096 of them exceed one gRPC message and
one etcd value. The requests are built before the clock starts (in a trainer every rank
builds its own, at once, before the gather). Time until visible: from the call's start to its
answer (every shard committed by then), against a one-shard publish in the same World, and as
shards per second; `hub_cpu_s`, the CPU seconds the hub process used over the call (its
two Latest reads included), which a loaded machine moves far less than the wall time, and
`hub_children_cpu_s`, those of the processes it started (its checking processes,
`ros.hub.manifest_processes`: not the hub's own CPU); `hub_loop_cpu_s`, those of its
busiest thread (its event loop, which reads and checks every shard: with the GIL, the
call's critical path); `client_cpu_s`, the CPU the sending
process used over the call (framing and sending, as the group's first rank does), and
`etcd_cpu_s` and `etcd_write_mb`, etcd's CPU and the bytes it wrote to disk over the call
(`/proc/<pid>/io`): all three processes share the machine's cores, so the wall time is
where their CPU goes.
Checked: every shard committed, exactly the last batch says visible, Latest
0 before and 1 after. `etcd_writes`: the revisions etcd used during the call (the sessions
were opened before).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from bench.scale.procs import descendants_cpu, etcd_pid, thread_cpu
from bench.scale.rpc import Hub, first_error, holder
from bench.scale.world import World
from ros.client.shard_frames import FRAME_SHARDS, frames, publish_shards
from ros.proto.tensorhub.v1 import hub_pb2 as pb

GROUP_SESSIONS = 4  # group-shards: the sessions its shards are spread over
OPEN_AT_ONCE = 64  # OpenSession calls in flight while group-ranks opens its sessions


def layer_manifest(index: int, tensors: int) -> pb.Manifest:
    """Shard `index`'s manifest: `tensors` tensors of 64 x 64 float32 (16 KiB) back to back,
    named as a transformer layer's, in 4 MiB chunks (the checksums are not read: nobody
    fetches these bytes)."""
    nbytes = 64 * 64 * 4
    total = tensors * nbytes
    chunk = 4 << 20
    return pb.Manifest(
        tensors=[
            pb.TensorEntry(
                name=f"model.layers.{index}.block.{t // 8}.proj_{t % 8}.weight",
                dtype="float32",
                shape=[64, 64],
                offset=t * nbytes,
                nbytes=nbytes,
            )
            for t in range(tensors)
        ],
        total_bytes=total,
        chunk_size=chunk,
        chunk_xxh3=list(range(-(-total // chunk))),
    )


def _requests(
    model: str, count: int, sessions: list[int], tensors: int
) -> Iterator[pb.PublishRequest]:
    for i in range(count):
        yield pb.PublishRequest(
            model=model,
            version=1,
            manifest=layer_manifest(i, tensors),
            holder=holder(f"rank-{i:05d}", sessions[i % len(sessions)], complete=True, shard=i),
            shard_index=i,
            shard_count=count,
        )


async def _open(address: str, token: str, count: int) -> list[int]:
    hub = Hub(address, token)
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def one() -> int:
        async with gate:
            return await hub.session(300)

    try:
        return list(await asyncio.gather(*(one() for _ in range(count))))
    finally:
        await hub.close()


async def _call(
    address: str, token: str, model: str, count: int, sessions: list[int], tensors: int,
    timeout: float, frame: int,
) -> tuple[pb.PublishShardsResponse, float, float, int, int]:  # fmt: skip
    """The one PublishShards call: its answer, its seconds, this process's CPU seconds
    over it, Latest before and after."""
    hub = Hub(address, token)
    try:
        before = int((await hub.call("Latest", pb.LatestRequest(model=model))).version)
        requests = [  # each rank's own work: its request, serialized for the gather
            r.SerializeToString() for r in _requests(model, count, sessions, tensors)
        ]
        call = publish_shards(hub.channel)
        t0, cpu0 = time.monotonic(), time.process_time()
        answer = await call(  # the leader's part: frame the bytes gathered, send them
            frames(requests, frame), metadata=hub.metadata, timeout=timeout
        )
        seconds, cpu = time.monotonic() - t0, time.process_time() - cpu0
        after = int((await hub.call("Latest", pb.LatestRequest(model=model))).version)
        return answer, seconds, cpu, before, after
    finally:
        await hub.close()


def group_case(
    world: World, case: str, count: int, tensors: int, timeout: float, frame: int = FRAME_SHARDS
) -> dict[str, Any]:
    """One group call of `count` shards (`case`: group-shards or group-ranks), `frame`
    shards a message."""
    per_rank = case == "group-ranks"
    model = case
    out: dict[str, Any] = {
        "case": case, "shards": count, "tensors": tensors, "replicas": len(world.hubs),
        "frame_shards": frame,
        "sessions": count if per_rank else GROUP_SESSIONS,
        "manifest_bytes": layer_manifest(0, tensors).ByteSize(),
    }  # fmt: skip
    sessions = asyncio.run(_open(world.address, world.token, out["sessions"]))
    rev0 = world.status()["revision"]
    cpu0, etcd0, written0 = world.hub_stats().cpu_s, world.etcd_stats(), written(world)
    threads0 = thread_cpu(world.hub.pid if world.hub is not None else 0)
    children0 = descendants_cpu(world.hub.pid if world.hub is not None else 0)
    try:
        answer, seconds, client_cpu, before, after = asyncio.run(
            _call(world.address, world.token, model, count, sessions, tensors, timeout, frame)
        )
    except grpc.aio.AioRpcError as exc:
        out.update(ok=False, failed=first_error([exc]))
        return out
    out["hub_cpu_s"] = world.hub_stats().cpu_s - cpu0
    out["hub_children_cpu_s"] = (
        descendants_cpu(world.hub.pid if world.hub is not None else 0) - children0
    )
    out["client_cpu_s"] = client_cpu
    out["etcd_cpu_s"] = world.etcd_stats().cpu_s - etcd0.cpu_s
    out["etcd_write_mb"] = (written(world) - written0) / 2**20
    threads = thread_cpu(world.hub.pid if world.hub is not None else 0)
    spent = {tid: used - threads0.get(tid, 0.0) for tid, used in threads.items()}
    out["hub_loop_cpu_s"] = max(spent.values(), default=0.0)
    out["etcd_writes"] = world.status()["revision"] - rev0
    errors = [o for o in answer.outcomes if o.error]
    visible = {o.revision for o in answer.outcomes if o.visible}
    out.update(
        seconds=seconds,
        shards_per_second=count / seconds if seconds > 0 else None,
        published=len(answer.outcomes) - len(errors),
        failures={o.error: sum(1 for e in errors if e.error == o.error) for o in errors},
        first_error=f"{errors[0].error}: {errors[0].message}" if errors else "",
        visible_transactions=len(visible),
        latest_before=before,
        latest_after=after,
    )
    out["ok"] = bool(
        not errors and len(answer.outcomes) == count and len(visible) == 1
        and before == 0 and after == 1
    )  # fmt: skip
    return out


def written(world: World) -> int:
    """The bytes etcd's process has written to storage so far (`write_bytes` of
    /proc/<pid>/io; 0 where the kernel does not say)."""
    try:
        io = Path(f"/proc/{etcd_pid(world.etcd_endpoint)}/io").read_text()
    except OSError:
        return 0
    fields = dict(line.split(":", 1) for line in io.splitlines() if ":" in line)
    return int(fields.get("write_bytes", "0").strip() or 0)


def summary(r: dict[str, Any]) -> str:
    """One human line for a group case."""
    what = (
        f"{r.get('shards')} {'ranks' if r.get('case') == 'group-ranks' else 'shards'} in one "
        f"group call ({r.get('tensors')} tensors, {r.get('manifest_bytes')} B a manifest, "
        f"{r.get('frame_shards')} a message)"
    )
    if "failed" in r:
        return f"  {what} x{r.get('replicas')}: FAILED {r['failed']}"
    ratio = r["seconds"] * 1000 / r["one_shard_ms"] if r.get("one_shard_ms") else None
    return (
        f"  {what} x{r['replicas']}: visible after {r['seconds']:.2f}s "
        f"({'-' if ratio is None else f'{ratio:.0f}'}x one shard, "
        f"{r['shards_per_second']:.0f} shards/s, hub CPU {r.get('hub_cpu_s', 0):.2f}s, its "
        f"loop {r.get('hub_loop_cpu_s', 0):.2f}s, its checking processes "
        f"{r.get('hub_children_cpu_s', 0):.2f}s; client CPU {r.get('client_cpu_s', 0):.2f}s; "
        f"etcd CPU {r.get('etcd_cpu_s', 0):.2f}s, {r.get('etcd_write_mb', 0):.1f} MB written), "
        f"etcd revisions {r.get('etcd_writes')}, "
        f"published {r.get('published')}, Latest {r.get('latest_before')}->"
        f"{r.get('latest_after')}, failures {r.get('failures')}"
        + (f" ({r['first_error']})" if r.get("first_error") else "")
        + f", ok {r.get('ok')}"
    )
