"""Check a saved run again: rebuild the checker's facts from a `--json` report.

The report holds the whole history, the fault windows and the process log, so a changed or
stricter checker can be run over old runs (`tensorhub chaos check REPORT.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from chaos.checker import Facts, FaultWindow, Violation, check
from chaos.history import Op


def facts_from_report(path: Path) -> tuple[Facts, float]:
    """The facts of a saved run, and its start time (to print times relative to it)."""
    data = json.loads(path.read_text())
    start = float(data["start"])
    fields = ("id", "client", "f", "invoke", "timeout", "args", "outcome", "complete",
              "value", "error")  # fmt: skip
    ops = [Op(*(o[k] for k in fields)) for o in data["history"]]
    faults = [
        FaultWindow(f["name"], f["scope"], f["target"], start + f["start"], start + f["end"])
        for f in data["faults"]
        if not f["error"] or f["error"].startswith("recover")
    ]
    end = max((o.complete or o.invoke for o in ops), default=start)
    incarnations = {
        i["client"]: (float(i["started"]), float(i["ended"] or end)) for i in data["incarnations"]
    }
    return Facts(ops, faults, incarnations), start


def recheck(path: Path) -> tuple[list[Violation], float]:
    facts, start = facts_from_report(path)
    return check(facts), start
