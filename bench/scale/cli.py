"""`tensorhub bench scale [--parts ...] [--clients 100,500,1000,2000] [--json PATH]`.

Prints each figure with its target and verdict (the table every benchmark prints). Ratios
are taken within one run: the clients part measures its ceiling server at each N with the
same client processes, just before the hub at that N. Targets apply at the largest
N of the run (2,000 by default: DESIGN.md §8 asks for 2,000 clients on one replica).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import Result, table

PARTS = ("clients", "holders", "manifest", "history", "shards")


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
    ap.add_argument("--shards", type=int, default=4096)
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


def _fill_shards(res: Result, data: dict[str, Any]) -> None:
    res.add(
        f"{data['shards']} shards: last publish visible and Latest moved",
        1.0 if data["ok"] else 0.0,
        ">= 1",
    )
    res.add("shards refused", sum(data["failures"].values()), "<= 0")
    res.add("publish of every shard", data["seconds"], unit="s")
    res.add("etcd writes", data["etcd_writes"], unit="revisions")
    if data.get("first_error") or data.get("last_error"):
        res.note = f"first error: {data.get('first_error') or data.get('last_error')}"[:300]


def _clients(args: argparse.Namespace) -> dict[str, Any]:
    """At each N: the ceiling, then the hub, measured by the same client processes."""
    from bench.scale.clients import Fleet
    from bench.scale.load import RoundSpec
    from bench.scale.sessions import ceiling_round, hub_round, summary
    from consistency.embedded import EtcdCluster

    rounds = []
    with EtcdCluster(size=1) as etcd:
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


def results(args: argparse.Namespace) -> list[Result]:
    """Run the chosen parts in order; one Result per part."""
    from bench.scale import history, holders, manifest, shards

    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts: {', '.join(sorted(unknown))}")
    small, large = (int(x) for x in args.holders.split(","))
    cmd = "tensorhub bench scale --parts "
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
            f"{cmd}shards --shards {args.shards}",
            lambda: shards.run(args.shards),
            _fill_shards,
        ),
    }
    return [_timed(f"scale/{p}", runs[p][0], runs[p][1], runs[p][2]) for p in parts]


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tensorhub bench scale", description=__doc__)
    add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    out = results(args)
    print(table(out))
    if args.json:
        report = {
            "generated_unix": time.time(),
            "ok": all(r.ok for r in out),
            "results": [r.to_dict() for r in out],
        }
        text = json.dumps(report, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0 if all(r.ok for r in out) else 1
