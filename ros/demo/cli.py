"""`tensorhub demo`: flags, then run the loop, print the table, write `--json` / `--plot`."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ros.demo.config import DemoConfig
from ros.demo.display import Display
from ros.demo.driver import DemoRun
from ros.demo.summary import matplotlib_missing, plot, print_summary


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--rollouts", type=int, default=4, help="rollout processes (default %(default)s)"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="training steps (default %(default)s)"
    )
    parser.add_argument(
        "--model-mb",
        type=float,
        default=64.0,
        help="model size in MB: the policy is padded with frozen parameters to reach it "
        "(default %(default)s; try 1024 for a heavy run)",
    )
    parser.add_argument(
        "--batch", type=int, default=256, help="contexts per rollout per step (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument(
        "--kill-a-rollout-at",
        dest="kill_at",
        type=int,
        default=0,
        metavar="STEP",
        help="SIGKILL one rollout in the middle of its fetch at STEP, to show failover",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="deadline for each step, seconds (default %(default)s)",
    )
    parser.add_argument(
        "--session-ttl",
        type=int,
        default=5,
        help="workers' session TTL in seconds: how soon a killed rollout's records "
        "vanish (default %(default)s)",
    )
    parser.add_argument(
        "--no-delta",
        dest="delta",
        action="store_false",
        help="publish and fetch every version whole (default: the trainer publishes delta "
        "versions, keeping one more host copy of the model, and rollouts read the changes)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report here")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw stall and reward per step (matplotlib)"
    )


def run(args: argparse.Namespace) -> int:
    if args.plot is not None and (reason := matplotlib_missing()):
        print(f"error: {reason}", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        rollouts=args.rollouts, steps=args.steps, model_mb=args.model_mb, batch=args.batch,
        seed=args.seed, kill_at=args.kill_at, step_timeout=args.step_timeout,
        session_ttl=args.session_ttl, delta=args.delta,
    )  # fmt: skip
    # SIGTERM tears down like Ctrl-C does (workers, hub and etcd are stopped on the way out).
    signal.signal(signal.SIGTERM, _terminate)
    report = DemoRun(cfg, Display()).run()
    print_summary(report, sys.stdout)
    if args.json is not None:
        report.write_json(args.json)
        print(f"report written to {args.json}")
    if args.plot is not None and report.steps:
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if report.ok else 1


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
