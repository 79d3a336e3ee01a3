"""Failover on a real 3-member etcd cluster: the consistency core keeps its promises when the
leader (or the member a client is talking to) is killed.

- Nothing acknowledged is lost (invariant 4, docs/design.md): every publish that returned is visible
  afterwards; a publish that failed with an unknown outcome may have happened or not, and
  nothing appears that was never attempted. The publisher keeps going on the new leader.
- A model's watch (read as the hub's fan-out reads it) whose member dies resumes elsewhere
  and delivers exactly the events a clean watch from the same revision delivers: none lost,
  none repeated, in revision order.
- A session's lease outlives a leader kill: renewals fail over to the surviving members.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from consistency import (
    Etcd,
    EtcdCluster,
    EventKind,
    HolderRecord,
    Keys,
    Session,
    VersionRegistry,
    WatchEvent,
)
from tensorhub.errors import DeadlineExceeded, OutcomeUnknown, Unavailable
from tests.consistency.watching import WatchedModel
from tests.waiting import wait_until

TENANT = "t"
MODEL = "m"
CALL_TIMEOUT = 5.0  # per call, as a client would set it; enough to ride out an election
WAIT = 30.0  # bound on any wait for progress (two shared, busy cores)
DEADLINE_SLACK = 0.3  # how late past its deadline a failing call may return

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=3) as cluster:
        yield cluster


@pytest.fixture
def healthy(cluster: EtcdCluster) -> EtcdCluster:
    """The cluster with every member running and a leader elected (a previous test may have
    killed one)."""
    for index, member in enumerate(cluster.members):
        if not member.alive:
            cluster.restart(index)
    cluster.leader(timeout=WAIT)
    return cluster


@pytest.fixture
def keys() -> Keys:
    return Keys(f"/test/cluster-{uuid.uuid4().hex}")


def _leader_first(cluster: EtcdCluster) -> tuple[int, list[str]]:
    """The leader's index, and every endpoint with the leader's first: a client starts on it."""
    leader = cluster.leader(timeout=WAIT)
    endpoints = cluster.endpoints
    return leader, [endpoints[leader]] + [e for i, e in enumerate(endpoints) if i != leader]


@dataclass
class _Publisher:
    """Publishes versions 1, 2, 3, ... as fast as it can, recording every outcome."""

    versions: VersionRegistry
    record: HolderRecord
    acked: dict[int, int] = field(default_factory=dict)  # version -> commit revision
    unknown: dict[int, str] = field(default_factory=dict)  # version -> error
    errors: list[BaseException] = field(default_factory=list)  # anything else: a failure
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        version = 0
        while not self.stop.is_set():
            version += 1
            try:
                published = self.versions.publish(
                    TENANT, MODEL, version, f"m{version}".encode(), self.record,
                    timeout=CALL_TIMEOUT,
                )  # fmt: skip
            except (OutcomeUnknown, Unavailable, DeadlineExceeded) as exc:
                with self.lock:
                    self.unknown[version] = f"{type(exc).__name__}: {exc}"
                continue
            except BaseException as exc:  # StaleVersion or worse: nothing should raise it
                with self.lock:
                    self.errors.append(exc)
                return
            with self.lock:
                if not published.visible:  # a whole-version publish always moves latest
                    self.errors.append(AssertionError(f"{published} is not visible"))
                    return
                self.acked[version] = published.revision

    def acked_count(self) -> int:
        with self.lock:
            return len(self.acked)


@pytest.mark.timeout(120)
def test_leader_kill_loses_no_acknowledged_publish(healthy: EtcdCluster, keys: Keys) -> None:
    cluster = healthy
    leader, endpoints = _leader_first(cluster)
    with Etcd(endpoints, timeout=CALL_TIMEOUT) as etcd, Session(etcd, ttl=10) as session:
        versions = VersionRegistry(etcd, keys, retain=100_000)  # keep every version to check
        publisher = _Publisher(
            versions, HolderRecord("trainer", {"tcp": "127.0.0.1:9"}, session=session.id)
        )
        thread = threading.Thread(target=publisher.run, name="publisher", daemon=True)
        thread.start()
        try:
            wait_until("20 publishes before the kill", lambda: publisher.acked_count() >= 20, WAIT)
            cluster.kill(leader)
            before_kill = publisher.acked_count()
            wait_until(
                "20 publishes after the kill",
                lambda: publisher.acked_count() >= before_kill + 20,
                WAIT,
            )
            cluster.restart(leader, timeout=WAIT)
            after_restart = publisher.acked_count()
            wait_until(
                "10 publishes after the restart",
                lambda: publisher.acked_count() >= after_restart + 10,
                WAIT,
            )
        finally:
            publisher.stop.set()
            thread.join(timeout=3 * CALL_TIMEOUT)
        assert not thread.is_alive()
        assert not publisher.errors, publisher.errors
        assert session.alive  # its renewals failed over too
        _check_nothing_acknowledged_was_lost(cluster, leader, keys, publisher)


def _check_nothing_acknowledged_was_lost(
    cluster: EtcdCluster, restarted: int, keys: Keys, publisher: _Publisher
) -> None:
    """Read back from a fresh client that starts on the restarted member (it has caught up)."""
    endpoints = cluster.endpoints
    first = [endpoints[restarted]] + [e for i, e in enumerate(endpoints) if i != restarted]
    acked, unknown = publisher.acked, publisher.unknown
    with Etcd(first, timeout=CALL_TIMEOUT) as etcd:
        versions = VersionRegistry(etcd, keys, retain=100_000)
        latest, _ = versions.latest(TENANT, MODEL)
        present = versions.versions(TENANT, MODEL)
        assert latest >= max(acked)
        assert latest == max(present)
        missing = sorted(set(acked) - set(present))
        assert not missing, f"acknowledged publishes lost: {missing}"
        # Nothing appears that was not attempted; each attempt is acked xor unknown.
        assert set(present) <= set(acked) | set(unknown)
        assert not set(acked) & set(unknown)
        for version in present:
            info = versions.describe(TENANT, MODEL, version)
            assert info.manifest == f"m{version}".encode()
            assert [h.holder for h in info.holders] == ["trainer"]
    # Acknowledged revisions are commit revisions, increasing in publish order.
    revisions = [acked[v] for v in sorted(acked)]
    assert revisions == sorted(revisions)
    assert len(set(revisions)) == len(revisions)


def _drain(watch: WatchedModel, until_revision: int, timeout: float = WAIT) -> list[WatchEvent]:
    """Events up to and including `until_revision`, then whatever else arrives at once."""
    events: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while not events or events[-1].revision < until_revision:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"watch stopped at {events[-1:]} before revision {until_revision}"
        event = watch.get(remaining)
        if event is not None:
            events.append(event)
    while (event := watch.get(0.5)) is not None:
        events.append(event)
    return events


@pytest.mark.timeout(120)
def test_watch_survives_the_death_of_its_member(healthy: EtcdCluster, keys: Keys) -> None:
    cluster = healthy
    leader, watch_endpoints = _leader_first(cluster)
    # The writer prefers a member that will survive, so it keeps writing through the kill.
    writer_endpoints = watch_endpoints[1:] + watch_endpoints[:1]
    with (
        Etcd(writer_endpoints, timeout=CALL_TIMEOUT) as etcd,
        Etcd(watch_endpoints, timeout=CALL_TIMEOUT) as watch_etcd,
        Session(etcd, ttl=10) as session,
    ):
        versions = VersionRegistry(etcd, keys, retain=100_000)
        record = HolderRecord("trainer", {"tcp": "127.0.0.1:9"}, session=session.id)
        _, start = versions.latest(TENANT, MODEL)
        # The watch's own client starts on the leader, so its stream is on the member we kill.
        with WatchedModel(watch_etcd, keys, TENANT, MODEL, start_revision=start + 1) as watch:
            published: list[int] = []
            end = 0  # commit revision of the last publish

            def publish_some(count: int) -> None:
                nonlocal end
                for _ in range(count):
                    version = len(published) + 1
                    end = versions.publish(
                        TENANT, MODEL, version, b"m", record, timeout=WAIT
                    ).revision
                    published.append(version)

            publish_some(10)
            first = watch.get(WAIT)  # the stream is up and delivering
            assert first is not None
            cluster.kill(leader)
            publish_some(10)
            cluster.restart(leader, timeout=WAIT)
            publish_some(5)
            events = [first, *_drain(watch, end)]
            assert watch.raw.reconnects >= 1, "the watch never lost its stream"

        # Exactly once, in revision order: the same events a clean watch from `start` sees.
        with WatchedModel(etcd, keys, TENANT, MODEL, start_revision=start + 1) as clean:
            reference = _drain(clean, end)
    assert events == reference
    revisions = [e.revision for e in events]
    assert revisions == sorted(revisions)
    new_versions = [e.version for e in events if e.kind is EventKind.VERSION_PUBLISHED]
    assert new_versions == published


@pytest.mark.timeout(120)
def test_session_survives_a_leader_kill(healthy: EtcdCluster, keys: Keys) -> None:
    cluster = healthy
    leader, endpoints = _leader_first(cluster)
    ttl = 3
    with Etcd(endpoints, timeout=CALL_TIMEOUT) as etcd, Session(etcd, ttl=ttl) as session:
        key = keys.prefix + "/owned"
        etcd.put(key, b"x", lease=session.id)
        cluster.kill(leader)
        killed_at = time.monotonic()
        new_leader = cluster.leader(timeout=WAIT)
        assert new_leader != leader
        # Past the TTL (and etcd's extension on a leader change): without renewals through
        # the new leader the lease would be gone by now.
        time.sleep(max(0.0, killed_at + ttl + 2.0 - time.monotonic()))
        assert session.alive
        assert etcd.lease_ttl(session.id) >= 0
        kv, _ = etcd.get(key)
        assert kv is not None
        assert kv.lease == session.id
        cluster.restart(leader, timeout=WAIT)
        session.check()
    # close() revoked it: the key went with the lease.
    with Etcd(cluster.endpoints, timeout=CALL_TIMEOUT) as etcd:
        assert etcd.get(key)[0] is None


@pytest.mark.timeout(120)
def test_without_quorum_calls_fail_with_named_errors_in_time(
    healthy: EtcdCluster, keys: Keys
) -> None:
    """No hangs, no anonymous errors (invariant 5 and "Errors and outcomes",
    docs/design.md): with two of three members dead,
    reads and writes end by their deadline with a named error, and a write's is an outcome
    error. etcd 3.4 reports a deadline that ran out inside the server as UNKNOWN "context
    deadline exceeded" about half the time; that must read as a deadline too. And a retry's
    backoff must not sleep past the deadline."""
    cluster = healthy
    leader, endpoints = _leader_first(cluster)
    with Etcd(endpoints, timeout=CALL_TIMEOUT) as etcd, Session(etcd, ttl=10) as session:
        versions = VersionRegistry(etcd, keys, retain=100_000)
        record = HolderRecord("trainer", {"tcp": "127.0.0.1:9"}, session=session.id)
        versions.publish(TENANT, MODEL, 1, b"m1", record)
        survivors_lost = [i for i in range(len(cluster.members)) if i != leader]
        for index in survivors_lost:
            cluster.kill(index)
        try:
            for attempt in range(4):
                started = time.monotonic()
                with pytest.raises((OutcomeUnknown, DeadlineExceeded, Unavailable)):
                    versions.publish(TENANT, MODEL, 2 + attempt, b"m", record, timeout=1.0)
                took = [time.monotonic() - started]
                started = time.monotonic()
                with pytest.raises((DeadlineExceeded, Unavailable)):
                    versions.latest(TENANT, MODEL, timeout=1.0)
                took.append(time.monotonic() - started)
                # Within the deadline, give or take scheduling: no backoff sleeps past it.
                assert max(took) < 1.0 + DEADLINE_SLACK, took
        finally:
            for index in survivors_lost:
                cluster.restart(index, timeout=WAIT)
        latest, _ = versions.latest(TENANT, MODEL, timeout=WAIT)
        assert latest >= 1
