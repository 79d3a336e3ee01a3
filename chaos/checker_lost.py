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

Shards of model-parallel versions (`publish-shard`, `fetch-shard`) are checked the same way,
per shard: a fetch of shard i fails only when no healthy holder of shard i is left (its rank,
or a reader that fetched shard i). Holds, releases and retention are counted per model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from chaos.facts import Facts, Violation
from chaos.history import FAIL, OK, Op

# What a reader gets when the system gave up on a version. `IntegrityError` is included: by
# its definition (tensorhub/errors.py) it means no holder had intact bytes, so it is false
# while a healthy holder had them.
LOST_ERRORS = ("VersionUnavailable", "VersionNotFound", "IntegrityError")


PUBLISHES, FETCHES = ("publish", "publish-shard"), ("fetch", "fetch-shard")

# What a hold is of: (model, version, shard), the shard None for a whole version.
Part = tuple[str, int, int | None]


@dataclass(frozen=True)
class Hold:
    client: str
    version: int
    start: float
    end: float
    op: Op


def part_of(op: Op) -> Part:
    shard = op.args.get("shard")
    return (
        str(op.args.get("model", "policy")),
        int(op.args["version"]),
        (None if shard is None else int(shard)),
    )


def _what(part: Part) -> str:
    model, version, shard = part
    return f"{model}@{version}" if shard is None else f"shard {shard} of {model}@{version}"


def holds(facts: Facts) -> dict[Part, list[Hold]]:
    """Who held which version (or shard) from when to when, according to the history."""
    released: dict[tuple[str, str, int], float] = {}
    for op in facts.ops:
        if op.f == "release":
            model, version, _ = part_of(op)
            key = (op.client, model, version)  # a client holds one shard of a version
            released[key] = min(released.get(key, op.invoke), op.invoke)
    out: dict[Part, list[Hold]] = defaultdict(list)
    for op in facts.ops:
        if op.outcome != OK or op.f not in (*PUBLISHES, *FETCHES) or op.complete is None:
            continue
        part = part_of(op)
        life = facts.incarnations.get(op.client, (op.invoke, float("inf")))[1]
        end = min(released.get((op.client, part[0], part[1]), float("inf")), life)
        out[part].append(Hold(op.client, part[1], op.complete, end, op))
    return out


def check_lost(facts: Facts) -> list[Violation]:
    all_holds = holds(facts)
    newer_publishes = sorted(
        (part_of(p)[0], int(p.args["version"]), p.invoke)
        for p in facts.ops
        if p.f in PUBLISHES and p.outcome != FAIL
    )
    out = []
    for op in facts.ops:
        if op.f not in FETCHES or op.outcome != FAIL or op.complete is None:
            continue
        if not op.error.startswith(LOST_ERRORS):
            continue
        part = part_of(op)
        model, version, _ = part
        newer = {
            v for m, v, t in newer_publishes if m == model and v > version and t <= op.complete
        }
        if len(newer) >= facts.retain:
            continue
        quiet_from = op.invoke - facts.session_ttl - 1.0
        if any(
            (f.scope == "global" or f.target == op.worker) and f.overlaps(quiet_from, op.complete)
            for f in facts.faults
        ):
            continue
        for hold in all_holds.get(part, []):
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
                    f"{_what(part)} was unavailable although {hold.client} held it, "
                    "healthy, for the whole fetch",
                    [hold.op, op],
                )
            )
            break
    return out
