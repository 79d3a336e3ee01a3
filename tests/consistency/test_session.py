"""Sessions: keepalive, done on loss, close revokes, orphan lets the TTL run out."""

from __future__ import annotations

import time

import pytest

from consistency import Etcd, HolderRecord, HolderRegistry, Session, VersionRegistry
from tensorhub.errors import InvalidArgument, LeaseLost


def _publish(versions: VersionRegistry, session: Session, version: int = 1) -> None:
    record = HolderRecord("trainer", {"tcp": "127.0.0.1:9"}, session=session.id)
    versions.publish("t", "m", version, b"manifest", record)


def test_keepalive_outlives_the_ttl(etcd: Etcd) -> None:
    with Session(etcd, ttl=1) as session:
        time.sleep(2.5)
        assert session.alive
        assert etcd.lease_ttl(session.id) >= 0  # -1 would mean gone; TTLs are whole seconds


def test_close_revokes_and_deletes_records(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry
) -> None:
    session = Session(etcd, ttl=10)
    _publish(versions, session)
    assert len(holders.list("t", "m", 1)[0]) == 1
    session.close()
    assert session.done.is_set()
    assert holders.list("t", "m", 1)[0] == []
    assert etcd.lease_ttl(session.id) == -1


@pytest.mark.timeout(30)
def test_orphan_records_vanish_within_ttl_plus_2s(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry
) -> None:
    session = Session(etcd, ttl=1)
    _publish(versions, session)
    session.orphan()
    start = time.monotonic()
    while holders.list("t", "m", 1)[0]:
        assert time.monotonic() - start < 1 + 2, "lease did not expire within TTL + 2 s"
        time.sleep(0.1)


@pytest.mark.timeout(30)
def test_done_is_set_when_the_lease_is_revoked_elsewhere(etcd: Etcd) -> None:
    session = Session(etcd, ttl=1)
    etcd.lease_revoke(session.id)
    assert session.done.wait(timeout=5), "loss of the lease was not noticed"
    with pytest.raises(LeaseLost):
        session.check()


def test_adopting_a_lease_keeps_it_alive(etcd: Etcd) -> None:
    first = Session(etcd, ttl=1)
    first.orphan()
    second = Session(etcd, ttl=1, lease_id=first.id)
    time.sleep(2.0)
    assert etcd.lease_ttl(first.id) >= 0
    second.close()


def test_adopting_an_expired_lease_fails(etcd: Etcd) -> None:
    session = Session(etcd, ttl=1)
    session.close()
    with pytest.raises(LeaseLost):
        Session(etcd, lease_id=session.id)


def test_bad_ttl(etcd: Etcd) -> None:
    with pytest.raises(InvalidArgument):
        Session(etcd, ttl=0)
