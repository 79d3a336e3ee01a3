"""Figures, results and the human table every benchmark prints.

A figure is a ratio measured in one run against a baseline or a ceiling on the same
machine, with its target. A benchmark whose links were not saturated by a plain-socket run
(`Saturation.saturated` false) withholds its ratios: `value` is None and `note` says why.
"""

from __future__ import annotations

import json
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}


@dataclass
class Figure:
    """One reported figure: `value` compared with `target` (e.g. `<= 1.3`; '' = none)."""

    name: str
    value: float | None
    target: str = ""
    unit: str = ""

    @property
    def ok(self) -> bool | None:
        if self.value is None or not self.target:
            return None
        op, bound = self.target.split()
        return _OPS[op](self.value, float(bound))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class Result:
    """A benchmark's outcome: its figures, the command that reproduces it, and details."""

    bench: str
    command: str
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    seconds: float = 0.0

    def add(self, name: str, value: float | None, target: str = "", unit: str = "") -> None:
        self.figures.append(Figure(name, None if value is None else round(value, 3), target, unit))

    def withhold(self, why: str) -> None:
        """Links were not saturated: keep the raw details, drop every ratio."""
        self.note = f"ratios withheld: {why}"
        for f in self.figures:
            if not f.unit:
                f.value = None

    @property
    def ok(self) -> bool:
        return not self.note and all(f.ok is not False for f in self.figures)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "command": self.command,
            "ok": self.ok,
            "note": self.note,
            "seconds": round(self.seconds, 1),
            "figures": [f.to_dict() for f in self.figures],
            "details": self.details,
        }


def table(results: Sequence[Result]) -> str:
    """The human table: one row per figure, with its target and verdict."""
    rows = [("bench", "figure", "value", "target", "verdict")]
    for r in results:
        for f in r.figures:
            value = "—" if f.value is None else f"{f.value:g}{(' ' + f.unit) if f.unit else ''}"
            verdict = {True: "OK", False: "MISSED", None: ""}[f.ok]
            rows.append((r.bench, f.name, value, f.target, verdict))
        if r.note:
            rows.append((r.bench, r.note, "", "", "WITHHELD"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown(results: Sequence[Result]) -> str:
    """The same table in Markdown, with the command that reproduces each benchmark."""
    out = ["| bench | figure | value | target | verdict | reproduce |", "|---|---|---|---|---|---|"]
    for r in results:
        for f in r.figures:
            value = "—" if f.value is None else f"{f.value:g}{(' ' + f.unit) if f.unit else ''}"
            verdict = {True: "OK", False: "MISSED", None: ""}[f.ok]
            row = (r.bench, f.name, value, f.target, verdict, f"`{r.command}`")
            out.append("| " + " | ".join(row) + " |")
        if r.note:
            out.append(f"| {r.bench} | {r.note} | | | WITHHELD | `{r.command}` |")
    return "\n".join(out)


def emit(results: Sequence[Result], path: str | None) -> int:
    """Print the results' table and, with `path`, write them as a JSON report (`-`: to
    stdout); the exit code a benchmark command returns (0 only if every result is ok)."""
    print(table(results))
    ok = all(r.ok for r in results)
    if path:
        report = {
            "generated_unix": time.time(),
            "ok": ok,
            "results": [r.to_dict() for r in results],
        }
        text = json.dumps(report, indent=2, default=str)
        if path == "-":
            print(text)
        else:
            Path(path).write_text(text)
    return 0 if ok else 1
