"""`tensorhub chaos run`: a fault-injection run with a live fault log and a checked history.

Exit status: 0 when the history shows no violation, 1 when it does (each printed with the
operations that prove it), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from chaos import runner
from chaos.failpoints import NAMES
from chaos.planted import KNOWN
from chaos.recheck import recheck
from chaos.report import summary, write_json
from ros.cli.progress import Bar, Ticker


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="chaos_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("run", help="run a cluster, drive traffic, inject faults, check history")
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of workload and faults")
    p.add_argument(
        "--faults",
        help=f"comma-separated failpoints (default: all available): {','.join(NAMES)}",
    )
    p.add_argument(
        "--workload",
        choices=runner.WORKLOADS,
        default="whole",
        help="whole: publishers of whole versions, readers, watchers, a poller, an intruder; "
        "model-parallel: --ranks rank processes each publishing its shard of every version "
        "(shard=(rank, ranks)), shard readers checking every visible version is whole and "
        "every shard has its rank's bytes, the intruder; with the kill-rank failpoint, and "
        "kill-hub striking mid-burst; mixed: both (default %(default)s)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=16,
        help="shards per version of the model-parallel workload, one process each "
        f"(1..{runner.MAX_RANKS}; default %(default)s)",
    )
    p.add_argument(
        "--layout-readers",
        type=int,
        default=2,
        help="with ranks (model-parallel, mixed): readers fetching blocks of every version in "
        "a second layout that cut across the ranks' shards, each serving its blocks to the "
        f"next (fetch_slices(layout=...); 0..{runner.MAX_LAYOUT_READERS}; default %(default)s)",
    )
    p.add_argument(
        "--no-delta",
        dest="delta",
        action="store_false",
        help="publish and read whole versions only (by default publishers publish with "
        "delta=True and readers apply the deltas: docs/chaos.md)",
    )
    p.add_argument("--json", type=Path, help="also write the full report (with history) here")
    p.add_argument("--keep", action="store_true", help="keep the work dir (histories, logs)")
    c = sub.add_parser("check", help="run the checker again over a saved --json report")
    c.add_argument("report", type=Path, help="a report written by `chaos run --json`")
    p.add_argument(
        "--planted-bug",
        choices=KNOWN,
        default="",
        help="TEST ONLY: plant this bug in the clients, to see the checker catch it",
    )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C


def run(args: argparse.Namespace) -> int:
    """`chaos run` or `chaos check`."""
    if args.chaos_command == "check":
        return _check(args.report)
    faults = None
    if args.faults:
        faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    started = time.monotonic()
    ticking: list[tuple[Bar, Ticker]] = []  # the bar of the run's --duration, once it runs

    def progress(text: str) -> None:
        line = f"[{time.monotonic() - started:6.1f}s] {text}"
        if ticking:
            ticking[0][0].write(line)
            return
        print(line, file=sys.stderr, flush=True)
        if text.startswith("running for"):  # the cluster is up: the duration starts now
            bar = Bar(args.duration, "chaos run", unit="s")
            ticking.append((bar, Ticker(bar, args.duration).start()))

    signal.signal(signal.SIGTERM, _interrupt)
    config = runner.for_workload(
        args.workload, args.ranks, duration=args.duration, seed=args.seed, faults=faults,
        planted=args.planted_bug, keep=args.keep, progress=progress, delta=args.delta,
        layout_readers=args.layout_readers,
    )  # fmt: skip
    try:
        result = runner.run(config)
    finally:
        for bar, ticker in ticking:
            ticker.stop()
            bar.close()
    print(summary(result))
    if args.json:
        write_json(result, args.json)
        print(f"\nfull report: {args.json}")
    return 1 if result.violations else 0


def _check(report: Path) -> int:
    violations, start = recheck(report)
    print(f"{report}: {len(violations)} violation(s)")
    for v in violations:
        print(f"  [{v.invariant}] {v.kind}: {v.message}")
        for op in v.ops:
            print(f"      {op.brief(start)}")
    return 1 if violations else 0
