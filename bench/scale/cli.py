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
import time
from collections.abc import Callable
from typing import Any

from bench.report import Result, emit
from bench.scale import rows, runners, shard_rows

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


def _timed(
    name: str,
    command: str,
    fn: Callable[[], dict[str, Any]],
    fill: Callable[[Result, dict[str, Any]], None],
) -> Result:
    """Run one part; any exception becomes the part's note (a failed part, not a crash)."""
    res = Result(name, command)
    start = time.monotonic()
    runners.log(f"== {name} ...")
    try:
        data = fn()
        res.details = data
        fill(res, data)
    except Exception as exc:  # reported, and the other parts still run
        res.note = f"failed: {type(exc).__name__}: {exc}"[:300]
    res.seconds = time.monotonic() - start
    return res


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
            lambda: runners.run_clients(args),
            rows.fill_clients,
        ),
        "holders": (
            f"{cmd}holders --holders {args.holders}",
            lambda: holders.run(small, large),
            rows.fill_holders,
        ),
        "manifest": (
            f"{cmd}manifest",
            lambda: manifest.run(args.manifest_tensors, args.manifest_chunks),
            rows.fill_manifest,
        ),
        "history": (
            f"{cmd}history --history-steps {args.history_steps}",
            lambda: history.run(
                args.history_steps,
                args.history_seconds,
                args.compact_interval,
                args.history_sample_every,
            ),
            rows.fill_history,
        ),
        "shards": (
            f"{cmd}shards --shards {args.shards} --inflight {args.inflight} --ranks {args.ranks}"
            f" --sequential {args.sequential} --group-tensors {args.group_tensors}"
            f" --group-frame {args.group_frame}"
            f" --shard-cases {args.shard_cases}"
            f" --replicas {args.replicas}{limits}{tree}",
            lambda: runners.run_shards(args),
            shard_rows.fill_shards,
        ),
        "herd": (
            f"{cmd}herd --herd-clients {args.herd_clients} --replicas {args.replicas} "
            f"--ttl {args.ttl} --herd-open-seconds {args.herd_open_seconds:g}{limits}{tree}",
            lambda: runners.run_herd(args),
            rows.fill_herd,
        ),
        "reconnect": (
            f"{cmd}reconnect --reconnect-clients {args.reconnect_clients} --ttl {args.ttl}"
            f"{limits}{tree}",
            lambda: runners.run_reconnect(args),
            rows.fill_reconnect,
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
