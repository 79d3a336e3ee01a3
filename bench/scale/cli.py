"""`tensorhub bench scale [--parts ...] [--clients 100,500,1000,2000] [--json PATH]`.

Prints each figure with its target and verdict (the table every benchmark prints). Ratios
are taken within one run: the clients part measures its ceiling server at each N with the
same client processes, just before the hub at that N. Targets apply at the largest
N of the run (2,000 by default: docs/design.md's scale envelope asks for 2,000 clients on one
replica).
The shards part's bursts are ratios to a one-shard publish in the same World, the herd's to
the ceiling server with the same clients in the same run. Every etcd runs with
`--max-txn-ops` and `--max-request-bytes` stated (etcd's defaults unless given), and the
parts that depend on them print them.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.report import Result, emit

PARTS = ("clients", "holders", "manifest", "history", "shards", "herd", "reconnect")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS)
    )
    ap.add_argument(
        "--clients",
        default="100,500,1000,2000",
        help="clients per replica, one round each (default %(default)s)",
    )
    ap.add_argument("--versions", type=int, default=20, help="versions published per round")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between publishes")
    ap.add_argument("--workers", type=int, default=4, help="client processes")
    ap.add_argument("--ttl", type=int, default=10, help="client session TTL (s)")
    ap.add_argument(
        "--connect-seconds",
        type=float,
        default=120.0,
        help="deadline for a round's clients to connect",
    )
    ap.add_argument("--hub-tree", help="run the hub of another checkout (e.g. a worktree)")
    ap.add_argument("--holders", default="16,1024", help="SMALL,LARGE holders of one version")
    ap.add_argument("--manifest-tensors", type=int, default=100_000)
    ap.add_argument("--manifest-chunks", type=int, default=300_000)
    ap.add_argument("--history-steps", type=int, default=10_000)
    ap.add_argument(
        "--history-seconds",
        type=float,
        default=300.0,
        help="the history part stops here even if steps remain",
    )
    ap.add_argument(
        "--history-sample-every", type=int, default=1000, help="steps between DB size samples"
    )
    ap.add_argument(
        "--compact-interval",
        type=float,
        default=5.0,
        help="the hub's --compact-interval in the history part",
    )
    ap.add_argument("--shards", type=int, default=4096, help="shards of the in-flight case")
    ap.add_argument("--inflight", type=int, default=256, help="its shard publishes in flight")
    ap.add_argument(
        "--ranks", type=int, default=1024, help="ranks of the barrier case (a session each)"
    )
    ap.add_argument(
        "--sequential",
        type=int,
        default=4096,
        help="shards of the sequential case (one client, one after another)",
    )
    ap.add_argument(
        "--group-tensors",
        type=int,
        default=200,
        help="tensors in each shard's manifest in the group cases (a transformer layer's)",
    )
    ap.add_argument(
        "--group-frame",
        type=int,
        default=32,
        help="shards a message of the group cases' call (1: one a message, what a hub "
        "without PublishRequest.shards reads, e.g. with --hub-tree of such a tree)",
    )
    ap.add_argument(
        "--shard-cases",
        default="ranks,inflight,sequential,group-shards,group-ranks",
        help="cases of the shards part (default %(default)s)",
    )
    ap.add_argument(
        "--shard-timeout", type=float, default=600.0, help="deadline of one shard's Publish (s)"
    )
    ap.add_argument(
        "--replicas",
        default="1,2",
        help="hub replicas of the shards and herd parts, one run each (default %(default)s)",
    )
    ap.add_argument("--herd-clients", type=int, default=2000, help="clients opening at once")
    ap.add_argument(
        "--herd-hold",
        type=float,
        default=None,
        help="seconds the herd stays open after its last open (default: --ttl)",
    )
    ap.add_argument(
        "--herd-open-seconds",
        type=float,
        default=10.0,
        help="deadline of one OpenSession in the herd (default: the SDK's timeout, 10 s)",
    )
    ap.add_argument(
        "--reconnect-clients", type=int, default=2000, help="SDK clients under the killed replica"
    )
    ap.add_argument(
        "--reconnect-workers", type=int, default=8, help="processes holding the SDK clients"
    )
    ap.add_argument(
        "--reconnect-connecting",
        type=int,
        default=8,
        help="SDK clients connecting and publishing at a time, in all (the setup is paced)",
    )
    ap.add_argument(
        "--reconnect-observe",
        type=float,
        default=None,
        help="seconds watched after the kill (default: --ttl + 5)",
    )
    ap.add_argument(
        "--max-txn-ops", type=int, default=128, help="etcd's --max-txn-ops (its default)"
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=1_572_864,
        help="etcd's --max-request-bytes (its default, 1.5 MiB)",
    )
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _timed(
    name: str,
    command: str,
    fn: Callable[[], dict[str, Any]],
    fill: Callable[[Result, dict[str, Any]], None],
) -> Result:
    """Run one part; any exception becomes the part's note (a failed part, not a crash)."""
    res = Result(name, command)
    start = time.monotonic()
    _log(f"== {name} ...")
    try:
        data = fn()
        res.details = data
        fill(res, data)
    except Exception as exc:  # reported, and the other parts still run
        res.note = f"failed: {type(exc).__name__}: {exc}"[:300]
    res.seconds = time.monotonic() - start
    return res


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fill_clients(res: Result, data: dict[str, Any]) -> None:
    rounds: list[dict[str, Any]] = data["rounds"]
    top = max(r["clients"] for r in rounds)
    for n in sorted({r["clients"] for r in rounds}):
        hub = next((r for r in rounds if r["clients"] == n and r["server"] == "hub"), {})
        ceil = next((r for r in rounds if r["clients"] == n and r["server"] == "ceiling"), {})
        target = n == top
        published = int(hub.get("versions_published", 0))
        errors = (
            int(hub.get("versions_missing_somewhere", 0))
            + sum(hub.get("publish_failures", {}).values())
            + sum(hub.get("stream_errors", {}).values())  # connect errors included
            + sum(hub.get("latest_errors", {}).values())
            + (1 if "failed" in hub else 0)
        )
        res.add(
            f"N={n}: versions seen by every open watch / asked",
            (published - int(hub.get("versions_missing_somewhere", 0)))
            / max(1, int(hub.get("versions_asked", 1))),
            ">= 1" if target else "",
        )
        res.add(
            f"N={n}: errors (publish, watch, keepalive, latest)", errors, "<= 0" if target else ""
        )
        res.add(
            f"N={n}: all-visible p99 / ceiling fan-out p99",
            _ratio(hub.get("all_visible_p99_ms"), ceil.get("all_visible_p99_ms")),
            "<= 3" if target else "",
        )
        res.add(
            f"N={n}: Latest p99 / ceiling unary p99",
            _ratio(hub.get("latest_p99_ms"), ceil.get("latest_p99_ms")),
            "<= 3" if target else "",
        )
        for label, key in (
            ("all-visible p50", "all_visible_p50_ms"),
            ("all-visible p99", "all_visible_p99_ms"),
            ("Latest p99", "latest_p99_ms"),
        ):
            res.add(f"N={n}: hub {label}", hub.get(key), unit="ms")
        res.add(f"N={n}: hub sessions all open after", hub.get("connect_s"), unit="s")
        res.add(f"N={n}: hub renewals later than ttl/3", hub.get("keepalive_late"), unit="renewals")
        res.add(f"N={n}: ceiling fan-out p50", ceil.get("all_visible_p50_ms"), unit="ms")
        res.add(f"N={n}: ceiling fan-out p99", ceil.get("all_visible_p99_ms"), unit="ms")
        res.add(f"N={n}: ceiling unary p99", ceil.get("latest_p99_ms"), unit="ms")
        for who, r in (("hub", hub), ("ceiling", ceil)):
            res.add(f"N={n}: {who} RSS", r.get("rss_mb"), unit="MB")
            res.add(f"N={n}: {who} threads", r.get("threads"), unit="threads")
            res.add(f"N={n}: {who} CPU per version", r.get("cpu_s_per_version"), unit="s")
            res.add(f"N={n}: {who} CPU between publishes (renewals)", r.get("idle_cpu_s_per_s"),
                    unit="s/s")  # fmt: skip


def _fill_holders(res: Result, data: dict[str, Any]) -> None:
    small, large, step = data["small"], data["large"], data["step"]
    res.add(
        f"Resolve p50 at {large['total_holders']} / at {small['total_holders']} holders",
        _ratio(large["p50_ms"], small["p50_ms"]),
        "<= 2",
    )
    res.add("Resolve p99 ratio (same)", _ratio(large["p99_ms"], small["p99_ms"]))
    res.add(f"Resolve p50 at {small['total_holders']} holders", small["p50_ms"], unit="ms")
    res.add(f"Resolve p50 at {large['total_holders']} holders", large["p50_ms"], unit="ms")
    res.add("Resolve candidates returned at the large size", large["candidates"], unit="holders")
    res.add(
        f"step of {step['readers']} readers: failed readers", sum(step["failures"].values()), "<= 0"
    )
    res.add("step: etcd writes", step["etcd_writes"], unit="revisions")
    res.add("step: etcd writes per reader", step["etcd_writes"] / step["readers"], unit="revisions")
    res.add("step: hub CPU", step["hub_cpu_s"], unit="s")
    res.add("step: etcd CPU", step["etcd_cpu_s"], unit="s")
    res.add("step: wall time", step["seconds"], unit="s")


def _fill_manifest(res: Result, data: dict[str, Any]) -> None:
    ok = "failed" not in data
    res.add(
        f"{data['tensors']} tensors / {data['chunks']} chunks published and fetched",
        1.0 if ok else 0.0,
        ">= 1",
    )
    if not ok:
        res.note = str(data["failed"])[:300]
    res.add("publish time", data.get("publish_s"), unit="s")
    res.add("fetch time", data.get("fetch_s"), unit="s")
    res.add("etcd writes for the version", data.get("etcd_writes"), unit="revisions")
    written = data.get("etcd_bytes_written")
    res.add("etcd bytes written for the version", None if written is None else written / 2**20,
            unit="MiB")  # fmt: skip
    res.add("etcd keys written for the version", data.get("etcd_keys_written"), unit="keys")


def _fill_history(res: Result, data: dict[str, Any]) -> None:
    samples = data["samples"]
    res.add("DB in-use spread after the first compaction", data["flatness"], "<= 0.1")
    res.add("the same spread per revision of history kept", data.get("per_revision_flatness"))
    res.add("steps run", data["steps"], unit="steps")
    res.add("failed RPCs", sum(data["failures"].values()), "<= 0")
    res.add("DB in-use, first sample", samples[0]["db_size_in_use"] / 2**20, unit="MiB")
    res.add("DB in-use, last sample", samples[-1]["db_size_in_use"] / 2**20, unit="MiB")
    res.add("history kept at the last sample", samples[-1].get("retained_revisions"),
            unit="revisions")  # fmt: skip
    res.add("etcd keys, first sample", samples[0].get("keys"), unit="keys")
    res.add("etcd keys, last sample", samples[-1].get("keys"), unit="keys")
    res.add(
        "revisions per step",
        (samples[-1]["revision"] - samples[0]["revision"]) / max(1, data["steps"]),
        unit="revisions",
    )
    if not data["compactor_flag"]:
        res.note = "this hub has no --compact-interval: ran without a compactor"
    elif data["flatness"] is None:
        res.note = "fewer than two samples after the first compaction"


def _limits(res: Result, data: dict[str, Any]) -> None:
    """The etcd limits the part ran under, as rows of its table."""
    limits = data.get("limits", {})
    res.add("etcd --max-txn-ops (ran under)", limits.get("max_txn_ops"), unit="ops")
    size = limits.get("max_request_bytes")
    res.add("etcd --max-request-bytes (ran under)", None if size is None else size / 1024,
            unit="KiB")  # fmt: skip


def _fill_shards(res: Result, data: dict[str, Any]) -> None:
    _limits(res, data)
    res.add("operations one shard writes (consistency/versions.py publish_shard)",
            data["ops_per_shard"], unit="ops")  # fmt: skip
    for r, ms in sorted(data.get("one_shard_ms", {}).items()):
        res.add(f"x{r}: one shard (unsharded) publish, median", ms, unit="ms")
    notes = []
    for c in data["cases"]:
        x = f"x{c.get('replicas')}"
        if c.get("case") == "sequential":
            notes += _fill_sequential(res, c, x, data.get("sequential_target", 1.5))
            continue
        if str(c.get("case")).startswith("group-"):
            notes += _fill_group(res, c, x, data["revision_target_of"])
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


def _fill_sequential(res: Result, c: dict[str, Any], x: str, target: float) -> list[str]:
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


def _fill_group(res: Result, c: dict[str, Any], x: str, targets: dict[str, int]) -> list[str]:
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


def _fill_herd(res: Result, data: dict[str, Any]) -> None:
    _limits(res, data)
    rounds: list[dict[str, Any]] = data["rounds"]
    for r in sorted({x["replicas"] for x in rounds}):
        hub = next((x for x in rounds if x["replicas"] == r and x["server"] == "hub"), {})
        ceil = next((x for x in rounds if x["replicas"] == r and x["server"] == "ceiling"), {})
        n = data["clients"]
        what = f"{n} at once, x{r}"
        errors = sum(hub.get("errors", {}).values()) + (1 if "failed" in hub else 0)
        if hub.get("sessions", 0) < n:
            errors = max(errors, 1)
        res.add(f"{what}: errors (open, keepalive, watch)", errors, "<= 0")
        res.add(f"{what}: sessions expired or renewed later than the TTL",
                hub.get("expired"), "<= 0")  # fmt: skip
        res.add(
            f"{what}: all open and watching / ceiling",
            _ratio(hub.get("all_open_and_watching_s"), ceil.get("all_open_and_watching_s")),
            "<= 3",
        )
        one = hub.get("one_open_ms")
        res.add(
            f"{what}: all {n} OpenSessions answered / one open alone",
            _ratio(hub.get("all_opened_s"), None if one is None else one / 1000),
        )
        res.add(f"{what}: hub all open and watching", hub.get("all_open_and_watching_s"),
                unit="s")  # fmt: skip
        res.add(f"{what}: ceiling all open and watching", ceil.get("all_open_and_watching_s"),
                unit="s")  # fmt: skip
        res.add(f"{what}: hub sessions opened", hub.get("sessions"), unit="sessions")
        res.add(f"{what}: hub all OpenSessions answered", hub.get("all_opened_s"), unit="s")
        res.add(f"{what}: hub last successful open", hub.get("last_open_s"), unit="s")
        res.add(f"{what}: hub one open alone, median", one, unit="ms")
        res.add(f"{what}: hub longest time between renewals", hub.get("max_renewal_gap_s"),
                unit="s")  # fmt: skip
        res.add(f"{what}: hub renewals later than ttl/3", hub.get("keepalive_late"),
                unit="renewals")  # fmt: skip
        res.add(f"{what}: hub RSS", hub.get("rss_mb"), unit="MB")
        notes = []
        if hub.get("watches_unavailable"):
            notes.append("the hub has no watches gauge: 'watching' not measured")
        for who, x in (("hub", hub), ("ceiling", ceil)):
            if "failed" in x:
                notes.append(f"{who} x{r}: {x['failed']}")
            elif x.get("error_details"):
                notes.append(f"{who} x{r}: {x['error_details']}")
        if notes:
            res.note = "; ".join([res.note, *notes] if res.note else notes)[:300]


def _fill_reconnect(res: Result, data: dict[str, Any]) -> None:
    _limits(res, data)
    n = data["clients"]
    res.add(f"{n} SDK clients: sessions on the same lease after the kill / clients",
            _ratio(data.get("same_session"), n), ">= 1")  # fmt: skip
    res.add("holder records intact, same session / clients",
            _ratio(data.get("holders_intact"), n), ">= 1")  # fmt: skip
    res.add("renewed within the TTL across the kill / clients",
            _ratio(data.get("renewed_within_ttl"), n), ">= 1")  # fmt: skip
    res.add("errors (connect, publish, lost sessions, recoveries)", data.get("errors"), "<= 0")
    res.add("clients connected and published", data.get("connected"), unit="clients")
    res.add("keepalive streams on the killed replica", data.get("streams_on_killed"),
            unit="streams")  # fmt: skip
    res.add("keepalive streams on the other, after", data.get("streams_on_other_after"),
            unit="streams")  # fmt: skip
    res.add("sessions on the same lease", data.get("same_session"), unit="sessions")
    res.add("holder records intact", data.get("holders_intact"), unit="records")
    res.add("lost sessions", data.get("lost"), unit="sessions")
    res.add("of which before the kill (while connecting)", data.get("lost_before_kill"),
            unit="sessions")  # fmt: skip
    res.add("recoveries (a new lease)", data.get("recoveries"), unit="sessions")
    res.add("longest renewal gap across the kill", data.get("max_gap_s"), unit="s")
    res.add("every session renewed again after the kill", data.get("all_back_s"), unit="s")
    res.add("connect and publish", data.get("connect_s"), unit="s")
    if data.get("failed") or data.get("first_error"):
        res.note = f"{data.get('failed') or data.get('first_error')}"[:300]


def _clients(args: argparse.Namespace) -> dict[str, Any]:
    """At each N: the ceiling, then the hub, measured by the same client processes."""
    from bench.scale.clients import Fleet
    from bench.scale.load import RoundSpec
    from bench.scale.sessions import ceiling_round, hub_round, summary
    from consistency.embedded import EtcdCluster

    rounds = []
    with EtcdCluster(size=1, extra_args=_etcd_limits(args).args()) as etcd:
        for n in [int(x) for x in args.clients.split(",") if x]:
            spec = RoundSpec(clients=n, versions=args.versions, gap=args.gap,
                             workers=args.workers, ttl=args.ttl,
                             connect_seconds=args.connect_seconds)  # fmt: skip
            fleet = Fleet(args.workers)
            try:
                for name in ("ceiling", "hub"):
                    t0 = time.monotonic()
                    if name == "ceiling":
                        r = ceiling_round(spec, _log, fleet)
                    else:
                        r = hub_round(etcd.endpoints, spec, _log, tree=args.hub_tree, fleet=fleet)
                    r["round_s"] = round(time.monotonic() - t0, 1)
                    _log(summary(r))
                    rounds.append(r)
                    if r.get("fleet_broken"):  # the next round gets fresh processes
                        fleet.close()
                        fleet = Fleet(args.workers)
            finally:
                fleet.close()
    return {"rounds": rounds, "hub_tree": args.hub_tree}


def _etcd_limits(args: argparse.Namespace) -> Any:
    from bench.scale.world import EtcdLimits

    return EtcdLimits(args.max_txn_ops, args.max_request_bytes)


def _replicas(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(x) for x in args.replicas.split(",") if x)


def _herd(args: argparse.Namespace) -> dict[str, Any]:
    """At each replica count: the ceiling, then the hub, with the same client processes."""
    from bench.scale.clients import Fleet
    from bench.scale.herd import HerdSpec, ceiling_herd, herd_round, summary
    from bench.scale.procs import ServerStartError
    from bench.scale.world import World

    limits = _etcd_limits(args)
    spec = HerdSpec(
        clients=args.herd_clients, workers=args.workers, ttl=args.ttl,
        hold=float(args.ttl) if args.herd_hold is None else args.herd_hold,
        connect_seconds=args.connect_seconds, open_seconds=args.herd_open_seconds,
    )  # fmt: skip
    _log(f"  etcd at {limits.describe()}")
    rounds = []
    fleet = Fleet(args.workers, prober=False)
    try:
        for r in _replicas(args):
            for name in ("ceiling", "hub"):
                t0 = time.monotonic()
                if name == "ceiling":
                    res = ceiling_herd(r, spec, fleet, _log)
                else:
                    world = World(max_sessions=2 * spec.clients + 64, replicas=r,
                                  tree=args.hub_tree, limits=limits, metrics=True)  # fmt: skip
                    try:
                        with world:
                            res = herd_round("hub", world.hubs, world.token, spec, fleet, _log)
                    except ServerStartError as exc:
                        res = {"server": "hub", "replicas": r, "failed": str(exc)}
                res["round_s"] = round(time.monotonic() - t0, 1)
                _log(summary(res))
                rounds.append(res)
                if res.get("fleet_broken"):  # the next round gets fresh processes
                    fleet.close()
                    fleet = Fleet(args.workers, prober=False)
    finally:
        fleet.close()
    return {
        "clients": spec.clients,
        "rounds": rounds,
        "hub_tree": args.hub_tree,
        "limits": {"max_txn_ops": limits.max_txn_ops,
                   "max_request_bytes": limits.max_request_bytes},
    }  # fmt: skip


def _shards(args: argparse.Namespace) -> dict[str, Any]:
    from bench.scale import shards

    cases = tuple(c for c in args.shard_cases.split(",") if c)
    unknown = set(cases) - set(shards.CASES)
    if unknown:
        raise SystemExit(f"unknown shard cases: {', '.join(sorted(unknown))}")
    return shards.run(
        args.shards, args.ranks, args.inflight, _replicas(args), sequential=args.sequential,
        group_tensors=args.group_tensors, group_frame=args.group_frame, cases=cases,
        workers=args.workers, timeout=args.shard_timeout, tree=args.hub_tree,
        limits=_etcd_limits(args), log=_log,
    )  # fmt: skip


def _reconnect(args: argparse.Namespace) -> dict[str, Any]:
    from bench.scale import reconnect

    out = reconnect.run(
        args.reconnect_clients, workers=args.reconnect_workers, ttl=args.ttl,
        observe=args.reconnect_observe, concurrency=args.reconnect_connecting,
        tree=args.hub_tree, limits=_etcd_limits(args), log=_log,
    )  # fmt: skip
    _log(reconnect.summary(out))
    return out


def results(args: argparse.Namespace) -> list[Result]:
    """Run the chosen parts in order; one Result per part."""
    from bench.scale import history, holders, manifest

    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts: {', '.join(sorted(unknown))}")
    small, large = (int(x) for x in args.holders.split(","))
    cmd = "tensorhub bench scale --parts "
    limits = f" --max-txn-ops {args.max_txn_ops} --max-request-bytes {args.max_request_bytes}"
    tree = f" --hub-tree {args.hub_tree}" if args.hub_tree else ""
    runs: dict[str, tuple[str, Callable[[], dict[str, Any]], Any]] = {
        "clients": (
            f"{cmd}clients --clients {args.clients}",
            lambda: _clients(args),
            _fill_clients,
        ),
        "holders": (
            f"{cmd}holders --holders {args.holders}",
            lambda: holders.run(small, large),
            _fill_holders,
        ),
        "manifest": (
            f"{cmd}manifest",
            lambda: manifest.run(args.manifest_tensors, args.manifest_chunks),
            _fill_manifest,
        ),
        "history": (
            f"{cmd}history --history-steps {args.history_steps}",
            lambda: history.run(
                args.history_steps,
                args.history_seconds,
                args.compact_interval,
                args.history_sample_every,
            ),
            _fill_history,
        ),
        "shards": (
            f"{cmd}shards --shards {args.shards} --inflight {args.inflight} --ranks {args.ranks}"
            f" --sequential {args.sequential} --group-tensors {args.group_tensors}"
            f" --group-frame {args.group_frame}"
            f" --shard-cases {args.shard_cases}"
            f" --replicas {args.replicas}{limits}{tree}",
            lambda: _shards(args),
            _fill_shards,
        ),
        "herd": (
            f"{cmd}herd --herd-clients {args.herd_clients} --replicas {args.replicas} "
            f"--ttl {args.ttl} --herd-open-seconds {args.herd_open_seconds:g}{limits}{tree}",
            lambda: _herd(args),
            _fill_herd,
        ),
        "reconnect": (
            f"{cmd}reconnect --reconnect-clients {args.reconnect_clients} --ttl {args.ttl}"
            f"{limits}{tree}",
            lambda: _reconnect(args),
            _fill_reconnect,
        ),
    }
    return [_timed(f"scale/{p}", runs[p][0], runs[p][1], runs[p][2]) for p in parts]


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tensorhub bench scale", description=__doc__)
    add_arguments(ap)
    return ap.parse_args(argv)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (e.g. `timeout`) ends the run through the `finally`s and `with`s, so its
    etcd, hubs and worker processes are stopped instead of left running."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    args = parse(argv)
    out = results(args)
    return emit(out, args.json)
