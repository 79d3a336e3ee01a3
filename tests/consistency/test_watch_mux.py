"""`WatchMux`'s public progress API against real etcd: `request_progress` asks etcd for a
progress notification on the mux's stream, and `on_progress` receives its revision once the
watches on the stream have delivered through it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from consistency import Etcd, Keys
from consistency.watch import RawEvent, Resync
from consistency.watch_mux import UNSYNCED_GRACE, WatchMux
from tensorhub.errors import InvalidArgument, TensorHubError
from tests.waiting import wait_until


class _Seen:
    """What a watch and the mux's progress callback received, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[RawEvent] = []
        self.progress: list[int] = []
        self.failed: list[TensorHubError] = []

    def deliver(self, items: Sequence[RawEvent | Resync]) -> None:
        with self.lock:
            self.events.extend(i for i in items if isinstance(i, RawEvent))

    def fail(self, error: TensorHubError) -> None:
        self.failed.append(error)

    def on_progress(self, revision: int) -> None:
        with self.lock:
            self.progress.append(revision)

    def latest(self) -> int:
        with self.lock:
            return max(self.progress, default=0)


@pytest.mark.timeout(30)
def test_progress_notifications_reach_on_progress_past_writes_elsewhere(
    etcd: Etcd, keys: Keys
) -> None:
    base = f"{keys.prefix}/mux-progress/"
    _, now = etcd.get(base)
    seen = _Seen()
    mux = WatchMux(etcd, name="test-mux", on_progress=seen.on_progress)
    try:
        watch = mux.watch(base, prefix=True, start_revision=now + 1, deliver=seen.deliver,
                          fail=seen.fail)  # fmt: skip
        written = etcd.put(f"{base}a", "1")
        wait_until("the event", lambda: [e.revision for e in seen.events] == [written], 10)
        assert watch.active
        # a write elsewhere moves etcd's revision but brings the watch no event: only a
        # progress notification tells the owner it has seen everything through it
        elsewhere = etcd.put(f"{keys.prefix}/elsewhere", "x")
        time.sleep(UNSYNCED_GRACE + 0.05)  # past the grace after a create from the past
        deadline = time.monotonic() + 10
        while seen.latest() < elsewhere and time.monotonic() < deadline:
            mux.request_progress()
            time.sleep(0.1)
        assert seen.latest() >= elsewhere
        assert [e.revision for e in seen.events] == [written], "progress is not an event"
        assert not seen.failed
        mux.cancel(watch)
        assert not watch.active
    finally:
        mux.close()


def test_a_mux_without_on_progress_refuses_progress_requests(etcd: Etcd) -> None:
    mux = WatchMux(etcd, name="test-mux")
    try:
        with pytest.raises(InvalidArgument):
            mux.request_progress()
    finally:
        mux.close()
