"""Resolve's candidate selection (`ros.hub.candidates.select_candidates`), pure: no etcd.

What it must keep: at most K holders; the caller's pipeline predecessor (what
`transport.planner.pipeline_sources` picks over *every* holder) always among them; nearest
tiers first; never the caller.
"""

from __future__ import annotations

import random

from consistency.records import HolderRecord, HolderState
from ros.hub.candidates import MAX_CANDIDATES, HolderSet, group_keys, select_candidates
from transport.planner import Candidate, Source, pipeline_sources
from transport.topology import Topology, distance


def record(
    name: str, fence: int, *, complete: bool = False, dc: str = "", rack: str = "", host: str = ""
) -> HolderRecord:
    labels = {k: v for k, v in (("dc", dc), ("rack", rack), ("host", host)) if v}
    state = HolderState.COMPLETE if complete else HolderState.PARTIAL
    return HolderRecord(name, {"tcp": "127.0.0.1:1"}, labels, state, 1, fence)


def topo(r: HolderRecord) -> Topology:
    return Topology(**r.topology)


def as_candidate(r: HolderRecord) -> Candidate:
    return Candidate(Source(r.holder, "127.0.0.1", 1, topo(r)), r.revision, r.complete)


def predecessor(me: HolderRecord, everyone: list[HolderRecord]) -> str | None:
    """What pipeline_sources picks for `me` when it sees every holder (today's Resolve)."""
    others = [as_candidate(h) for h in everyone if h.holder != me.holder]
    chosen = pipeline_sources(topo(me), me.revision, others)
    return chosen[0].holder_id if chosen else None


def test_a_chain_of_200_readers_each_sees_its_predecessor_within_k() -> None:
    holders = [record("trainer", 10, complete=True)]
    holders += [record(f"r{i:03d}", 100 + i) for i in range(200)]
    index = HolderSet(holders)
    for me in holders[1:]:
        chosen = select_candidates(index, me.topology, me.revision, me.holder)
        names = [h.holder for h in chosen]
        assert len(names) <= MAX_CANDIDATES
        assert me.holder not in names
        assert predecessor(me, holders) in names
        # planning over the candidates picks the same source as planning over everyone
        mine = pipeline_sources(topo(me), me.revision, [as_candidate(h) for h in chosen])
        assert [s.holder_id for s in mine] == [predecessor(me, holders)]


def test_with_several_complete_holders_the_chains_keep_their_predecessors() -> None:
    holders = [record(f"c{i}", 10 + i, complete=True) for i in range(5)]
    holders += [record(f"r{i:03d}", 100 + i) for i in range(150)]
    index = HolderSet(holders)
    for me in holders[5:]:
        chosen = select_candidates(index, me.topology, me.revision, me.holder)
        assert len(chosen) <= MAX_CANDIDATES
        mine = pipeline_sources(topo(me), me.revision, [as_candidate(h) for h in chosen])
        assert [s.holder_id for s in mine] == [predecessor(me, holders)]


def test_across_datacenters_readers_chain_inside_their_dc() -> None:
    """The cross-dc bench's shape: the trainer in dc1, readers in dc2, 400 of them."""
    holders = [record("trainer", 10, complete=True, dc="dc1", rack="a", host="t")]
    holders += [
        record(f"r{i:04d}", 100 + i, dc="dc2", rack=f"k{i % 4}", host=f"h{i}") for i in range(400)
    ]
    index = HolderSet(holders)
    for me in holders[1:]:
        chosen = select_candidates(index, me.topology, me.revision, me.holder)
        assert len(chosen) <= MAX_CANDIDATES
        expected = predecessor(me, holders)
        assert expected in [h.holder for h in chosen]
        if me.holder != "r0000":  # only dc2's first reader crosses the WAN
            assert expected != "trainer"


def test_nearest_tiers_come_first_and_the_caller_never() -> None:
    me = record("me", 500, dc="dc1", rack="r1", host="h1")
    rng = random.Random(7)
    holders = [me]
    for i in range(300):
        dc = rng.choice(["dc1", "dc2"])
        rack = rng.choice(["r1", "r2"])
        host = rng.choice(["h1", "h2", "h3"])
        holders.append(record(f"x{i:03d}", 100 + i * 2, complete=i % 7 == 0, dc=dc, rack=rack,
                              host=host))  # fmt: skip
    index = HolderSet(holders)
    chosen = select_candidates(index, me.topology, me.revision, me.holder)
    assert 0 < len(chosen) <= MAX_CANDIDATES
    assert "me" not in [h.holder for h in chosen]
    distances = [distance(topo(me), topo(h)) for h in chosen]
    assert distances == sorted(distances)
    assert distances[0] == 0  # same-host holders exist, so they lead
    assert set(distances) >= {0, 1, 2, 3}  # and a few alternates from every further tier
    # readers registered after the caller are no predecessors: none in the answer
    assert all(h.complete or h.revision < me.revision for h in chosen)


def test_an_unregistered_caller_gets_the_newest_holders() -> None:
    holders = [record("trainer", 1, complete=True)] + [record(f"r{i}", 10 + i) for i in range(50)]
    chosen = select_candidates(HolderSet(holders), {}, 0, "")
    names = [h.holder for h in chosen]
    assert names[0] == "trainer"  # complete holders first
    assert names[1:4] == ["r49", "r48", "r47"]  # then the newest readers


def test_the_index_follows_changes_of_state_and_removals() -> None:
    index = HolderSet([record("a", 5), record("b", 6)])
    index.put(record("a", 5, complete=True))  # PARTIAL -> COMPLETE: moves runs
    assert [h.holder for h in select_candidates(index, {}, 7, "")] == ["a", "b"]
    index.remove("a")
    index.remove("missing")  # nothing to do
    assert [h.holder for h in select_candidates(index, {}, 7, "")] == ["b"]
    assert len(index) == 1
    index.remove("b")
    assert not index.groups


def test_group_keys_are_the_planners_tiers() -> None:
    a = {"dc": "d", "rack": "r", "host": "h"}
    cases = {
        0: {"dc": "d", "rack": "r", "host": "h"},
        1: {"dc": "d", "rack": "r", "host": "x"},
        2: {"dc": "d", "rack": "x", "host": "h"},
        3: {"dc": "x", "rack": "r", "host": "h"},
    }
    for tier, b in cases.items():
        pairs = zip(group_keys(a), group_keys(b), strict=True)
        first_shared = next(i for i, (ka, kb) in enumerate(pairs) if ka == kb)
        assert first_shared == tier == distance(Topology(**a), Topology(**b))
