"""Serving a version from the command line until told to stop, and stopping gently.

`tensorhub publish` (and `fetch --serve`) hold a version and serve it to readers. They stop
on Ctrl-C (or SIGTERM), or, with `--until-replicated N`, once N other holders have it whole.
The first Ctrl-C does not cut off the readers that are fetching from this process at that
moment: it says how many there are and waits for them to finish (each becomes a holder, or
leaves), up to `drain_timeout`. A second Ctrl-C stops at once: those readers move to other
holders, or fail if there are none.

Who is reading is the hub's record (`Readers`): a reader that will hold the version
registers as a PARTIAL holder before its first byte and turns COMPLETE when it has
everything, or is removed when it gives up, so that count comes from the model's watch,
after an `inspect` that gives the state to start from. A reader that does not hold it
(`fetch_slices`, a plain `tensorhub fetch`) pins the version instead; pins have no watch
events, so while draining, `inspect` is read again every second for them.

Then the version is released with `force=True`: this process is about to exit, and a spill
to host memory (what a release without force does for the last holder of a retained
version) would die with it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from consistency.events import EventKind
from ros.cli.progress import Bar
from ros.client.handles import Held, Publication
from ros.client.hub import Hub
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import DeadlineExceeded, TensorHubError, VersionNotFound

DRAIN_TIMEOUT = 300.0  # the longest the first Ctrl-C waits for readers in flight
FORCED_RELEASE_TIMEOUT = 1.0  # reads in flight after a second Ctrl-C
RELEASE_TIMEOUT = 10.0
POLL = 0.5  # how often a wait looks at Ctrl-C between watch events
PINS_EVERY = 1.0  # how often a drain reads the version's pins again (they have no events)

Say = Callable[[str], None]


def say_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Interrupts:
    """Counts SIGINT and SIGTERM while in use (instead of raising `KeyboardInterrupt`), so a
    wait can end gently on the first and at once on the second; the old handlers come back
    on exit. `interrupt()` does what a signal does (tests, other threads)."""

    def __init__(self) -> None:
        self.count = 0
        self._old: dict[int, Any] = {}

    def interrupt(self, signum: int = signal.SIGINT, frame: FrameType | None = None) -> None:
        self.count += 1

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._old[signum] = signal.signal(signum, self.interrupt)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old.clear()


class Readers:
    """The other holders of `model@version` (of one shard, for a model-parallel version):
    `partial` (reading now) and `complete` (holding it whole), kept current from the watch."""

    def __init__(
        self, hub: Hub, model: str, version: int, shard: int | None, since: int | None = None
    ) -> None:
        """From the hub's records now (`inspect`), or, for the publisher, from every event
        since its publish at revision `since` (the way `Publication.wait_replicated` counts):
        a shard published before the last one is not visible yet, and `inspect` would not
        find its version."""
        self._me = hub.holder_name
        self.model, self.version, self.shard = model, version, shard
        self.partial: set[str] = set()
        self.complete: set[str] = set()
        if since is None:
            info = hub.inspect(model, version)
            for h in info.holders:
                shard_of = h.shard if h.HasField("shard") else None
                self._put(h.name, shard_of, h.state == pb.COMPLETE)
            since = int(info.revision) + 1
        self._since = since - 1  # events at or before it are in the state already
        self._events = hub.watch(model, since=since)
        self._hub = hub
        self.pins: set[str] = set()  # readers that hold nothing: their pins

    @property
    def in_flight(self) -> set[str]:
        """Readers fetching now: PARTIAL holders of our shard, and pins of readers that
        will hold nothing (as of the last `refresh_pins`)."""
        return self.partial | self.pins

    def refresh_pins(self) -> None:
        """Read the version's pins again; a PARTIAL holder's own pin (named after it) is
        counted with the holders, by shard, so only the others are kept."""
        try:
            info = self._hub.inspect(self.model, self.version)
        except VersionNotFound:  # a shard of a version not visible yet: no one reads it
            self.pins = set()
            return
        holders = {h.name for h in info.holders}
        self.pins = {p for p in info.pins if p not in holders}

    def _put(self, name: str, shard: int | None, complete: bool) -> None:
        if name == self._me or shard != self.shard:
            return
        (self.complete if complete else self.partial).add(name)
        (self.partial if complete else self.complete).discard(name)

    def poll(self, timeout: float) -> None:
        """Apply the next event, if one comes within `timeout` seconds."""
        event = self._events.get(timeout)
        if event is None or event.revision <= self._since:
            return
        if event.kind is EventKind.RESYNC:
            self.partial.clear()
            self.complete.clear()
            for h in event.holders.get(self.version, []):
                self._put(h.holder, h.shard, h.complete)
        elif event.version != self.version:
            return
        elif event.kind is EventKind.HOLDER_UPDATED and event.holder is not None:
            self._put(event.holder.holder, event.holder.shard, event.holder.complete)
        elif event.kind is EventKind.HOLDER_REMOVED:
            self.partial.discard(event.holder_name)
            self.complete.discard(event.holder_name)

    def close(self) -> None:
        self._events.close()


def wait_replicated(
    readers: Readers, n: int, interrupts: Interrupts, timeout: float, bar: Bar | None = None
) -> bool:
    """Wait until `n` other holders have the version whole (True), or a Ctrl-C (False);
    `DeadlineExceeded` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while len(readers.complete) < n:
        if interrupts.count:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(
                f"{readers.model}@{readers.version}: {len(readers.complete)} of {n} readers "
                f"hold it after {timeout:.0f}s"
            )
        readers.poll(min(POLL, left))
        if bar is not None:
            bar.reach(min(n, len(readers.complete)))
    return True


def wait_interrupted(readers: Readers, interrupts: Interrupts) -> None:
    """Serve until the first Ctrl-C, keeping the count of readers current."""
    while not interrupts.count:
        readers.poll(POLL)


def drain(
    readers: Readers, interrupts: Interrupts, say: Say, timeout: float = DRAIN_TIMEOUT
) -> bool:
    """Wait for the readers in flight to finish, saying so: True when none is left, False
    on one more Ctrl-C (the second) or after `timeout` seconds (then they are cut off)."""
    ctrl_c = interrupts.count
    if ctrl_c >= 2:
        return False
    readers.poll(0.0)
    readers.refresh_pins()
    if not readers.in_flight:
        return True
    busy = sorted(readers.in_flight)
    names = ", ".join(busy[:3]) + (", ..." if len(busy) > 3 else "")
    say(  # records, not readers: a reader of slices pins per call and may pin around them
        f"waiting for the readers in flight to finish (their records: {names}); "
        "Ctrl-C again to stop now"
    )
    deadline = time.monotonic() + timeout
    pins_read = time.monotonic()
    while readers.in_flight:
        if interrupts.count > ctrl_c:
            say(f"stopping now: the readers in flight are cut off ({len(readers.in_flight)})")
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            say(f"stopping: readers still in flight after {timeout:.0f}s")
            return False
        readers.poll(min(POLL, left))
        if time.monotonic() - pins_read >= PINS_EVERY:
            readers.refresh_pins()
            pins_read = time.monotonic()
    say("no reader in flight any more")
    return True


def stop(hub: Hub, handle: Publication | Held, readers: Readers, gentle: bool, say: Say) -> None:
    """Release the version (force: the process is about to exit) and say whether anyone
    else still holds it."""
    others = len(readers.complete)
    try:
        handle.release(force=True, timeout=RELEASE_TIMEOUT if gentle else FORCED_RELEASE_TIMEOUT)
    except TensorHubError as exc:  # the session's end removes the record all the same
        say(f"release of {readers.model}@{readers.version} failed ({exc}); closing")
    what = f"{readers.model}@{readers.version}"
    if others:
        say(f"released {what}; {others} other holder(s) still serve it")
    else:
        say(f"released {what}; no other holder had it whole: it is not readable any more")
