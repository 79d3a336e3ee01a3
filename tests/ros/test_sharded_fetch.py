"""Model-parallel versions end to end: each reader rank fetches its shard from the holders
of that shard, becomes one, and the retention and replication rules count per shard."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import ros
from consistency import HolderRecord
from ros.hub.server import HubServer


def part(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {
        f"layers.{rank}.weight": torch.randn(128, 64, generator=g),
        f"layers.{rank}.norm": torch.randn(64, generator=g),
    }


def test_each_reader_rank_fetches_its_shard_from_holders_of_that_shard(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = [connect() for _ in range(2)]
    pubs = [t.publish("policy", 1, part(i), shard=(i, 2)) for i, t in enumerate(trainers)]
    assert [p.shard for p in pubs] == [0, 1]
    first, second, third = connect(), connect(), connect()
    got = {
        0: first.fetch("policy", 1, shard=0, timeout=30),
        1: second.fetch("policy", 1, shard=1, timeout=30),
    }
    # trainer 1 is the only complete holder of shard 1 besides `second`; stop it serving
    # reads by releasing it (the reader stands in), so the third reader must use `second`
    pubs[1].release()
    got["again"] = third.fetch("policy", 1, shard=1, timeout=30)
    for held, rank in ((got[0], 0), (got[1], 1), (got["again"], 1)):
        assert held.shard == rank
        assert held.tensors.keys() == part(rank).keys()
        for name, tensor in part(rank).items():
            assert torch.equal(held.tensors[name], tensor), name
    assert set(got["again"].stats.bytes_per_source) == {second.holder_name}
    shards = {h.holder: h.shard for h in third.holders("policy", 1)}
    assert shards == {
        trainers[0].holder_name: 0,
        first.holder_name: 0,
        second.holder_name: 1,
        third.holder_name: 1,
    }


def test_a_sharded_version_needs_a_shard_in_range_and_a_whole_one_none(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = [connect() for _ in range(2)]
    for i, t in enumerate(trainers):
        t.publish("policy", 1, part(i), shard=(i, 2))
    whole = connect()
    whole.publish("other", 1, part(0))
    reader = connect()
    with pytest.raises(ros.InvalidArgument, match=r"model-parallel \(2 shards\)"):
        reader.fetch("policy", 1, timeout=5)
    with pytest.raises(ros.InvalidArgument, match="out of range"):
        reader.fetch("policy", 1, shard=2, timeout=5)
    with pytest.raises(ros.InvalidArgument, match="not model-parallel"):
        reader.fetch("other", 1, shard=0, timeout=5)
    # the refusals came before anything was registered or pinned
    assert {h.holder for h in reader.holders("policy", 1)} == {t.holder_name for t in trainers}


def test_replication_and_the_last_holder_rule_count_holders_of_the_same_shard(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = [connect(spill_budget=0) for _ in range(2)]  # refused, not spilled to host
    pubs = [t.publish("policy", 1, part(i), shard=(i, 2)) for i, t in enumerate(trainers)]
    reader_of_1 = connect()
    reader_of_1.fetch("policy", 1, shard=1, timeout=30)
    with pytest.raises(ros.DeadlineExceeded):
        pubs[0].wait_replicated(1, timeout=1.0)  # a shard-1 replica is no copy of shard 0
    with pytest.raises(ros.RetentionViolation, match="shard 0"):
        pubs[0].release()
    assert pubs[1].wait_replicated(1, timeout=10) == 1
    reader_of_0 = connect()
    reader_of_0.fetch("policy", 1, shard=0, timeout=30)
    assert pubs[0].wait_replicated(1, timeout=10) == 1
    pubs[0].release()  # now the reader of shard 0 stands in


def test_a_client_that_lost_its_session_re_registers_what_it_holds_with_its_shard(
    connect: Callable[..., ros.Hub], hub_server: HubServer
) -> None:
    trainers = [connect() for _ in range(2)]
    pubs = [t.publish("mp", 1, part(i), shard=(i, 2)) for i, t in enumerate(trainers)]
    whole = connect().publish("policy", 1, part(7))
    reader = connect(session_ttl=2)
    reader.fetch("mp", 1, shard=1, timeout=30)
    reader.fetch("policy", 1, timeout=30)
    lost = reader.session.id
    hub_server.etcd.lease_revoke(lost)  # its records vanish with the lease
    deadline = time.monotonic() + 15
    while reader.session.id == lost or len(_records_of(reader, "mp")) < 1:
        assert time.monotonic() < deadline, "the client did not recover its session"
        time.sleep(0.1)
    while not _records_of(reader, "policy"):
        assert time.monotonic() < deadline, "the whole version was not re-registered"
        time.sleep(0.1)
    (mp,) = _records_of(reader, "mp")
    (pol,) = _records_of(reader, "policy")
    assert (mp.shard, mp.complete, mp.session) == (1, True, reader.session.id)
    assert (pol.shard, pol.complete, pol.session) == (None, True, reader.session.id)
    pubs[1].release(force=True)  # the recovered reader is now the only holder of shard 1
    whole.release(force=True)
    late = connect()
    got = late.fetch("mp", 1, shard=1, timeout=30)
    assert set(got.stats.bytes_per_source) == {reader.holder_name}
    for name, tensor in part(1).items():
        assert torch.equal(got.tensors[name], tensor), name


def _records_of(client: ros.Hub, model: str) -> list[HolderRecord]:
    return [h for h in client.holders(model, 1) if h.holder == client.holder_name]


def test_a_dead_holder_of_the_shard_fails_over_to_holders_of_that_shard_only(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = [connect() for _ in range(2)]
    for i, t in enumerate(trainers):
        t.publish("policy", 1, part(i), shard=(i, 2))
    of_0, of_1 = connect(), connect()
    of_0.fetch("policy", 1, shard=0, timeout=30)
    of_1.fetch("policy", 1, shard=1, timeout=30)
    trainers[1]._serving.server.stop()  # shard 1's publisher stops serving; its record stays
    reader = connect()
    held = reader.fetch("policy", 1, shard=1, timeout=30)
    for name, tensor in part(1).items():
        assert torch.equal(held.tensors[name], tensor), name
    assert set(held.stats.bytes_per_source) == {of_1.holder_name}
    assert set(held.stats.failed_sources) <= {trainers[1].holder_name}  # never a shard-0 one
