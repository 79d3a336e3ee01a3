"""Watch progress (opt-in): `Progress` after events, and etcd progress notifications on request."""

from __future__ import annotations

import time

import pytest

from consistency import Etcd, Keys, KeyWatch
from consistency.watch import Progress, RawEvent
from tensorhub.errors import InvalidArgument


def next_of(watch: KeyWatch, kind: type, timeout: float = 5.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = watch.get(deadline - time.monotonic())
        if isinstance(item, kind):
            return item
    raise AssertionError(f"no {kind.__name__} within {timeout}s")


def test_progress_follows_events_and_answers_requests(etcd: Etcd, keys: Keys) -> None:
    base = f"{keys.prefix}/progress/"
    _, now = etcd.get(base)
    with KeyWatch(etcd, base, prefix=True, start_revision=now + 1, progress=True) as watch:
        written = etcd.put(f"{base}a", "1")
        event = next_of(watch, RawEvent)
        assert isinstance(event, RawEvent)
        assert event.revision == written
        after = next_of(watch, Progress)
        assert isinstance(after, Progress)
        assert after.revision == written
        assert not after.notified
        # a write elsewhere moves etcd's revision but brings no event: progress tells
        elsewhere = etcd.put(f"{keys.prefix}/elsewhere", "x")
        time.sleep(0.3)  # past the grace in which a fresh watch's notifications are ignored
        deadline = time.monotonic() + 5
        seen = 0
        while seen < elsewhere and time.monotonic() < deadline:
            watch.request_progress()
            item = watch.get(0.2)
            if isinstance(item, Progress) and item.notified:
                seen = item.revision
        assert seen >= elsewhere


def test_plain_watches_never_yield_progress(etcd: Etcd, keys: Keys) -> None:
    base = f"{keys.prefix}/plain/"
    _, now = etcd.get(base)
    with KeyWatch(etcd, base, prefix=True, start_revision=now + 1) as watch:
        with pytest.raises(InvalidArgument):
            watch.request_progress()
        etcd.put(f"{base}a", "1")
        assert isinstance(watch.get(5), RawEvent)
        assert watch.get(0.3) is None
