"""Invariant 4: a published, retained version stays fetchable while one holder of it lives.

A fetch of v that failed with `VersionUnavailable`, `VersionNotFound` or `IntegrityError` is
a violation when the history proves a healthy holder of v existed for the whole fetch, and v
was retained:

- a holder is a client that published v (acknowledged) or fetched it completely, from that
  moment until it began to release v or its incarnation ended;
- healthy: no fault aimed at it overlapped the fetch or the `session_ttl` before it (a
  lost session takes its records with it, legitimately), and no run-wide fault (hub, etcd)
  and no fault aimed at the reader itself did either;
- retained: fewer than `retain` newer versions may have been published (any publish not
  definitely failed counts) before the fetch ended.

Everything that could excuse the failure is given the benefit of the doubt, so what remains
is a version the system lost while it had every means to serve it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from chaos.checker import Facts, Violation
from chaos.history import FAIL, OK, Op

# What a reader gets when the system gave up on a version. `IntegrityError` is included: by
# its definition (tensorhub/errors.py) it means no holder had intact bytes, so it is false
# while a healthy holder had them.
LOST_ERRORS = ("VersionUnavailable", "VersionNotFound", "IntegrityError")


@dataclass(frozen=True)
class Hold:
    client: str
    version: int
    start: float
    end: float
    op: Op


def holds(facts: Facts) -> dict[int, list[Hold]]:
    """Who held which version from when to when, according to the history."""
    released: dict[tuple[str, int], float] = {}
    for op in facts.ops:
        if op.f == "release":
            key = (op.client, int(op.args["version"]))
            released[key] = min(released.get(key, op.invoke), op.invoke)
    out: dict[int, list[Hold]] = defaultdict(list)
    for op in facts.ops:
        if op.outcome != OK or op.f not in ("publish", "fetch") or op.complete is None:
            continue
        version = int(op.args["version"])
        life = facts.incarnations.get(op.client, (op.invoke, float("inf")))[1]
        end = min(released.get((op.client, version), float("inf")), life)
        out[version].append(Hold(op.client, version, op.complete, end, op))
    return out


def check_lost(facts: Facts) -> list[Violation]:
    all_holds = holds(facts)
    newer_publishes = sorted(
        (int(p.args["version"]), p.invoke)
        for p in facts.ops
        if p.f == "publish" and p.outcome != FAIL
    )
    out = []
    for op in facts.ops:
        if op.f != "fetch" or op.outcome != FAIL or op.complete is None:
            continue
        if not op.error.startswith(LOST_ERRORS):
            continue
        version = int(op.args["version"])
        newer = {v for v, t in newer_publishes if v > version and t <= op.complete}
        if len(newer) >= facts.retain:
            continue
        quiet_from = op.invoke - facts.session_ttl - 1.0
        if any(
            (f.scope == "global" or f.target == op.worker) and f.overlaps(quiet_from, op.complete)
            for f in facts.faults
        ):
            continue
        for hold in all_holds.get(version, []):
            if hold.client == op.client or hold.start > op.invoke or hold.end < op.complete:
                continue
            worker = hold.client.split("#", 1)[0]
            if any(
                f.scope == "holder" and f.target == worker and f.overlaps(quiet_from, op.complete)
                for f in facts.faults
            ):
                continue
            out.append(
                Violation(
                    "lost-version",
                    f"policy@{version} was unavailable although {hold.client} held it, "
                    "healthy, for the whole fetch",
                    [hold.op, op],
                )
            )
            break
    return out
