"""What the history checker reads and reports: the run's facts, its violations, and the
stale-read check that both the whole-version and the model-parallel checks use.

Apart from `chaos.checker` so that `chaos.checker_lost` and `chaos.checker_shards` build on
it without importing the checker that runs them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from chaos.history import Op

INVARIANTS = {
    "torn-read": 1,
    "partial-version": 1,
    "stale-read": 2,
    "phantom-read": 2,
    "missed-watch": 2,
    "watch-filter": 2,
    "non-monotonic": 3,
    "lost-version": 4,
    "shard-retry": 4,
    "past-deadline": 5,
    "cross-tenant": 6,
}


@dataclass(frozen=True)
class FaultWindow:
    """One injected fault: what, on whom, and from when to when (monotonic seconds)."""

    name: str
    scope: str  # holder | global | client
    target: str  # worker name (no incarnation) or a component ("hub 0")
    start: float
    end: float

    def overlaps(self, lo: float, hi: float) -> bool:
        return self.start <= hi and self.end >= lo


@dataclass
class Violation:
    kind: str
    message: str
    ops: list[Op] = field(default_factory=list)

    @property
    def invariant(self) -> int:
        return INVARIANTS[self.kind]

    def to_json(self, start: float = 0.0) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "invariant": self.invariant,
            "message": self.message,
            "ops": [op.brief(start) for op in self.ops],
        }


@dataclass
class Facts:
    """Everything the checker reads: the operations and what the run did around them."""

    ops: list[Op]
    faults: list[FaultWindow] = field(default_factory=list)
    incarnations: dict[str, tuple[float, float]] = field(default_factory=dict)
    retain: int = 2
    session_ttl: float = 5.0
    grace: float = 2.0


def stale_reads(reads: list[Op], acked: list[Op]) -> list[Violation]:
    """`latest` reads that returned a version, or a revision, older than one of `acked` (the
    publishes that moved `latest`, with their commit revision) had before the read began."""
    acked = sorted(acked, key=lambda p: p.end)
    ends = [p.end for p in acked]
    best: list[Op] = []  # best[i]: the highest acknowledged publish among acked[: i + 1]
    for p in acked:
        if not best or int(p.args["version"]) > int(best[-1].args["version"]):
            best.append(p)
        else:
            best.append(best[-1])
    by_revision: list[Op] = []
    for p in acked:
        newer = not by_revision or int(p.value["revision"]) > int(by_revision[-1].value["revision"])
        by_revision.append(p if newer else by_revision[-1])
    out = []
    for op in reads:
        version, revision = int(op.value["version"]), int(op.value["revision"])
        i = bisect.bisect_left(ends, op.invoke) - 1
        if i < 0:
            continue
        top, newest = best[i], by_revision[i]
        if version < int(top.args["version"]):
            out.append(
                Violation(
                    "stale-read",
                    f"latest returned {version} after publish of {top.args['version']} "
                    "had returned",
                    [top, op],
                )
            )
        elif revision < int(newest.value["revision"]):
            out.append(
                Violation(
                    "stale-read",
                    f"latest answered at revision {revision}, older than publish revision "
                    f"{newest.value['revision']} acknowledged before it began",
                    [newest, op],
                )
            )
    return out
