"""An etcd restart while clients hold sessions (issue 25, "also untested"): the test's own
one-member etcd is SIGKILLed and started again from its data dir, under a real hub (gRPC on
loopback) and SDK clients that hold a version.

What the SDK promises (docs/sdk.md, `ros/client/session.py`, `ros/client/lease.py`), and
what is tested, exactly:

- a session renewed again before its TTL ran out is the same session: same lease id, never
  declared lost, no recovery, every holder record still there under it (etcd keeps leases
  across a restart and gives each its full TTL again);
- a session whose TTL ran out while etcd was down is lost: the client stops serving, opens
  a new session once the hub can, and re-registers every version it holds, until it has;
  its records then live under the new lease, and stay when the old lease (restored by the
  restart, renewed by nobody) expires.

Either way readers fetch the version from those holders afterwards, and new publishes work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import ros
from consistency import EtcdCluster, EventKind, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tensorhub.errors import TensorHubError
from tests.ros.helpers import digest, make_model
from tests.waiting import wait_until

TTL = 3  # of the sessions that must expire while etcd is down


@pytest.fixture
def world() -> Iterator[tuple[EtcdCluster, HubServer, str]]:
    """An etcd of this test's own (so restarting it touches no other test), a hub on it,
    and a tenant's token."""
    with EtcdCluster(size=1) as cluster:
        hub = HubServer(cluster.endpoints, admin_token="x", keys=Keys("/restart")).start()
        try:
            yield cluster, hub, TenantStore(hub.etcd, hub.keys).create("team-a")
        finally:
            hub.stop(grace=0.2)


def restart_etcd(cluster: EtcdCluster, down: float) -> None:
    """SIGKILL the member, keep it down `down` seconds, start it again from its data."""
    cluster.kill(0)
    time.sleep(down)
    cluster.restart(0)


def answers(client: ros.Hub) -> bool:
    """Whether the hub answers a read again (through the restarted etcd)."""
    try:
        return client.latest("policy", timeout=2) >= 1
    except TensorHubError:
        return False


def records(client: ros.Hub) -> dict[str, tuple[int, bool]]:
    """policy@1's holder records: holder -> (session, complete)."""
    return {h.holder: (h.session, h.complete) for h in client.holders("policy", 1)}


@pytest.mark.timeout(90)
def test_sessions_with_a_long_ttl_survive_an_etcd_restart_on_the_same_lease(
    world: tuple[EtcdCluster, HubServer, str],
) -> None:
    """etcd is down for 1 s; sessions have a 10 s TTL. Proves: both clients keep the same
    session id, are never declared lost and never recover; renewals resume on the same
    leases (etcd reports them alive); both holder records are intact under them; a new
    version is published and fetched through the restarted etcd, and a watch opened before
    the restart reports it once."""
    cluster, hub, token = world
    publisher, reader, late = (
        ros.connect(hub.address, tenant="team-a", token=token, session_ttl=10) for _ in range(3)
    )
    try:
        publisher.publish("policy", 1, make_model(1))
        reader.fetch("policy", 1, timeout=30)
        holders = {c.holder_name: (c.session.id, True) for c in (publisher, reader)}
        assert records(late) == holders
        renewed = [c.session.renewals for c in (publisher, reader)]
        watch = reader.watch("policy", versions_only=True)  # a rollout waiting across it

        restart_etcd(cluster, down=1.0)
        wait_until("the hub answers through the restarted etcd", lambda: answers(late), 30)
        wait_until(
            "both sessions renewed after the restart",
            lambda: all(
                c.session.renewals > n for c, n in zip((publisher, reader), renewed, strict=True)
            ),
            20,
        )
        for client in (publisher, reader):
            assert not client.session.lost.is_set()
            assert client.session.recoveries == 0
            assert hub.etcd.lease_ttl(client.session.id) > 0
        assert records(late) == holders  # same holders, same sessions, still COMPLETE
        publisher.publish("policy", 2, make_model(2))
        assert digest(late.fetch("policy", 2, timeout=30).tensors) == digest(make_model(2))
        deadline = time.monotonic() + 20  # the hub's etcd watch came back with etcd
        events: list[tuple[EventKind, int]] = []
        while (EventKind.VERSION_PUBLISHED, 2) not in events:
            assert time.monotonic() < deadline, f"the watch missed policy@2: {events}"
            event = watch.get(timeout=1)
            if event is not None:
                events.append((event.kind, event.version))
        watch.close()
        assert events == [(EventKind.VERSION_PUBLISHED, 2)], events  # nothing else, once
    finally:
        for client in (late, reader, publisher):
            client.close()


@pytest.mark.timeout(90)
def test_sessions_that_expire_while_etcd_is_down_are_recovered_and_re_registered(
    world: tuple[EtcdCluster, HubServer, str],
) -> None:
    """etcd is down for 5 s; sessions have a 3 s TTL, so no renewal can come in time.
    Proves: each client recovers by itself (a new session, `recoveries` counted) and
    re-registers policy@1 under it, COMPLETE; the records outlive the old leases (which
    the restart restored and nobody renews) expiring; a new reader fetches the bytes."""
    cluster, hub, token = world
    publisher, reader = (
        ros.connect(hub.address, tenant="team-a", token=token, session_ttl=TTL) for _ in range(2)
    )
    late = ros.connect(hub.address, tenant="team-a", token=token, session_ttl=10)
    try:
        publisher.publish("policy", 1, make_model(1))
        reader.fetch("policy", 1, timeout=30)
        old = {c.holder_name: c.session.id for c in (publisher, reader)}

        restart_etcd(cluster, down=TTL + 2.0)
        wait_until("the hub answers through the restarted etcd", lambda: answers(late), 30)

        def re_registered() -> bool:
            want = {c.holder_name: (c.session.id, True) for c in (publisher, reader)}
            return not any(c.session.lost.is_set() for c in (publisher, reader)) and (
                records(late) == want
            )

        wait_until("both holders re-registered under live sessions", re_registered, 30)
        for client in (publisher, reader):
            assert client.session.id != old[client.holder_name]
            assert client.session.recoveries >= 1
        wait_until(  # restored by the restart, renewed by nobody
            "the old leases expired",
            lambda: all(hub.etcd.lease_ttl(lease) <= 0 for lease in old.values()),
            TTL + 10,
        )
        # the records live on the new leases: still there (a client that a loaded machine
        # makes lose its session once more recovers again: hence a wait, not one look)
        wait_until("both holders registered after the old leases expired", re_registered, 30)
        assert digest(late.fetch("policy", 1, timeout=30).tensors) == digest(make_model(1))
    finally:
        for client in (late, reader, publisher):
            client.close()
