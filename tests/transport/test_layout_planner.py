"""Unit tests: layout packing and chunking, topology ranking, planning and re-planning."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import InvalidArgument
from transport.kinds import TransportKind
from transport.layout import ALIGN, Layout
from transport.planner import (
    Candidate,
    ChunkScheduler,
    Source,
    pipeline_plan,
    pipeline_sources,
    plan,
    rank,
)
from transport.registry import available_transports
from transport.topology import Topology, distance

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
tensor_dicts = st.dictionaries(
    st.text("abcdefgh.", min_size=1, max_size=6),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), max_size=3)),
    max_size=40,
).map(lambda d: {k: torch.zeros(shape, dtype=dt) for k, (dt, shape) in d.items()})


@settings(max_examples=60, deadline=None)
@given(tensor_dicts, st.sampled_from([4096, 8192]))
def test_layout_packs_aligned_and_chunks_cover_every_byte_once(
    tensors: dict[str, torch.Tensor], chunk: int
) -> None:
    layout = Layout.from_tensors(tensors, chunk_size=chunk)
    end = 0
    for spec in layout.tensors:
        assert spec.offset % ALIGN == 0
        assert spec.offset >= end
        assert spec.offset - end < ALIGN  # packed: no gap beyond alignment
        end = spec.offset + spec.nbytes
    covered = dict.fromkeys(range(len(layout.tensors)), 0)
    for c in layout.chunks():
        assert c.offset == c.index * chunk
        assert 0 < c.length <= chunk
        for seg in layout.segments(c.index):
            assert seg.start == covered[seg.tensor]  # in order, no overlap, no hole
            covered[seg.tensor] += seg.length
    assert all(covered[i] == s.nbytes for i, s in enumerate(layout.tensors))
    again = Layout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout
    assert again.digest == layout.digest


def test_many_tiny_tensors_share_chunks() -> None:
    tensors = {f"n{i}": torch.zeros(8) for i in range(2000)}
    layout = Layout.from_tensors(tensors)
    assert layout.num_chunks == 1  # 2,000 tensors, one round trip


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        Layout((), 0, chunk_size=1000)
    with pytest.raises(InvalidArgument, match="dtype"):
        Layout.from_dict(
            {
                "total_bytes": 4,
                "chunk_size": 4096,
                "tensors": [{"name": "a", "dtype": "evil", "shape": [1], "offset": 0, "nbytes": 4}],
            }
        )
    with pytest.raises(InvalidArgument, match="malformed"):
        Layout.from_dict({"tensors": 3})
    layout = Layout.from_tensors({"a": torch.zeros(4)})
    with pytest.raises(InvalidArgument, match="dtype"):
        layout.check_tensors({"a": torch.zeros(4, dtype=torch.int32)})
    with pytest.raises(InvalidArgument, match="contiguous"):
        layout.check_tensors({"a": torch.zeros(4, 2).t()[0]})
    with pytest.raises(InvalidArgument, match="extra"):
        layout.check_tensors({"a": torch.zeros(4), "b": torch.zeros(1)})


def test_distance_and_rank() -> None:
    me = Topology("dc1", "r1", "h1")
    assert distance(me, me) == 0
    assert distance(me, Topology("dc1", "r1", "h2")) == 1
    assert distance(me, Topology("dc1", "r2", "h1")) == 2
    assert distance(me, Topology("dc2", "r1", "h1")) == 3
    srcs = [
        Source("far", "x", 1, Topology("dc2", "r1", "h9")),
        Source("rack", "x", 1, Topology("dc1", "r1", "h2")),
        Source("dc", "x", 1, Topology("dc1", "r7", "h3")),
        Source("local", "x", 1, Topology("dc1", "r1", "h1")),
    ]
    assert [s.holder_id for s in rank(me, srcs)] == ["local", "rack", "dc", "far"]
    assert set(plan(range(10), lambda i: 1, srcs, me)) == {"local"}


@given(st.lists(st.integers(0, 5), min_size=1, max_size=5), st.integers(1, 200))
def test_plan_spreads_bytes_by_load(loads: list[int], n: int) -> None:
    srcs = [Source(f"h{i}", "x", 1, Topology(), load) for i, load in enumerate(loads)]
    out = plan(range(n), lambda i: 10, srcs, Topology())
    assert sorted(c for cs in out.values() for c in cs) == list(range(n))
    weighted = [len(out[s.holder_id]) * (1 + s.load) for s in srcs]
    assert max(weighted) - min(weighted) <= 2 * (1 + max(loads))  # balanced within a chunk


def test_fail_replans_only_unfinished_chunks() -> None:
    srcs = [Source("a", "x", 1), Source("b", "x", 1), Source("c", "x", 1)]
    sched = ChunkScheduler(list(range(30)), lambda i: 1, srcs, Topology())
    taken = sched.take("a", 4, 0)
    for i in taken[:2]:
        sched.finished(i)
    sched.fail("a", taken[2:], ConnectionError("boom"))
    assert sched.live() == ["b", "c"]
    queued = sorted(sched.queued("b") + sched.queued("c"))
    assert queued == sorted(set(range(30)) - set(taken[:2]))
    assert not set(taken[:2]) & set(sched.remaining())


def test_idle_holder_steals_and_far_holder_does_not() -> None:
    me = Topology("dc1")
    srcs = [Source("near", "x", 1, me), Source("far", "x", 1, Topology("dc2"))]
    sched = ChunkScheduler(list(range(10)), lambda i: 1, srcs, me)
    assert sched.take("far", 4, 0) == []  # never steals from a nearer holder
    pair = [srcs[0], Source("n2", "x", 1, me)]
    sched2 = ChunkScheduler(list(range(10)), lambda i: 1, pair, me)
    own = sched2.take("near", 5, 0)
    assert len(own) == 5
    before = sched2.queued("n2")
    stolen = sched2.take("near", 5, 0)  # own queue empty: takes half of n2's, from the back
    assert stolen
    assert set(stolen) <= set(before)
    assert sorted(sched2.queued("n2") + stolen) == sorted(before)


def test_available_transports_ends_with_tcp() -> None:
    kinds = available_transports()
    assert kinds[-1] is TransportKind.TCP
    assert kinds.count(TransportKind.TCP) == 1


def _cand(name: str, fence: int, complete: bool, dc: str = "dc1", rack: str = "r0") -> Candidate:
    return Candidate(Source(name, "127.0.0.1", 1, Topology(dc, rack, name)), fence, complete)


def test_pipeline_plan_chains_readers_one_per_uplink() -> None:
    trainer = _cand("t", 0, True)
    readers = [_cand(f"r{i}", i + 1, False) for i in range(5)]
    chosen = pipeline_plan([trainer, *readers])
    assert [chosen[f"r{i}"].holder_id for i in range(5)] == ["t", "r0", "r1", "r2", "r3"]


def test_pipeline_plan_spreads_chains_over_complete_holders_newest_first() -> None:
    holders = [_cand("trainer", 0, True), _cand("old-a", 5, True), _cand("old-b", 6, True)]
    joiners = [_cand(f"j{i}", 10 + i, False) for i in range(5)]
    chosen = pipeline_plan([*holders, *joiners])
    sources = [chosen[f"j{i}"].holder_id for i in range(5)]
    assert sources[:3] == ["old-b", "old-a", "trainer"]  # the publisher is used last
    fed = [sources.count(h) for h in {*sources}]
    assert max(fed) == 1  # no holder feeds two readers while another feeds none


def test_pipeline_plan_keeps_chains_local_and_crosses_a_dc_once() -> None:
    trainer = _cand("t", 0, True, dc="dc1", rack="a")
    remote = [_cand(f"x{i}", i + 1, False, dc="dc2", rack=f"k{i % 2}") for i in range(6)]
    chosen = pipeline_plan([trainer, *remote])
    crossing = [r for r, s in chosen.items() if s.holder_id == "t"]
    assert crossing == ["x0"]  # only the first reader of dc2 reads over the WAN
    # and readers of one rack read from their own rack once it has a holder
    assert chosen["x3"].topology.rack == "k1"
    assert chosen["x4"].topology.rack == "k0"


def test_pipeline_sources_agrees_with_the_plan() -> None:
    trainer = _cand("t", 0, True)
    earlier = [_cand(f"r{i}", i + 1, False) for i in range(3)]
    me = Topology("dc1", "r0", "me")
    assert pipeline_sources(me, 4, [trainer, *earlier])[0].holder_id == "r2"
    assert pipeline_sources(me, 4, []) == []
