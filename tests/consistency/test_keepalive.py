"""The lease keepalive multiplexer: many leases over one etcd stream, against a real etcd."""

from __future__ import annotations

import threading
import time

import pytest

from consistency import Etcd
from consistency.keepalive import LeaseKeeper
from tensorhub.errors import DeadlineExceeded, InvalidArgument, Unavailable
from tests.waiting import wait_until


def _threads_named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_many_leases_renew_over_one_stream(etcd: Etcd) -> None:
    leases = [etcd.lease_grant(5)[0] for _ in range(50)]
    keeper = LeaseKeeper(etcd)
    try:
        time.sleep(1.1)  # let the TTLs run down a little, so a renewal is visible
        futures = [keeper.renew(lease, timeout=10) for lease in leases]
        assert [f.result(timeout=15) for f in futures] == [5] * len(leases)
        assert all(etcd.lease_ttl(lease) >= 4 for lease in leases[:5])
        assert _threads_named("lease-keeper") == 1  # one reader, whatever the number of leases
        # Overlapping renewals of one lease share a request and its answer.
        twice = [keeper.renew(leases[0], timeout=10) for _ in range(3)]
        assert [f.result(timeout=15) for f in twice] == [5, 5, 5]
    finally:
        keeper.close()
        for lease in leases:
            etcd.lease_revoke(lease)


def test_an_expired_lease_renews_to_zero(etcd: Etcd) -> None:
    lease, _ = etcd.lease_grant(5)
    etcd.lease_revoke(lease)
    keeper = LeaseKeeper(etcd)
    try:
        assert keeper.keepalive(lease, timeout=10) == 0
    finally:
        keeper.close()


def test_renewals_survive_a_broken_stream(etcd: Etcd) -> None:
    lease, _ = etcd.lease_grant(5)
    keeper = LeaseKeeper(etcd)
    try:
        assert keeper.keepalive(lease, timeout=10) == 5
        keeper._break_stalled()  # what a hung member looks like: the stream is cancelled
        # The cancel lands asynchronously: an answer already on its way may still arrive on
        # the old stream (a CI run saw `reconnects` 0 right after), so wait for the reopen.
        wait_until("the keeper reopened its stream", lambda: keeper.reconnects >= 1, 10)
        assert keeper.keepalive(lease, timeout=10) == 5  # answered on the reopened stream
    finally:
        keeper.close()
        etcd.lease_revoke(lease)


def test_close_fails_waiting_renewals_and_refuses_new_ones(etcd: Etcd) -> None:
    keeper = LeaseKeeper(etcd)
    with pytest.raises(InvalidArgument):
        keeper.renew(1, timeout=0)
    keeper.close()
    with pytest.raises(Unavailable):
        keeper.renew(1, timeout=1).result(timeout=1)


def test_a_renewal_nobody_answers_fails_at_its_deadline() -> None:
    with Etcd(["127.0.0.1:1"]) as nowhere:  # nothing listens there: every stream fails
        keeper = LeaseKeeper(nowhere)
        try:
            started = time.monotonic()
            future = keeper.renew(1234, timeout=0.5)
            with pytest.raises(DeadlineExceeded):
                future.result(timeout=5)
            assert time.monotonic() - started < 3
        finally:
            keeper.close()
