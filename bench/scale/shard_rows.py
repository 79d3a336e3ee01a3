"""`tensorhub bench scale --parts shards`'s report: the rows of each case (ranks at a
barrier, shards in flight, one after another, the group calls), with their targets, from
the dict `bench.scale.shards.run` returned.

Apart from the other parts' rows (`bench.scale.rows`) for its size: a table per case.
"""

from __future__ import annotations

from typing import Any

from bench.report import Result
from bench.scale.rows import limit_rows


def fill_shards(res: Result, data: dict[str, Any]) -> None:
    limit_rows(res, data)
    res.add("operations one shard writes (consistency/versions.py publish_shard)",
            data["ops_per_shard"], unit="ops")  # fmt: skip
    for r, ms in sorted(data.get("one_shard_ms", {}).items()):
        res.add(f"x{r}: one shard (unsharded) publish, median", ms, unit="ms")
    notes = []
    for c in data["cases"]:
        x = f"x{c.get('replicas')}"
        if c.get("case") == "sequential":
            notes += fill_sequential(res, c, x, data.get("sequential_target", 1.5))
            continue
        if str(c.get("case")).startswith("group-"):
            notes += fill_group(res, c, x, data["revision_target_of"])
            continue
        base = c.get("one_shard_ms")
        seconds = c.get("seconds")
        ratio = None if seconds is None or not base else seconds * 1000 / base
        n = c.get("shards")
        if c.get("case") == "ranks":
            what, target = f"{n} ranks, a session each, at a barrier, {x}", "<= 60"
            revisions = ""
        else:
            what = f"{n} shards, {c.get('inflight')} in flight, {x}"
            target = "<= 150"
            revisions = f"<= {data['revision_target']}"
        res.add(f"{what}: visible / one shard", ratio, target)
        ceiling = (data.get("ceiling_s") or {}).get(str(c.get("replicas")))
        if c.get("case") == "inflight" and ceiling and seconds is not None:
            res.add(f"{what}: visible / the same publishes to the grpc.aio ceiling",
                    seconds / ceiling)  # fmt: skip
            res.add(f"{what}: the grpc.aio ceiling's time", ceiling, unit="s")
        res.add(f"{what}: etcd revisions for the version", c.get("etcd_writes"), revisions)
        res.add(
            f"{what}: Latest moved with the last shard only, in one transaction, none refused",
            1.0 if c.get("ok") else 0.0,
            ">= 1",
        )
        res.add(f"{what}: Publish replies that said visible", c.get("visible_replies"),
                unit="replies")  # fmt: skip
        if "visible_transactions" in c:
            res.add(f"{what}: transactions those replies came from",
                    c["visible_transactions"], "<= 1", unit="txns")  # fmt: skip
        res.add(f"{what}: visible after", seconds, unit="s")
        failures = c.get("failures") or {}
        if c.get("failed") or failures or c.get("last_error"):
            why = c.get("failed") or c.get("first_error") or c.get("last_error") or failures
            notes.append(f"{what}: {why}")
    if notes:
        res.note = "; ".join(str(n) for n in notes)[:300]


def fill_sequential(res: Result, c: dict[str, Any], x: str, target: float) -> list[str]:
    """The sequential case's rows: each shard's Publish against the one-shard versions
    published alone among them; its failure, if any, as a note."""
    what = f"{c.get('shards')} shards one after another, {c.get('sessions')} sessions, {x}"
    if c.get("failed"):
        res.add(f"{what}: ok", 0.0, ">= 1")
        return [f"{what}: {c['failed']}"]
    base = c.get("single_ms_median")
    for stat in ("median", "mean", "p95"):
        ms = c.get(f"shard_ms_{stat}")
        ratio = None if ms is None or not base else ms / base
        res.add(f"{what}: a shard's publish, {stat} / one-shard version's median", ratio,
                f"<= {target:g}" if stat == "median" else "")  # fmt: skip
        res.add(f"{what}: a shard's publish, {stat}", ms, unit="ms")
    res.add(f"{what}: one-shard versions published among them, median", base, unit="ms")
    start = c.get("one_shard_ms")
    median = c.get("shard_ms_median")
    res.add(f"{what}: a shard's publish, median / the one-shard publish at the run's start",
            None if median is None or not start else median / start)  # fmt: skip
    res.add(f"{what}: transactions that committed its shards", c.get("transactions"))
    res.add(f"{what}: etcd revisions of the run, the one-shard versions' included",
            c.get("etcd_writes"))  # fmt: skip
    res.add(f"{what}: every shard in {c.get('seconds') or 0:.1f}s, the last one visible",
            1.0 if c.get("ok") else 0.0, ">= 1")  # fmt: skip
    return []


def fill_group(res: Result, c: dict[str, Any], x: str, targets: dict[str, int]) -> list[str]:
    """A group case's rows: one PublishShards call of N shards against a one-shard publish
    (1,024 ranks <= 60x, 4,096 shards <= 150x), in shards per second, and its revisions."""
    ranks = c.get("case") == "group-ranks"
    n = c.get("shards")
    what = (f"{n} {'ranks (a session each)' if ranks else 'shards'} in one group call, "
            f"{c.get('tensors')} tensors a shard, {x}")  # fmt: skip
    if c.get("failed"):
        res.add(f"{what}: ok", 0.0, ">= 1")
        return [f"{what}: {c['failed']}"]
    base, seconds = c.get("one_shard_ms"), c.get("seconds")
    ratio = None if seconds is None or not base else seconds * 1000 / base
    res.add(f"{what}: visible / one shard", ratio, "<= 60" if ranks else "<= 150")
    res.add(f"{what}: visible after", seconds, unit="s")
    res.add(f"{what}: shards per second", c.get("shards_per_second"), unit="shards/s")
    res.add(f"{what}: the hub's CPU over the call", c.get("hub_cpu_s"), unit="s")
    res.add(f"{what}: the hub's busiest thread's CPU (its event loop)", c.get("hub_loop_cpu_s"),
            unit="s")  # fmt: skip
    res.add(f"{what}: the hub's checking processes' CPU over the call",
            c.get("hub_children_cpu_s"), unit="s")  # fmt: skip
    res.add(f"{what}: the sending client's CPU over the call", c.get("client_cpu_s"), unit="s")
    res.add(f"{what}: etcd's CPU over the call", c.get("etcd_cpu_s"), unit="s")
    res.add(f"{what}: etcd's bytes written over the call", c.get("etcd_write_mb"), unit="MB")
    res.add(f"{what}: a shard's manifest", c.get("manifest_bytes"), unit="B")
    res.add(f"{what}: etcd revisions for the version", c.get("etcd_writes"),
            f"<= {targets.get(str(n), 0)}")  # fmt: skip
    res.add(f"{what}: every shard committed, Latest 0->1, visible from one transaction",
            1.0 if c.get("ok") else 0.0, ">= 1")  # fmt: skip
    return [f"{what}: {c['first_error']}"] if c.get("first_error") else []
