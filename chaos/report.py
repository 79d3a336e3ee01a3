"""The report of a chaos run: a human summary, and the full record as JSON.

The summary lists the faults injected with their times, the operations by kind and outcome,
what each invariant was checked against, and every violation with the operations that prove
it. The JSON has all of that plus the whole history.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from chaos.checker import INVARIANTS
from chaos.checker_layouts import layout_counts, layout_warning
from chaos.checker_shards import seen_visible
from chaos.deltas import applied, delta_counts
from chaos.history import OK
from chaos.runner import FaultRecord, RunResult

SHOWN_PER_KIND = 5
INVARIANT_NAMES = {
    1: "no torn reads",
    2: "linearizable visibility",
    3: "monotonic reads",
    4: "nothing acknowledged is lost",
    5: "no hangs (deadlines)",
    6: "isolation",
}


def op_counts(result: RunResult) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for op in result.ops:
        counts[op.f][op.outcome] += 1
        if op.f == "probe" and op.outcome == OK:
            counts[op.f][f"probe:{op.value.get('result')}"] += 1
    return {f: dict(sorted(c.items())) for f, c in sorted(counts.items())}


def checked(result: RunResult) -> dict[str, int]:
    """How much evidence each invariant was checked against."""
    ok = [op for op in result.ops if op.outcome == OK]
    return {
        "fetches compared with published content (1)": sum(op.f == "fetch" for op in ok),
        "latest reads checked for visibility (2, 3)": sum(op.f == "latest" for op in ok),
        "watch events checked (2, 3)": sum(op.f == "watch" for op in ok),
        "acknowledged publishes": sum(op.f == "publish" for op in ok),
        "failed fetches examined for loss (4)": sum(
            op.f == "fetch" and op.outcome == "fail" for op in result.ops
        ),
        "completed calls checked against deadlines (5)": sum(
            op.complete is not None and op.timeout > 0 for op in result.ops
        ),
        "cross-tenant probes refused (6)": sum(
            op.f == "probe" and op.value.get("result") == "refused" for op in ok
        ),
        **(_sharded(result) if result.config.ranks else {}),
        **(layout_counts(result.ops) if _layout_readers(result) else {}),
        **(_delta_checked(result) if _deltas(result) else {}),
    }


def _delta_checked(result: RunResult) -> dict[str, int]:
    """The delta reads' evidence (chaos.deltas), and how many ran while a fault was on."""
    counts = {f"{k} (1)": v for k, v in delta_counts(result.ops).items()}
    used = [op for op in result.ops if op.f == "fetch" and op.outcome == OK and applied(op)]
    during = sum(
        any(f.start <= op.end and f.end >= op.invoke for f in result.faults if not f.error)
        for op in used
    )
    out = {}
    for key, value in counts.items():
        out[key] = value
        if key.startswith("fetches that applied a delta"):
            out["of those, while a fault was injected (1)"] = during
    return out


def _deltas(result: RunResult) -> bool:
    """Whether the run's whole-version workload published and read with deltas."""
    return result.config.delta and bool(result.config.publishers and result.config.readers)


def delta_warning(result: RunResult) -> str:
    """A warning when a run meant to exercise deltas never applied one ("" otherwise): its
    reads were all whole, so it proved nothing about delta reads."""
    if not _deltas(result) or any(
        op.f == "fetch" and op.outcome == OK and applied(op) for op in result.ops
    ):
        return ""
    return (
        "WARNING: no fetch applied a delta; every read of this run was whole, so it checked "
        "nothing about delta reads"
    )


def _layout_readers(result: RunResult) -> int:
    """How many layout readers the run had (they run with ranks only)."""
    return result.config.layout_readers if result.config.ranks else 0


def warnings(result: RunResult) -> list[str]:
    """The run's warnings: evidence a run was meant to gather and did not."""
    found = (delta_warning(result), layout_warning(result.ops, _layout_readers(result)))
    return [w for w in found if w]


def _sharded(result: RunResult) -> dict[str, int]:
    """The evidence of the model-parallel workload's checks (chaos.checker_shards)."""
    ok = [op for op in result.ops if op.outcome == OK]
    sent = [op for op in result.ops if op.f == "publish-shard"]
    return {
        "acknowledged shard publishes": sum(op.f == "publish-shard" for op in ok),
        "shard publishes sent again, same bytes (4)": len(sent)
        - len({(op.args["version"], op.args["shard"]) for op in sent}),
        "model-parallel versions seen visible, checked whole (1)": len(
            {seen_visible(op) for op in result.ops} - {0}
        ),
        "shard fetches compared with their rank's bytes (1)": sum(
            op.f == "fetch-shard" for op in ok
        ),
        "failed shard fetches examined for loss (4)": sum(
            op.f == "fetch-shard" and op.outcome == "fail" for op in result.ops
        ),
    }


def summary(result: RunResult) -> str:
    c = result.config
    lines = [
        f"chaos run: seed {c.seed}, {c.duration:.0f}s, "
        f"planted bug: {c.planted or 'none'}, work dir {result.workdir}",
        *(
            ["delta versions: publishers publish with delta=True; readers apply them"]
            if _deltas(result)
            else []
        ),
        *(
            [
                f"model-parallel workload: {c.ranks} ranks, {c.shard_readers} shard readers, "
                f"{c.layout_readers} layout readers"
            ]
            if c.ranks
            else []
        ),
        "",
        "faults injected:",
    ]
    for f in result.faults:
        span = f"{f.start - result.start:7.2f}s .. {f.end - result.start:7.2f}s"
        note = f"  ({f.error})" if f.error else ""
        lines.append(f"  {span}  {f.name:<17} {f.target}{note}")
    if not result.faults:
        lines.append("  (none)")
    for name, reason in sorted(result.skipped.items()):
        lines.append(f"  skipped {name}: {reason}")
    lines += ["", "operations (kind: outcome counts):"]
    for kind, counts in op_counts(result).items():
        lines.append(f"  {kind:<12} " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    restarts = [i for i in result.incarnations if i["how"] and i["how"] != "exit 0"]
    if restarts:
        lines += ["", "processes that did not end normally:"]
        lines += [f"  {i['client']}: {i['how']}" for i in restarts]
    lines += ["", "checked:"]
    lines += [f"  {k}: {v}" for k, v in checked(result).items()]
    for warning in warnings(result):
        lines += ["", warning]
    lines += ["", f"violations: {len(result.violations)}"]
    shown: Counter[str] = Counter()
    for v in result.violations:
        shown[v.kind] += 1
        if shown[v.kind] == SHOWN_PER_KIND + 1:
            more = sum(x.kind == v.kind for x in result.violations) - SHOWN_PER_KIND
            lines.append(f"  ... {more} more {v.kind} (all of them are in the JSON report)")
        if shown[v.kind] > SHOWN_PER_KIND:
            continue
        lines.append(f"  [{v.invariant}: {INVARIANT_NAMES[v.invariant]}] {v.kind}: {v.message}")
        lines += [f"      {op.brief(result.start)}" for op in v.ops]
    return "\n".join(lines)


def to_json(result: RunResult) -> dict[str, Any]:
    c = result.config
    return {
        "seed": c.seed,
        "duration": c.duration,
        "planted": c.planted,
        "cluster": result.cluster,
        "faults": [_fault_json(f, result.start) for f in result.faults],
        "skipped": result.skipped,
        "operations": op_counts(result),
        "checked": checked(result),
        "delta": c.delta,
        "warnings": warnings(result),
        "invariants": {str(k): v for k, v in INVARIANT_NAMES.items()},
        "violation_kinds": INVARIANTS,
        "violations": [v.to_json(result.start) for v in result.violations],
        "incarnations": result.incarnations,
        "history": [op.to_json() for op in result.ops],
        "start": result.start,
    }


def _fault_json(f: FaultRecord, start: float) -> dict[str, Any]:
    return {
        "name": f.name,
        "scope": f.scope,
        "target": f.target,
        "start": f.start - start,
        "end": f.end - start,
        "error": f.error,
    }


def write_json(result: RunResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(result), indent=1))
