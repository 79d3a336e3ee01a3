"""Holder registry: register, fenced state changes, release rules, pins, expiry."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from consistency import (
    Etcd,
    EventKind,
    HolderRecord,
    HolderRegistry,
    HolderState,
    Session,
    VersionRegistry,
)
from consistency.deletion import delete_model
from tensorhub.errors import (
    InvalidArgument,
    LeaseLost,
    PermissionDenied,
    RetentionViolation,
    VersionNotFound,
    VersionRetired,
)
from tests.consistency.shards import publish_shard
from tests.consistency.watching import WatchedModel


def rec(session: Session, name: str, state: HolderState = HolderState.PARTIAL) -> HolderRecord:
    return HolderRecord(
        name, {"tcp": "127.0.0.1:9"}, {"dc": "dc1", "host": name}, state, session.id
    )


@pytest.fixture
def published(etcd: Etcd, versions: VersionRegistry):  # type: ignore[no-untyped-def]
    trainer = Session(etcd, ttl=5)
    versions.publish("t", "m", 1, b"manifest", rec(trainer, "trainer"))
    yield trainer
    trainer.close()


def test_register_partial_then_complete(
    etcd: Etcd, holders: HolderRegistry, published: Session
) -> None:
    with Session(etcd, ttl=5) as reader:
        record = rec(reader, "reader")
        fence = holders.register("t", "m", 1, record)
        listed, _ = holders.list("t", "m", 1)
        states = {h.holder: h.state for h in listed}
        assert states == {"trainer": HolderState.COMPLETE, "reader": HolderState.PARTIAL}
        holders.update_state("t", "m", 1, record.with_state(HolderState.COMPLETE), fence)
        listed, _ = holders.list("t", "m", 1)
        assert all(h.complete for h in listed)
        assert next(h for h in listed if h.holder == "reader").revision == fence


def test_register_for_unpublished_version_fails(etcd: Etcd, holders: HolderRegistry) -> None:
    with Session(etcd, ttl=5) as s, pytest.raises(VersionNotFound):
        holders.register("t", "m", 9, rec(s, "reader"))


def test_stale_fence_cannot_overwrite_a_newer_incarnation(
    etcd: Etcd, holders: HolderRegistry, published: Session
) -> None:
    old = Session(etcd, ttl=5)
    fence_old = holders.register("t", "m", 1, rec(old, "reader"))
    old.close()  # the old incarnation's record is gone with its lease
    new = Session(etcd, ttl=5)
    holders.register("t", "m", 1, rec(new, "reader"))
    with pytest.raises(LeaseLost):
        holders.update_state("t", "m", 1, rec(old, "reader", HolderState.COMPLETE), fence_old)
    listed, _ = holders.list("t", "m", 1)
    assert next(h for h in listed if h.holder == "reader").session == new.id
    new.close()


def test_a_record_gone_with_its_lease_is_lease_lost(
    etcd: Etcd, holders: HolderRegistry, published: Session
) -> None:
    old = Session(etcd, ttl=5)
    record = rec(old, "reader")
    fence = holders.register("t", "m", 1, record)
    old.close()  # revoked: the record goes with the lease, the version stays
    with pytest.raises(LeaseLost) as info:
        holders.update_state("t", "m", 1, record.with_state(HolderState.COMPLETE), fence)
    assert not isinstance(info.value, VersionNotFound)


def test_a_record_removed_by_retention_is_version_retired_not_lease_lost(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry, published: Session
) -> None:
    """Retention deletes an unpinned old version with every holder record under it; the
    holder's next update says so, instead of blaming a lease that is alive (issue 13)."""
    with Session(etcd, ttl=5) as reader:
        record = rec(reader, "reader", HolderState.COMPLETE)  # COMPLETE: no pin of its own
        fence = holders.register("t", "m", 1, record)
        for v in (2, 3):
            versions.publish("t", "m", v, b"manifest", rec(published, "trainer"))
        assert 1 not in versions.versions("t", "m")  # retain=2: v1 collected
        with pytest.raises(VersionRetired, match="removed") as info:
            holders.update_state("t", "m", 1, record, fence)
        assert not isinstance(info.value, LeaseLost)
        assert isinstance(info.value, VersionNotFound)  # what callers catch already
        reader.check()  # and the session really is fine


def test_a_record_removed_with_its_model_is_version_retired(
    etcd: Etcd, holders: HolderRegistry, published: Session
) -> None:
    with Session(etcd, ttl=5) as reader:
        record = rec(reader, "reader")  # PARTIAL: its pin does not stop a model deletion
        fence = holders.register("t", "m", 1, record)
        delete_model(etcd, holders.keys, "t", "m")
        with pytest.raises(VersionRetired):
            holders.update_state("t", "m", 1, record.with_state(HolderState.COMPLETE), fence)


def test_last_complete_holder_of_retained_version_cannot_release(
    etcd: Etcd, holders: HolderRegistry, published: Session
) -> None:
    with pytest.raises(RetentionViolation, match="last complete holder"):
        holders.release("t", "m", 1, "trainer")
    assert [h.holder for h in holders.list("t", "m", 1)[0]] == ["trainer"]
    with Session(etcd, ttl=5) as reader:
        record = rec(reader, "reader")
        fence = holders.register("t", "m", 1, record)
        holders.update_state("t", "m", 1, record.with_state(HolderState.COMPLETE), fence)
        holders.release("t", "m", 1, "trainer")
        assert [h.holder for h in holders.list("t", "m", 1)[0]] == ["reader"]
        with pytest.raises(RetentionViolation):
            holders.release("t", "m", 1, "reader")
        holders.release("t", "m", 1, "reader", force=True)
        assert holders.list("t", "m", 1)[0] == []


def test_partial_holders_release_freely(
    etcd: Etcd, holders: HolderRegistry, published: Session
) -> None:
    with Session(etcd, ttl=5) as reader:
        holders.register("t", "m", 1, rec(reader, "reader"))
        holders.release("t", "m", 1, "reader")
        assert [h.holder for h in holders.list("t", "m", 1)[0]] == ["trainer"]


def test_unretained_versions_release_freely(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry, published: Session
) -> None:
    with Session(etcd, ttl=5) as other:
        holders.pin("t", "m", 1, "keep", other.id)  # keep v1 around past retention
        for v in (2, 3):
            versions.publish("t", "m", v, b"m", rec(other, "t2"))
        assert 1 not in versions.retained("t", "m")
        holders.release("t", "m", 1, "trainer")
        assert holders.list("t", "m", 1)[0] == []


def test_a_partial_record_turns_complete_in_one_transaction(
    etcd: Etcd, holders: HolderRegistry, published: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PARTIAL -> COMPLETE of the record exactly as registered (how every fetch ends) is
    one etcd transaction with no read first, and drops the PARTIAL record's pin."""
    calls = _count_calls(holders, monkeypatch)
    pin = holders.keys.pin("t", "m", 1, "reader")
    with Session(etcd, ttl=5) as reader:
        record = rec(reader, "reader")
        fence = holders.register("t", "m", 1, record)
        calls.clear()
        holders.update_state("t", "m", 1, record.with_state(HolderState.COMPLETE), fence)
        assert calls == ["txn"]
        listed, _ = holders.list("t", "m", 1)
        assert next(h for h in listed if h.holder == "reader").complete
        assert etcd.get(pin)[0] is None


def _count_calls(holders: HolderRegistry, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The etcd calls `holders` makes from now on (the real client's, counted by name)."""
    calls: list[str] = []
    for name in ("txn", "range"):
        real = getattr(holders.etcd, name)

        def counted(*args: object, _name: str = name, _real: object = real, **kw: object) -> object:
            calls.append(_name)
            return _real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(holders.etcd, name, counted)
    return calls


def test_a_forced_release_is_one_transaction_and_still_checks_the_session(
    etcd: Etcd, holders: HolderRegistry, published: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forced release of the caller's own record (an in-place update releasing what it is
    about to overwrite) deletes the record and its pin in one etcd transaction, no read
    first; a record of another session is still refused, and none at all is no error."""
    calls = _count_calls(holders, monkeypatch)
    pin = holders.keys.pin("t", "m", 1, "reader")
    with Session(etcd, ttl=5) as reader, Session(etcd, ttl=5) as stranger:
        holders.register("t", "m", 1, rec(reader, "reader"))  # PARTIAL: it pins v1
        assert etcd.get(pin)[0] is not None
        calls.clear()
        holders.release("t", "m", 1, "reader", force=True, session=reader.id)
        assert calls == ["txn"]
        assert [h.holder for h in holders.list("t", "m", 1)[0]] == ["trainer"]
        assert etcd.get(pin)[0] is None
        holders.register("t", "m", 1, rec(reader, "reader"))
        with pytest.raises(PermissionDenied):
            holders.release("t", "m", 1, "reader", force=True, session=stranger.id)
        assert "reader" in [h.holder for h in holders.list("t", "m", 1)[0]]
        holders.release("t", "m", 1, "reader", force=True, session=reader.id)
        assert holders.release("t", "m", 1, "reader", force=True, session=reader.id) > 0


@pytest.mark.timeout(30)
def test_lease_expiry_removes_a_dead_holder_and_the_watch_reports_it(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry, published: Session
) -> None:
    dead = Session(etcd, ttl=1)
    holders.register("t", "m", 1, rec(dead, "doomed"))
    _, revision = holders.list("t", "m", 1)
    with WatchedModel(etcd, versions.keys, "t", "m", start_revision=revision + 1) as watch:
        dead.orphan()  # the process "dies": no more renewals
        start = time.monotonic()
        event = watch.get(timeout=1 + 2)
        elapsed = time.monotonic() - start
    assert event is not None, "no delete event within TTL + 2 s"
    assert event.kind is EventKind.HOLDER_REMOVED
    assert event.holder_name == "doomed"
    assert elapsed <= 3
    assert [h.holder for h in holders.list("t", "m", 1)[0]] == ["trainer"]


def test_holders_of_a_model_parallel_version_name_their_shard(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry
) -> None:
    ranks = [Session(etcd, ttl=5) for _ in range(2)]
    for i, session in enumerate(ranks):
        publish_shard(versions, "t", "mp", 1, i, 2, f"part{i}".encode(), rec(session, f"rank{i}"))
    listed, _ = holders.list("t", "mp", 1)
    assert {h.holder: h.shard for h in listed} == {"rank0": 0, "rank1": 1}  # set by publish
    with Session(etcd, ttl=5) as reader:
        with pytest.raises(InvalidArgument, match="must name its shard"):
            holders.register("t", "mp", 1, rec(reader, "reader"))
        with pytest.raises(InvalidArgument, match="out of range"):
            holders.register("t", "mp", 1, replace(rec(reader, "reader"), shard=2))
        fence = holders.register("t", "mp", 1, replace(rec(reader, "reader"), shard=1))
        moved = replace(rec(reader, "reader", HolderState.COMPLETE), shard=0)
        with pytest.raises(InvalidArgument, match="holds shard 1"):
            holders.update_state("t", "mp", 1, moved, fence)  # a record's shard never changes
        holders.update_state("t", "mp", 1, replace(moved, shard=1), fence)
        # the last-holder rule counts holders of the same shard only: rank 0 is still the
        # only complete holder of shard 0, although the reader completed shard 1
        with pytest.raises(RetentionViolation, match="shard 0"):
            holders.release("t", "mp", 1, "rank0")
        holders.release("t", "mp", 1, "rank1")  # the reader stands in for shard 1
    with Session(etcd, ttl=5) as other:
        versions.publish("t", "whole", 1, b"manifest", rec(other, "trainer"))
        with pytest.raises(InvalidArgument, match="not model-parallel"):
            holders.register("t", "whole", 1, replace(rec(other, "x"), shard=0))
    for session in ranks:
        session.close()
