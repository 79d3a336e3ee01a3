"""The checks of model-parallel versions (`chaos.shards`): whole versions, ranks' bytes, and
idempotent retries.

A version of `MP_MODEL` has n shards (`shards` in every `publish-shard`), and must become
visible only with all n: the hub moves `latest` with the last rank's publish.

- `partial-version` (invariant 1): a version was seen visible — `latest` returned it, a
  shard publish said it made it visible, `inspect-shards`, `fetch-shard` or a layout
  reader's `fetch-layout` read it — at a
  time when some shard of it had no publish that may have happened yet (none invoked, or
  all that were definitely failed); or the hub's inspection of a visible version named
  another shard count or fewer manifests than it has shards; or a read of it failed because
  its shard records are missing (`PARTIAL_ERRORS`). A version whose rank died is allowed
  never to become visible: only what was seen is checked.
- `torn-read` (invariant 1): a fetched shard's content hash is not the one rank i published
  for that version (an acknowledged publish; else one of unknown outcome), or it is another
  shard than the one asked for.
- `stale-read` (invariant 2): `latest` older than a shard publish that made its version
  visible and was acknowledged before the read began (`chaos.facts.stale_reads`).
- `shard-retry` (invariant 4): a rank sent a shard again — the same version, index and
  bytes, after a publish of it that may have landed (one of unknown outcome, one
  acknowledged, or one cut short by the rank's death) — and the retry was refused with
  anything but `StaleVersion` (the version was visible already) while no run-wide fault, and
  no fault aimed at the rank, was under way. A retried shard publish must be idempotent: a
  refused one leaves the shard with no live holder once the first publisher's session is
  gone, and the version unreadable though the rank holds the bytes.

Monotonic reads (3), lost shards (4) and deadlines (5) are checked by the general checks.
"""

from __future__ import annotations

from collections import defaultdict

from chaos.facts import Facts, Violation, stale_reads
from chaos.history import FAIL, INFO, MP_MODEL, OK, Op

# Errors that only a visible version with missing shard records can cause (consistency/
# manifests.py); retention deletes a version's header and its shards in one transaction.
PARTIAL_ERRORS = ("inconsistent shard records", "has no record of shard")
SEEN = ("latest", "publish-shard", "inspect-shards", "fetch-shard", "fetch-layout")


def check_shards(facts: Facts) -> list[Violation]:
    ops = [op for op in facts.ops if op.args.get("model") == MP_MODEL]
    return [
        *check_whole(ops),
        *check_shard_bytes(ops),
        *check_shard_visibility(ops),
        *check_retries(facts, ops),
    ]


def _shard_publishes(ops: list[Op]) -> dict[tuple[int, int], list[Op]]:
    out: dict[tuple[int, int], list[Op]] = defaultdict(list)
    for op in ops:
        if op.f == "publish-shard":
            out[(int(op.args["version"]), int(op.args["shard"]))].append(op)
    return out


def seen_visible(op: Op) -> int:
    """The model-parallel version `op` proves visible when it ended (0: none)."""
    if op.outcome != OK or op.f not in SEEN or op.args.get("model") != MP_MODEL:
        return 0
    if op.f == "publish-shard" and not op.value.get("visible"):
        return 0
    return int(op.value.get("version", 0))


def check_whole(ops: list[Op]) -> list[Violation]:
    """No version was seen visible before every one of its shards may have been published."""
    publishes = _shard_publishes(ops)
    counts: dict[int, int] = {}
    for (version, _), pubs in publishes.items():
        counts[version] = max(counts.get(version, 0), *(int(p.args["shards"]) for p in pubs))
    out: list[Violation] = []
    reported: set[int] = set()
    for op in sorted(ops, key=lambda o: o.end):
        version = seen_visible(op)
        if op.f in ("fetch-shard", "inspect-shards") and op.outcome == FAIL:
            if any(text in op.error for text in PARTIAL_ERRORS):
                out.append(
                    Violation(
                        "partial-version",
                        f"{op.f} of {MP_MODEL}@{op.args['version']} found shard records "
                        f"missing: {op.error}",
                        [op],
                    )
                )
            continue
        if not version or version in reported:
            continue
        n = counts.get(version, 0)
        missing = [
            i
            for i in range(n)
            if not any(p.outcome != FAIL and p.invoke <= op.end for p in publishes[(version, i)])
        ]
        if not n or missing:
            reported.add(version)
            which = f"shard(s) {missing} of its {n}" if n else "none of its shards"
            tried = [p for i in missing for p in publishes[(version, i)]]
            out.append(
                Violation(
                    "partial-version",
                    f"{op.f} saw {MP_MODEL}@{version} visible, but {which} had no publish "
                    "that may have happened by then",
                    [op, *tried],
                )
            )
        elif op.f == "inspect-shards" and not (
            int(op.value["shard_count"]) == int(op.value["manifests"]) == n
        ):
            reported.add(version)
            out.append(
                Violation(
                    "partial-version",
                    f"inspect of {MP_MODEL}@{version} answered shard count "
                    f"{op.value['shard_count']} and {op.value['manifests']} manifests; its ranks "
                    f"published {n} shards",
                    [op],
                )
            )
    return out


def check_shard_bytes(ops: list[Op]) -> list[Violation]:
    """Every shard fetched has the bytes its rank published for that version."""
    publishes = _shard_publishes(ops)
    out = []
    for op in ops:
        if op.f != "fetch-shard" or op.outcome != OK:
            continue
        version, shard = int(op.value["version"]), int(op.args["shard"])
        what = f"shard {shard} of {MP_MODEL}@{version}"
        if int(op.value["shard"]) != shard:
            out.append(
                Violation("torn-read", f"asked for {what}, got shard {op.value['shard']}", [op])
            )
            continue
        mine = publishes.get((version, shard), [])
        candidates = [p for p in mine if p.outcome == OK] or [p for p in mine if p.outcome == INFO]
        if not any(p.args["hash"] == op.value["hash"] for p in candidates):
            how = "differs from what its rank published" if candidates else "was never published"
            out.append(Violation("torn-read", f"fetched {what} {how}", [op, *candidates]))
    return out


def check_shard_visibility(ops: list[Op]) -> list[Violation]:
    """`latest` of the model-parallel model is never older than a version that an
    acknowledged shard publish made visible before the read began."""
    reads = [op for op in ops if op.f == "latest" and op.outcome == OK]
    movers = [
        op for op in ops if op.f == "publish-shard" and op.outcome == OK and op.value["visible"]
    ]
    return stale_reads(reads, movers)


def check_retries(facts: Facts, ops: list[Op]) -> list[Violation]:
    """A rank's shard publish sent again after one that may have landed was not refused."""
    publishes = _shard_publishes(ops)
    out = []
    for pubs in publishes.values():
        for retry in pubs:
            if retry.outcome == OK or retry.complete is None:  # done, or cut short by a kill
                continue
            if retry.error.startswith("StaleVersion"):
                continue
            earlier = [
                p
                for p in pubs
                if p is not retry
                and p.outcome != FAIL
                and p.args["hash"] == retry.args["hash"]
                and p.invoke < retry.invoke
                and (p.complete is None or p.complete <= retry.invoke)
            ]
            if not earlier:
                continue
            if any(
                (f.scope == "global" or f.target == retry.worker)
                and f.overlaps(retry.invoke, retry.end)
                for f in facts.faults
            ):
                continue
            out.append(
                Violation(
                    "shard-retry",
                    f"{retry.client} sent shard {retry.args['shard']} of "
                    f"{MP_MODEL}@{retry.args['version']} again (same bytes) after a publish "
                    f"of it that may have landed, and it was refused: {retry.error}",
                    [earlier[-1], retry],
                )
            )
    return out
