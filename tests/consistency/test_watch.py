"""Watches: explicit start revisions, exactly-once across reconnects, compaction re-list."""

from __future__ import annotations

import threading
import time

import pytest

from consistency import (
    Etcd,
    EtcdCluster,
    EventKind,
    HolderRecord,
    KeyWatch,
    Session,
    VersionRegistry,
)
from consistency.retry import RetryPolicy
from consistency.watch import RawEvent, Resync
from tensorhub.errors import DeadlineExceeded, InvalidArgument
from tests.consistency.watching import WatchedModel, wait_for_version


def rec(session: Session) -> HolderRecord:
    return HolderRecord("trainer", {"tcp": "127.0.0.1:9"}, session=session.id)


def test_start_revision_must_be_explicit(etcd: Etcd) -> None:
    with pytest.raises(InvalidArgument, match="explicit"):
        KeyWatch(etcd, "/x", prefix=True, start_revision=0)


def test_history_is_replayed_from_the_start_revision(etcd: Etcd, versions: VersionRegistry) -> None:
    with Session(etcd, ttl=5) as s:
        _, start = versions.latest("t", "m")
        for v in (1, 2, 3):
            versions.publish("t", "m", v, b"x", rec(s))
        with WatchedModel(etcd, versions.keys, "t", "m", start_revision=start + 1) as watch:
            seen = []
            while len(seen) < 3:
                event = watch.get(timeout=5)
                assert event is not None
                if event.kind is EventKind.VERSION_PUBLISHED:
                    seen.append(event.version)
        assert seen == [1, 2, 3]


@pytest.mark.timeout(60)
def test_every_event_exactly_once_across_forced_reconnects(etcd: Etcd, keys) -> None:  # type: ignore[no-untyped-def]
    prefix = keys.prefix + "/stream/"
    _, start = etcd.get(prefix)
    total = 300
    stop = threading.Event()

    def writer() -> None:
        for i in range(total):
            etcd.put(f"{prefix}{i:05d}", str(i))

    with KeyWatch(etcd, prefix, prefix=True, start_revision=start + 1) as watch:
        thread = threading.Thread(target=writer)
        thread.start()

        def breaker() -> None:
            while not stop.wait(0.05):
                watch.force_reconnect()

        chaos = threading.Thread(target=breaker)
        chaos.start()
        got: list[int] = []
        revisions: list[int] = []
        deadline = time.monotonic() + 45
        while len(got) < total and time.monotonic() < deadline:
            event = watch.get(timeout=1)
            if isinstance(event, RawEvent):
                got.append(int(event.kv.value))
                revisions.append(event.revision)
        stop.set()
        chaos.join()
        thread.join()
        assert watch.reconnects > 0, "the test did not force any reconnect"
    assert got == list(range(total)), "events lost, repeated or reordered"
    assert revisions == sorted(set(revisions))


@pytest.mark.timeout(30)
def test_compaction_relists_then_resumes(etcd: Etcd, keys) -> None:  # type: ignore[no-untyped-def]
    prefix = keys.prefix + "/compact/"
    _, start = etcd.get(prefix)
    for i in range(5):
        etcd.put(f"{prefix}k{i}", f"old{i}")
    etcd.delete(f"{prefix}k0")
    revision = etcd.put(f"{prefix}k1", "new1")
    etcd.compact(revision)
    with KeyWatch(etcd, prefix, prefix=True, start_revision=start + 1) as watch:
        first = watch.get(timeout=5)
        assert isinstance(first, Resync)
        assert first.revision >= revision
        state = {kv.key.decode().rsplit("/", 1)[1]: kv.value.decode() for kv in first.kvs}
        assert state == {"k1": "new1", "k2": "old2", "k3": "old3", "k4": "old4"}
        etcd.put(f"{prefix}k9", "after")
        after = watch.get(timeout=5)
        assert isinstance(after, RawEvent)
        assert after.kv.value == b"after"
        assert watch.get(timeout=0.3) is None, "an event was repeated after the re-list"


@pytest.mark.timeout(30)
def test_model_watch_resync_carries_holders(etcd: Etcd, versions: VersionRegistry) -> None:
    with Session(etcd, ttl=5) as s:
        _, start = versions.latest("t", "m")
        versions.publish("t", "m", 1, b"x", rec(s))
        p = versions.publish("t", "m", 2, b"x", rec(s))
        etcd.compact(p.revision)
        with WatchedModel(etcd, versions.keys, "t", "m", start_revision=start + 1) as watch:
            event = watch.get(timeout=5)
        assert event is not None
        assert event.kind is EventKind.RESYNC
        assert event.version == 2
        assert [h.holder for h in event.holders[2]] == ["trainer"]


@pytest.mark.timeout(30)
def test_wait_for_version_watches_until_visible(etcd: Etcd, versions: VersionRegistry) -> None:
    with Session(etcd, ttl=5) as s:
        timer = threading.Timer(0.3, lambda: versions.publish("t", "m", 4, b"x", rec(s)))
        timer.start()
        revision = wait_for_version(etcd, versions.keys, "t", "m", 4, timeout=10)
        timer.join()
        assert revision >= versions.describe("t", "m", 4).published_revision
        with pytest.raises(DeadlineExceeded):
            wait_for_version(etcd, versions.keys, "t", "m", 5, timeout=0.3)


@pytest.mark.timeout(120)
def test_a_watch_whose_etcd_is_down_backs_off_on_its_clients_policy() -> None:
    """KeyWatch reconnects on `Etcd.policy`: with its only member killed, the waits between
    its reconnects are the policy's schedule, seen through the injected sleep (jitter at the
    top of each range: 0.05 s doubling), and once the member is back the watch resumes from
    the revision after its last event, losing and repeating nothing."""
    delays: list[float] = []
    backing_off = threading.Event()

    def sleep(seconds: float) -> None:
        delays.append(round(seconds, 6))
        if len(delays) >= 5:
            backing_off.set()
        time.sleep(0.01)  # not the schedule's time: the watch only has to yield the CPU

    policy = RetryPolicy(sleep=sleep, jitter=lambda high: high)
    with (
        EtcdCluster(1) as cluster,
        Etcd(cluster.endpoints, timeout=5.0, policy=policy) as etcd,
    ):
        start = etcd.put("/down/k", "1")
        with KeyWatch(etcd, "/down/", prefix=True, start_revision=start) as watch:
            first = watch.get(10)
            assert isinstance(first, RawEvent)
            assert first.kv.value == b"1"
            assert delays == []  # a healthy stream never waits
            cluster.kill(0)
            assert backing_off.wait(60), f"the watch did not back off: {delays}"
            assert delays[:5] == [0.05, 0.1, 0.2, 0.4, 0.8]
            cluster.restart(0)
            etcd.put("/down/k", "2")
            seen = []
            deadline = time.monotonic() + 60
            while b"2" not in seen and time.monotonic() < deadline:
                item = watch.get(1)
                if isinstance(item, RawEvent):
                    seen.append(item.kv.value)
            assert seen == [b"2"]  # nothing repeated, nothing lost
            assert watch.reconnects >= 5
