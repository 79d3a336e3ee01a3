"""The end of a demo run: the per-step table, the reward curve, and the optional plot."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TextIO

from ros.cli.common import print_table
from ros.demo.report import MB, Report
from tensorhub.errors import InvalidArgument

BAR = 40


def matplotlib_missing() -> str:
    """Why `--plot` cannot work here, or "" if it can."""
    if importlib.util.find_spec("matplotlib") is None:
        return (
            "--plot needs matplotlib, which is not installed: "
            "`.venv/bin/pip install matplotlib` (or `pip install -e '.[dev]'`)"
        )
    return ""


def print_summary(report: Report, out: TextIO) -> None:
    rows = [
        [
            s.step, s.version, f"{s.trainer_stall_s:.3f}", f"{s.rollout_stall_s:.3f}",
            f"{s.from_trainer / MB:.1f}", f"{s.from_peers / MB:.1f}",
            f"{s.from_deltas / MB:.2f}", f"{s.moved / MB:.2f}",
            f"{s.throughput_mbs:.0f}", f"{s.reward:.3f}",
            "yes" if s.verified else "NO", s.killed or "",
        ]
        for s in report.steps
    ]  # fmt: skip
    headers = ["step", "version", "trainer stall s", "rollout stall s", "MB from trainer",
               "MB from peers", "MB of deltas", "MB moved", "MB/s", "reward", "bytes ok",
               "killed"]  # fmt: skip
    print("", file=out)
    import contextlib

    with contextlib.redirect_stdout(out):
        print_table(headers, rows)
    print("\nreward per step (mean over the rollouts' batches; random policy = 0.125):", file=out)
    for s in report.steps:
        print(f"  {s.step:>3} {s.reward:6.3f} {'#' * round(s.reward * BAR)}", file=out)
    if report.steps:
        first, last = report.steps[0].reward, report.steps[-1].reward
        trend = "rising" if report.reward_rising else "NOT rising"
        print(f"reward {first:.3f} -> {last:.3f} ({trend})", file=out)
    total = sum(s.moved for s in report.steps)
    whole = sum(s.from_trainer + s.from_peers for s in report.steps)
    deltas = sum(s.from_deltas for s in report.steps)
    peers = sum(s.from_peers for s in report.steps)
    share = 100 * peers / whole if whole else 0.0
    full = sum(s.bytes * len(s.fetches) for s in report.steps)  # every fetch read whole
    print(
        f"moved {total / MB:.1f} MB in {len(report.steps)} steps ({deltas / MB:.1f} MB of it "
        f"deltas; {full / MB:.0f} MB whole), {share:.0f}% of the whole chunks served by peers; "
        f"wall time {report.wall_s:.1f}s",
        file=out,
    )
    if report.killed:
        gone = report.killed_records_vanished_s
        print(
            f"{report.killed} was SIGKILLed mid-fetch; "
            + (
                f"its lease expired and its holder records vanished {gone:.1f}s later"
                if gone is not None
                else "its holder records did NOT vanish before the end"
            ),
            file=out,
        )
    verdict = "identical bytes everywhere" if report.all_verified else "BYTES DIFFERED"
    print(f"{verdict}; {'ok' if report.ok else 'FAILED'}", file=out)
    for error in report.errors:
        print(f"error: {error}", file=out)


def plot(report: Report, path: Path) -> None:
    """Stall and reward per step, as a PNG (needs matplotlib)."""
    reason = matplotlib_missing()
    if reason:
        raise InvalidArgument(reason)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [s.step for s in report.steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [s.trainer_stall_s for s in report.steps], marker="o", label="trainer stall")
    top.plot(steps, [s.rollout_stall_s for s in report.steps], marker="o", label="rollout stall")
    top.set_ylabel("seconds")
    top.legend()
    top.set_title(f"tensorhub demo: {report.config['rollouts']} rollouts, "
                  f"{report.config['model_mb']:g} MB model")  # fmt: skip
    bottom.plot(steps, [s.reward for s in report.steps], marker="o", color="green")
    bottom.set_ylabel("mean reward")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
