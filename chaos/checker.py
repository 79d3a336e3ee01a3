"""The history checker: the six invariants of docs/design.md ("Invariants"), proved or
refuted from a history.

Each check returns `Violation`s that name the operations proving them. Unknown outcomes
(`info`) are treated as "may or may not have happened": a write of unknown outcome may
explain a read, but never obliges one. Reads (`latest`) carry the etcd revision they were
served at, so visibility is checked by version and by revision.

1. torn reads: a fetched version's content hash equals the published one;
2. linearizable visibility: a `latest` that starts after `publish(v)` returned sees ≥ v
   (and a revision ≥ the publish's), and only versions some publish may have written; a
   watcher sees every acknowledged publish between the revision it started at and its last
   event (and, if it asked for versions only, nothing else);
3. monotonic reads: per client, `latest` (and watched versions) never go backwards;
4. nothing acknowledged is lost: `chaos.checker_lost`;
5. no hangs: every completed call ended within its deadline (plus `grace`);
6. isolation: no intruder probe was allowed.

Versions of the model-parallel workload (`MP_MODEL`) are checked by `chaos.checker_shards`:
1 there also means every visible version is whole (no version visible with a shard missing)
and every shard read has its rank's bytes; 2 and 3 hold for its `latest` as here; 4 covers
a shard left without holders, and a rank's retried shard publish that was refused. Blocks
read in a second layout (`chaos.layout_readers`) are held to the ranks' bytes by
`chaos.checker_layouts`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from chaos.checker_layouts import check_layouts
from chaos.checker_lost import check_lost
from chaos.checker_shards import check_shards
from chaos.facts import INVARIANTS, Facts, FaultWindow, Violation, stale_reads
from chaos.history import FAIL, INFO, MP_MODEL, OK, Op

__all__ = ["INVARIANTS", "Facts", "FaultWindow", "Violation", "check", "stale_reads"]


def check(facts: Facts) -> list[Violation]:
    """Run every check; violations are ordered by invariant."""
    found = [
        *check_torn(facts.ops),
        *check_shards(facts),
        *check_layouts(facts.ops),
        *check_visibility(facts.ops),
        *check_watch_gaps(facts.ops),
        *check_monotonic(facts.ops),
        *check_lost(facts),
        *check_deadlines(facts),
        *check_isolation(facts.ops),
    ]
    return sorted(found, key=lambda v: v.invariant)


def _publishes(ops: Iterable[Op]) -> dict[int, list[Op]]:
    by_version: dict[int, list[Op]] = defaultdict(list)
    for op in ops:
        if op.f == "publish":
            by_version[int(op.args["version"])].append(op)
    return by_version


def check_torn(ops: list[Op]) -> list[Violation]:
    """Every completed fetch of v has the content of the publish of v that took effect."""
    publishes = _publishes(ops)
    out = []
    for op in ops:
        if op.f != "fetch" or op.outcome != OK:
            continue
        version = int(op.value["version"])
        candidates = [p for p in publishes.get(version, []) if p.outcome == OK]
        candidates = candidates or [p for p in publishes.get(version, []) if p.outcome == INFO]
        if not any(p.args["hash"] == op.value["hash"] for p in candidates):
            what = "differs from every publish of it" if candidates else "was never published"
            out.append(
                Violation("torn-read", f"fetched policy@{version} {what}", [op, *candidates])
            )
    return out


def check_visibility(ops: list[Op]) -> list[Violation]:
    """Linearizable `latest` of the whole-version model: never older than a publish
    acknowledged before it began, and never a version that no publish may have written."""
    publishes = _publishes(ops)
    out, reads = [], []
    for op in ops:
        if op.f not in ("latest", "watch") or op.outcome != OK or model_of(op) == MP_MODEL:
            continue
        version = int(op.value["version"])
        if op.f == "latest":
            reads.append(op)
        if not version:
            continue
        possible = [
            p for p in publishes.get(version, []) if p.outcome != FAIL and p.invoke <= op.end
        ]
        if not possible:
            out.append(
                Violation(
                    "phantom-read",
                    f"{op.f} saw policy@{version}, which no publish may have written",
                    [op, *publishes.get(version, [])],
                )
            )
    acked = [p for p in ops if p.f == "publish" and p.outcome == OK]
    return out + stale_reads(reads, acked)


def model_of(op: Op) -> str:
    """The model an operation is about (watch events carry none: the whole-version one)."""
    return str(op.args.get("model", "policy"))


def check_watch_gaps(ops: list[Op]) -> list[Violation]:
    """Every acknowledged publish committed at a revision a watcher's stream covered was
    delivered to it. A watcher reopens a broken stream at the revision after its last event
    (`watch-open` records the start), so its coverage runs from its first open's revision to
    its last event; a RESYNC (after a compaction) excuses the revisions it jumped over."""
    acked = [(int(p.value["revision"]), p) for p in ops if p.f == "publish" and p.outcome == OK]
    by_client: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        if op.f in ("watch-open", "watch", "watch-resync", "watch-unwanted") and op.outcome == OK:
            by_client[op.client].append(op)
    out = []
    for client, mine in by_client.items():
        mine.sort(key=lambda o: (o.invoke, o.id))
        opens = [int(o.value["since"]) for o in mine if o.f == "watch-open"]
        events = [o for o in mine if o.f in ("watch", "watch-resync")]
        out += [
            Violation("watch-filter", f"{client} asked for versions only and got {o.value}", [o])
            for o in mine
            if o.f == "watch-unwanted"
        ]
        if not opens or not events:
            continue
        seen = {int(o.value["revision"]) for o in events if o.f == "watch"}
        excused: list[tuple[int, int]] = []
        previous = opens[0] - 1
        for o in events:
            revision = int(o.value["revision"])
            if o.f == "watch-resync":
                excused.append((previous, revision))
            previous = revision
        last = max(int(o.value["revision"]) for o in events)
        for revision, p in acked:
            if not opens[0] <= revision <= last or revision in seen:
                continue
            if any(lo < revision <= hi for lo, hi in excused):
                continue
            out.append(
                Violation(
                    "missed-watch",
                    f"{client} never saw policy@{p.args['version']} (revision {revision}), "
                    f"inside the range it watched ({opens[0]}..{last})",
                    [p],
                )
            )
    return out


def check_monotonic(ops: list[Op]) -> list[Violation]:
    """Per client: versions and revisions of `latest` never decrease; watched versions rise."""
    out = []
    last: dict[tuple[str, str, str], Op] = {}
    for op in sorted(ops, key=lambda o: o.end):
        if op.f not in ("latest", "watch") or op.outcome != OK:
            continue
        key = (op.client, op.f, model_of(op))
        prev = last.get(key)
        last[key] = op
        if prev is None:
            continue
        v0, v1 = int(prev.value["version"]), int(op.value["version"])
        r0, r1 = int(prev.value["revision"]), int(op.value["revision"])
        backwards = (v1 < v0 or r1 < r0) if op.f == "latest" else (v1 <= v0 or r1 <= r0)
        if backwards:
            out.append(
                Violation(
                    "non-monotonic",
                    f"{op.client} saw {op.f} go from {v0}@rev{r0} to {v1}@rev{r1}",
                    [prev, op],
                )
            )
    return out


def check_deadlines(facts: Facts) -> list[Violation]:
    """Every completed call returned (result or named error) by its deadline + grace.

    Calls of a process that was SIGSTOPped meanwhile are exempt: a frozen process cannot
    look at its clock.
    """
    out = []
    for op in facts.ops:
        if op.complete is None or op.timeout <= 0:
            continue
        took = op.complete - op.invoke
        if took <= op.timeout + facts.grace:
            continue
        frozen = any(
            f.name == "pause-holder" and f.target == op.worker and f.overlaps(op.invoke, op.end)
            for f in facts.faults
        )
        if not frozen:
            out.append(
                Violation(
                    "past-deadline",
                    f"{op.f} took {took:.2f}s with a {op.timeout:.1f}s deadline",
                    [op],
                )
            )
    return out


def check_isolation(ops: list[Op]) -> list[Violation]:
    """No probe of the other tenant's data, on the hub or a holder port, succeeded."""
    return [
        Violation("cross-tenant", f"probe {op.args.get('probe')}: {op.value.get('detail')}", [op])
        for op in ops
        if op.f == "probe" and op.outcome == OK and op.value.get("result") == "allowed"
    ]
