"""Version registry: publish, staleness, races, model-parallel publish, retention."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from consistency import Etcd, HolderRecord, HolderRegistry, Session, VersionRegistry
from tensorhub.errors import InvalidArgument, StaleVersion, VersionNotFound
from tests.consistency.shards import publish_shard


@pytest.fixture
def session(etcd: Etcd) -> Iterator[Session]:
    with Session(etcd, ttl=5) as s:
        yield s


def rec(session: Session, name: str = "trainer") -> HolderRecord:
    return HolderRecord(name, {"tcp": "127.0.0.1:9"}, {"dc": "dc1"}, session=session.id)


def test_latest_of_unknown_model_is_zero(versions: VersionRegistry) -> None:
    version, revision = versions.latest("t", "nothing")
    assert version == 0
    assert revision > 0


def test_publish_moves_latest_and_returns_the_commit_revision(
    versions: VersionRegistry, session: Session
) -> None:
    p1 = versions.publish("t", "m", 1, b"one", rec(session))
    p3 = versions.publish("t", "m", 3, b"three", rec(session))
    assert p1.visible
    assert p3.visible
    assert p3.revision > p1.revision
    latest, revision = versions.latest("t", "m")
    assert latest == 3
    assert revision >= p3.revision
    assert versions.describe("t", "m", 3).published_revision == p3.revision


@pytest.mark.parametrize("version", [1, 2])
def test_stale_publish_is_refused_and_writes_nothing(
    etcd: Etcd, versions: VersionRegistry, session: Session, version: int
) -> None:
    versions.publish("t", "m", 2, b"two", rec(session))
    before = etcd.range(versions.keys.tenant("t"), prefix=True).kvs
    with pytest.raises(StaleVersion, match="not newer"):
        versions.publish("t", "m", version, b"again", rec(session, "other"))
    assert etcd.range(versions.keys.tenant("t"), prefix=True).kvs == before


def test_publish_needs_a_session(versions: VersionRegistry) -> None:
    with pytest.raises(InvalidArgument):
        versions.publish("t", "m", 1, b"x", HolderRecord("h", {}))


def test_concurrent_publishes_of_one_version_exactly_one_wins(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    sessions = [Session(etcd, ttl=5) for _ in range(6)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(sessions))

    def run(i: int) -> None:
        barrier.wait()
        try:
            versions.publish("t", "race", 1, f"m{i}".encode(), rec(sessions[i], f"p{i}"))
            outcomes.append(f"won:{i}")
        except StaleVersion:
            outcomes.append("stale")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1, outcomes
    assert outcomes.count("stale") == len(sessions) - 1
    winner = int(winners[0].split(":")[1])
    info = versions.describe("t", "race", 1)
    assert info.manifest == f"m{winner}".encode()
    assert [h.holder for h in info.holders] == [f"p{winner}"]
    for s in sessions:
        s.close()


def test_model_parallel_latest_moves_with_the_last_shard(
    versions: VersionRegistry, etcd: Etcd
) -> None:
    sessions = [Session(etcd, ttl=5) for _ in range(4)]
    results = []
    for index in (2, 0, 3):
        part, holder = f"part{index}".encode(), rec(sessions[index], f"r{index}")
        results.append(publish_shard(versions, "t", "mp", 1, index, 4, part, holder))
        assert versions.latest("t", "mp")[0] == 0, "latest moved before every shard landed"
        with pytest.raises(VersionNotFound):
            versions.describe("t", "mp", 1)
    assert not any(r.visible for r in results)
    last = publish_shard(versions, "t", "mp", 1, 1, 4, b"part1", rec(sessions[1], "r1"))
    assert last.visible
    assert versions.latest("t", "mp")[0] == 1
    info = versions.describe("t", "mp", 1)
    assert [s.manifest for s in info.shards] == [b"part0", b"part1", b"part2", b"part3"]
    assert sorted(h.holder for h in info.holders) == ["r0", "r1", "r2", "r3"]
    for s in sessions:
        s.close()


def test_model_parallel_concurrent_ranks(versions: VersionRegistry, etcd: Etcd) -> None:
    sessions = [Session(etcd, ttl=5) for _ in range(4)]
    barrier = threading.Barrier(4)
    visible = []

    def rank(i: int) -> None:
        barrier.wait()
        p = publish_shard(versions, "t", "mpc", 1, i, 4, b"p", rec(sessions[i], f"r{i}"))
        visible.append(p.visible)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(visible) == [False, False, False, True]
    assert versions.latest("t", "mpc")[0] == 1
    for s in sessions:
        s.close()


def test_shard_index_out_of_range(versions: VersionRegistry, session: Session) -> None:
    with pytest.raises(InvalidArgument):
        publish_shard(versions, "t", "m", 1, 4, 4, b"x", rec(session))


def test_retention_keeps_the_newest_n(versions: VersionRegistry, session: Session) -> None:
    for v in range(1, 6):
        versions.publish("t", "m", v, f"m{v}".encode(), rec(session))
    assert versions.versions("t", "m") == [4, 5]
    assert versions.retained("t", "m") == [4, 5]
    with pytest.raises(VersionNotFound):
        versions.describe("t", "m", 3)


def test_retention_counts_sharded_versions_through_their_records(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    """Retention's scan reads a model's keys alone (`Etcd.range_keys`): each sharded
    version's shard and holder records name it once, an incomplete one is not published,
    and the versions kept and deleted are those of a scan that decodes every record."""
    for v in (1, 2, 3):
        for index in range(3):
            publish_shard(versions, "t", "s", v, index, 3, b"shard", rec(session, f"r{index}"))
    publish_shard(versions, "t", "s", 4, 0, 3, b"shard", rec(session, "r0"))  # not whole
    keys, revision = etcd.range_keys(versions.keys.versions("t", "s"))
    assert keys == [kv.key for kv in etcd.range(versions.keys.versions("t", "s"), prefix=True).kvs]
    assert revision >= max(kv.mod_revision for kv in etcd.range(keys[0]).kvs)
    assert versions.versions("t", "s") == [2, 3]  # retain 2: version 1 went
    assert versions.collect("t", "s") == []
    with pytest.raises(VersionNotFound):
        versions.describe("t", "s", 1)


def test_pinned_versions_are_not_collected(
    versions: VersionRegistry, holders: HolderRegistry, session: Session
) -> None:
    versions.publish("t", "m", 1, b"m1", rec(session))
    holders.pin("t", "m", 1, "reader-1", session.id)
    for v in (2, 3, 4):
        versions.publish("t", "m", v, b"m", rec(session))
    assert versions.versions("t", "m") == [1, 3, 4]
    holders.unpin("t", "m", 1, "reader-1")
    assert versions.collect("t", "m") == [1]
    assert versions.versions("t", "m") == [3, 4]


def test_models_lists_a_tenants_models_only(versions: VersionRegistry, session: Session) -> None:
    versions.publish("a", "m1", 1, b"x", rec(session))
    versions.publish("a", "m2", 1, b"x", rec(session))
    versions.publish("b", "m3", 1, b"x", rec(session))
    assert versions.models("a") == ["m1", "m2"]
    assert versions.models("b") == ["m3"]
