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
from bench.scale.args import PARTS, add_arguments


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
