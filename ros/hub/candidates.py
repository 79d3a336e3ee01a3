"""Resolve's candidate holders: a bounded, topology-ordered selection, as a pure function.

A reader needs few sources: its pipeline predecessor (`transport.planner.pipeline_sources`
picks the holder registered just before it in its nearest tier, or a complete one), and a few
alternates for failover. `select_candidates` answers at most `MAX_CANDIDATES` of them from a
`HolderSet`: per topology group (same host, rack, dc, anywhere) the records sorted by fence,
complete holders apart from partial ones, so a query walks a few sorted runs, O(K log N).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping

from consistency.records import HolderRecord

MAX_CANDIDATES = 32  # holders one Resolve (or PARTIAL RegisterHolder) answers, at most
NEAR_COMPLETE = 12  # complete holders, newest first, from the caller's nearest tier
NEAR_BEFORE = 12  # holders registered just before the caller, from its nearest tier
FAR_COMPLETE = 2  # per further tier, for failover
FAR_BEFORE = 2
SCAN_LIMIT = 4 * MAX_CANDIDATES  # entries one sorted run is walked for, at most

Tier = tuple[str, ...]
_Entry = tuple[int, str]  # (fence, holder name): the sort order of a run


def group_keys(topology: Mapping[str, str]) -> tuple[Tier, Tier, Tier, Tier]:
    """The groups a holder at `topology` is found in, nearest first: same host, same rack,
    same dc, anywhere (one per `transport.topology.distance` tier, as the planner's)."""
    dc, rack, host = (topology.get(k, "") for k in ("dc", "rack", "host"))
    return ((dc, rack, host), (dc, rack), (dc,), ())


class _Group:
    """The holders of one topology group: two runs sorted by fence."""

    __slots__ = ("complete", "partial")

    def __init__(self) -> None:
        self.complete: list[_Entry] = []
        self.partial: list[_Entry] = []

    def run(self, complete: bool) -> list[_Entry]:
        return self.complete if complete else self.partial


class HolderSet:
    """The live holder records of one version (or of one shard of a model-parallel one)."""

    def __init__(self, records: Iterable[HolderRecord] = ()) -> None:
        self.records: dict[str, HolderRecord] = {}
        self.groups: dict[Tier, _Group] = {}
        for record in records:
            self.put(record)

    def __len__(self) -> int:
        return len(self.records)

    def put(self, record: HolderRecord) -> None:
        """Add or replace a holder's record (its fence is `record.revision`)."""
        self.remove(record.holder)
        self.records[record.holder] = record
        entry = (record.revision, record.holder)
        for key in group_keys(record.topology):
            bisect.insort(self.groups.setdefault(key, _Group()).run(record.complete), entry)

    def remove(self, name: str) -> None:
        record = self.records.pop(name, None)
        if record is None:
            return
        entry = (record.revision, record.holder)
        for key in group_keys(record.topology):
            group = self.groups[key]
            run = group.run(record.complete)
            at = bisect.bisect_left(run, entry)
            if at < len(run) and run[at] == entry:
                del run[at]
            if not group.complete and not group.partial:
                del self.groups[key]


def _walk(run: list[_Entry], below: int) -> Iterator[_Entry]:
    """A run's entries with fence < `below` (0: no bound), highest fence first."""
    end = len(run) if below <= 0 else bisect.bisect_left(run, (below, ""))
    for at in range(end - 1, max(end - SCAN_LIMIT, 0) - 1, -1):
        yield run[at]


def select_candidates(
    holders: HolderSet,
    topology: Mapping[str, str],
    fence: int = 0,
    exclude: str = "",
    k: int = MAX_CANDIDATES,
) -> list[HolderRecord]:
    """At most `k` holders for a reader at `topology` registered at `fence` (0: not yet).

    Tier by tier, nearest first (same host, rack, dc, anywhere; a tier holds only holders
    not in a nearer one). In the caller's nearest tier that has any: the newest complete
    holders (`NEAR_COMPLETE`) and the holders registered just before the caller, highest
    fence first (`NEAR_BEFORE`). Those are what `transport.planner.pipeline_sources` ranks
    (complete holders, newest first, and the readers before the caller), so the caller's
    pipeline predecessor is among them. Then `FAR_COMPLETE` + `FAR_BEFORE` from each further
    tier, for failover. Never the caller itself (`exclude`).
    """
    mine = group_keys(topology)
    chosen: list[HolderRecord] = []
    seen = {exclude}
    near = True
    for level, key in enumerate(mine):
        group = holders.groups.get(key)
        if group is None:
            continue
        closer = mine[level - 1] if level else None
        picked = 0
        quotas = ((True, NEAR_COMPLETE), (False, NEAR_BEFORE)) if near else (
            (True, FAR_COMPLETE), (False, FAR_BEFORE),
        )  # fmt: skip
        for complete, quota in quotas:
            taken = 0
            for _, name in _walk(group.run(complete), 0 if complete else fence):
                if taken >= quota or len(chosen) >= k:
                    break
                record = holders.records[name]
                if name in seen or (
                    closer is not None and group_keys(record.topology)[level - 1] == closer
                ):
                    continue  # the caller itself, or a holder of a nearer tier
                seen.add(name)
                chosen.append(record)
                taken += 1
            picked += taken
        if picked:
            near = False
        if len(chosen) >= k:
            break
    return chosen
