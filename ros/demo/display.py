"""The demo's live progress: one refreshing status line on a terminal, and one permanent
line per finished step (the only output when stdout is not a terminal)."""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

from ros.demo.config import TRAINER
from ros.demo.report import MB, Step


def short(name: str) -> str:
    """`rollout-3` -> `r3`, `trainer` -> `T`: keeps the flow lines short."""
    if name == TRAINER:
        return "T"
    return "r" + name.rsplit("-", 1)[-1] if name.startswith("rollout-") else name


def flows(step: Step) -> str:
    """Who fetched from whom: `r0<T 40.0MB  r1<r0 24.0MB+T 16.0MB (lost r3)  r2<delta 0.90MB`:
    a lost source is a holder that failed during this fetch (its chunks were re-planned); delta
    is the encoded changes of a delta version (from the trainer or peers)."""
    parts = []
    for reader in sorted(step.fetches):
        fetch = step.fetches[reader]
        got = "+".join(
            [f"{short(s)} {n / MB:.1f}MB"
             for s, n in sorted(fetch.sources.items(), key=lambda i: -i[1])]
            + ([f"delta {fetch.delta_bytes / MB:.2f}MB"] if fetch.delta_bytes else [])
        )  # fmt: skip
        lost = ",".join(short(s) for s in sorted(fetch.failed_sources))
        parts.append(f"{short(reader)}<{got or '-'}" + (f" (lost {lost})" if lost else ""))
    return "  ".join(parts)


class Display:
    def __init__(self, out: TextIO = sys.stdout, live: bool | None = None) -> None:
        self.out = out
        self.live = out.isatty() if live is None else live
        self._status = ""

    def status(self, text: str) -> None:
        """Replace the refreshing status line (terminals only)."""
        if not self.live:
            return
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        self._status = text[:width]
        self.out.write("\r\x1b[K" + self._status)
        self.out.flush()

    def line(self, text: str) -> None:
        """A permanent line (the status line is redrawn under it)."""
        if self.live:
            self.out.write("\r\x1b[K")
        self.out.write(text + "\n")
        if self.live and self._status:
            self.out.write(self._status)
        self.out.flush()

    def step_done(self, step: Step, steps: int) -> None:
        ok = "bytes ok" if step.verified else "BYTES DIFFER"
        moved = step.moved / MB
        killed = f"  [{step.killed} SIGKILLed mid-fetch]" if step.killed else ""
        self.line(
            f"step {step.step:>2}/{steps} v{step.version}  {flows(step)}  | {moved:.1f} MB in "
            f"{step.rollout_stall_s:.2f}s ({step.throughput_mbs:.0f} MB/s)  "
            f"stall T {step.trainer_stall_s:.2f}s  reward {step.reward:.3f}  {ok}{killed}"
        )

    def finish(self) -> None:
        if self.live:
            self.out.write("\r\x1b[K")
            self.out.flush()
        self._status = ""
