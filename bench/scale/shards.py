"""Shards: realistic bursts of one model-parallel version, at etcd's stated limits.

Two cases, each on one hub replica and on two (shard or rank i talks to replica i mod R),
each against a one-shard publish measured in the same World (an unsharded version of a
one-tensor manifest: the median of a few):

- ranks: N ranks (1,024), each a trainer rank as it really is: its own channel and its own
  session (OpenSession), all waiting at one barrier (CLOCK_MONOTONIC, shared by the worker
  processes), then every rank's shard Publish at once, no pacing. Time until visible: from
  the barrier to the first reply that says the version is visible. Checked: every reply that
  says visible comes from one transaction (a group commit answers visible to each shard of
  the batch that completed the version), every other shard committed at or before its
  revision (so `latest` did not move before the last shard), Latest is 0 before and 1
  after, no shard refused.
- inflight: N shards (4,096) with K (256) in flight under a few sessions. The first N-1
  go as a burst; then Latest must still be 0 and no reply may have said visible; then the
  last shard goes alone and must report visible, with Latest 1 after it. Time until visible:
  from the start of the burst to the last shard's reply.

- sequential: N shards (4,096) from one client, one after another (each sent when the one
  before it has replied), under a few sessions (4), as a pipeline-parallel trainer's stages
  arrive apart. Every 32nd shard is followed by a one-shard (unsharded) version published
  alone, so the baseline shares the run's load and noise. Figures: each shard's Publish
  latency (median, mean, p95) against those one-shard versions' median (target: each shard
  at most 1.5x), the transactions that committed its shards (one each: nothing batches one
  shard at a time), the last shard's reply visible, Latest 0 before it and 1 after.

- group-shards and group-ranks: the shards of one version in one PublishShards call, each
  with a 200-tensor manifest (`bench.scale.group`).

All report `etcd_writes`: the revisions etcd used between the barrier and the last reply
(every session was opened before). Every shard is a raw PublishRequest (shard_index,
shard_count) of a tiny inline manifest and its rank's holder record; the ranks are spread
over `Fleet` worker processes so no one client process serializes them.

This module runs the cases at each replica count and writes their summary lines. The cases
are in `bench.scale.shard_bursts` (ranks, inflight), `bench.scale.shard_sequential` and
`bench.scale.group`; the worker processes in `bench.scale.shard_ranks`; the report's rows
in `bench.scale.shard_rows`.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.scale import group
from bench.scale.clients import Fleet, WorkerLost
from bench.scale.rpc import Hub, holder, tiny_manifest
from bench.scale.shard_bursts import ceiling_inflight, inflight_case, ranks_case
from bench.scale.shard_ranks import rank_worker
from bench.scale.shard_sequential import SEQUENTIAL_SESSIONS, sequential_case
from bench.scale.world import EtcdLimits, World
from ros.client.shard_frames import FRAME_SHARDS
from ros.proto.tensorhub.v1 import hub_pb2 as pb

Log = Callable[[str], None]
# The etcd operations one shard's publish writes, counted from consistency/versions.py
# publish_shard (through consistency/publishing.py publish_staged) for a tiny inline manifest
# (no manifest pages): the shard record, the rank's holder record and the put of the
# version's `arrived` counter. The last shard's nested transaction (latest, the version's
# header) is once per version, as is the model's admission on its first publish; the tenant
# budget's charge (ros/hub/budget.py) is one put per transaction, however many shards it
# carries. Those are what the "+ 10" of the revisions target leaves room for.
OPS_PER_SHARD = 3
REVISION_SLACK = 10
SINGLE_MODEL = "single"
CASES = ("ranks", "inflight", "sequential", "group-shards", "group-ranks")
SEQUENTIAL_TARGET = 1.5  # a sequential shard's publish, at most this many one-shard versions


def revision_target(shards: int, limits: EtcdLimits) -> int:
    """The most revisions a version of `shards` shards should take: its operations packed
    into transactions of `--max-txn-ops`, plus `REVISION_SLACK`."""
    return math.ceil(shards * OPS_PER_SHARD / limits.max_txn_ops) + REVISION_SLACK


async def _one_shard(address: str, token: str, times: int) -> list[float]:
    """`times` unsharded publishes (versions 1..times of `SINGLE_MODEL`), one at a time:
    each one's latency in ms (a failure raises: the part has no baseline then)."""
    hub = Hub(address, token)
    try:
        session = await hub.session()
        out = []
        for v in range(1, times + 1):
            request = pb.PublishRequest(
                model=SINGLE_MODEL,
                version=v,
                manifest=tiny_manifest(),
                holder=holder("single", session, complete=True),
            )
            t0 = time.monotonic()
            await hub.call("Publish", request)
            out.append((time.monotonic() - t0) * 1000)
        return out
    finally:
        await hub.close()


def run(
    shards: int = 4096,
    ranks: int = 1024,
    inflight: int = 256,
    replicas: tuple[int, ...] = (1, 2),
    *,
    sequential: int = 4096,
    group_tensors: int = 200,
    group_frame: int = FRAME_SHARDS,
    cases: tuple[str, ...] = CASES,
    workers: int = 4,
    singles: int = 5,
    timeout: float = 600.0,
    tree: str | None = None,
    limits: EtcdLimits | None = None,
    log: Log = lambda _: None,
) -> dict[str, Any]:
    """The `cases` (of `CASES`) at each replica count, each World its own etcd and hubs; a
    case that breaks is reported with why, and the others still run."""
    limits = limits or EtcdLimits()
    out: dict[str, Any] = {
        "limits": {"max_txn_ops": limits.max_txn_ops,
                   "max_request_bytes": limits.max_request_bytes},
        "ops_per_shard": OPS_PER_SHARD,
        "revision_target": revision_target(shards, limits),
        "revision_target_of": {str(n): revision_target(n, limits) for n in (shards, ranks)},
        "sequential_target": SEQUENTIAL_TARGET,
        "cases": [],
    }  # fmt: skip
    log(f"  etcd at {limits.describe()}; one shard writes {OPS_PER_SHARD} operations")
    fleet = Fleet(workers, target=rank_worker, prober=False)
    try:
        for r in replicas:
            sessions = ranks * (2 if "group-ranks" in cases else 1) + 128
            with World(max_sessions=sessions, replicas=r, tree=tree, limits=limits) as world:
                single = asyncio.run(_one_shard(world.address, world.token, singles))
                base = statistics.median(single)
                out.setdefault("one_shard_ms", {})[str(r)] = base
                log(f"  x{r}: one shard (unsharded) publish: median {base:.1f} ms of "
                    f"{', '.join(f'{x:.1f}' for x in single)}")  # fmt: skip
                for name in cases:
                    t0 = time.monotonic()
                    try:
                        if name == "ranks":
                            res = ranks_case(world, fleet, ranks, timeout)
                        elif name == "inflight":
                            res = inflight_case(world, fleet, shards, inflight, timeout)
                        elif name == "sequential":
                            res = sequential_case(world, sequential, SEQUENTIAL_SESSIONS, timeout)
                        else:
                            n = ranks if name == "group-ranks" else shards
                            res = group.group_case(
                                world, name, n, group_tensors, timeout, group_frame
                            )
                    except WorkerLost as exc:
                        res = {"case": name, "replicas": r, "failed": str(exc), "ok": False}
                        fleet.close()
                        fleet = Fleet(workers, target=rank_worker, prober=False)
                    except Exception as exc:  # reported; the next case still runs
                        res = {"case": name, "replicas": r, "ok": False,
                               "failed": f"{type(exc).__name__}: {exc}"[:300]}  # fmt: skip
                    res["one_shard_ms"] = base
                    res["wall_s"] = time.monotonic() - t0
                    log(summary(res))
                    out["cases"].append(res)
            if "inflight" not in cases:
                continue
            ceiling = ceiling_inflight(fleet, shards, inflight, r, timeout)
            out.setdefault("ceiling_s", {})[str(r)] = ceiling
            if ceiling is not None:
                log(f"  x{r}: the same {shards} publishes against the grpc.aio ceiling: "
                    f"{ceiling:.2f}s")  # fmt: skip
    finally:
        fleet.close()
    return out


def summary(r: dict[str, Any]) -> str:
    """One human line per case."""
    if str(r.get("case")).startswith("group-"):
        return group.summary(r)
    if r.get("case") == "sequential" and "failed" not in r:
        return (
            f"  {r.get('shards')} shards one after another x{r['replicas']}: per shard median "
            f"{r['shard_ms_median']:.1f} ms, mean {r['shard_ms_mean']:.1f}, p95 "
            f"{r['shard_ms_p95']:.1f}; one-shard versions among them median "
            f"{r['single_ms_median'] or 0:.1f} ms; {r['seconds']:.1f}s in all, transactions "
            f"{r.get('transactions')} (etcd revisions {r.get('etcd_writes')} with the one-shard "
            f"versions), last visible {r.get('last_visible')}, Latest "
            f"{r.get('latest_before')}->{r.get('latest_after')}, ok {r.get('ok')}"
        )
    what = {
        "ranks": f"{r.get('shards')} ranks, a session each",
        "sequential": f"{r.get('shards')} shards one after another",
    }.get(str(r.get("case")), f"{r.get('shards')} shards, {r.get('inflight')} in flight")
    if "failed" in r:
        return f"  {what} x{r.get('replicas')}: FAILED {r['failed']}"
    seconds = r.get("seconds")
    ratio = None if seconds is None else seconds * 1000 / r["one_shard_ms"]
    return (
        f"  {what} x{r['replicas']}: visible after "
        + ("-" if seconds is None else f"{seconds:.2f}s ({ratio:.0f}x one shard)")
        + f", etcd revisions {r.get('etcd_writes')}, published {r.get('published')}, "
        f"visible replies {r.get('visible_replies')}"
        + (
            f" (from {r['visible_transactions']} transaction(s))"
            if "visible_transactions" in r
            else ""
        )
        + f", Latest {r.get('latest_before')}->"
        f"{r.get('latest_after')}, ordered {r.get('ordered')}, failures {r.get('failures')}"
        + (f" ({r.get('first_error') or r.get('last_error')})" if r.get("failures") else "")
        + f", ok {r.get('ok')}"
    )
