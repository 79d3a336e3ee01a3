"""Watches: explicit start revisions, exactly-once across reconnects, compaction re-list."""

from __future__ import annotations

import threading
import time

import pytest

from consistency import (
    Etcd,
    EventKind,
    HolderRecord,
    KeyWatch,
    ModelWatch,
    Session,
    VersionRegistry,
    wait_for_version,
)
from consistency.watch import RawEvent, Resync
from tensorhub.errors import DeadlineExceeded, InvalidArgument


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
        with ModelWatch(etcd, versions.keys, "t", "m", start_revision=start + 1) as watch:
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
        with ModelWatch(etcd, versions.keys, "t", "m", start_revision=start + 1) as watch:
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
