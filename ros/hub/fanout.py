"""One etcd watch per model per hub replica, shared by every Watch stream it serves.

Without sharing, 100 clients watching one model cost the replica 100 etcd watch streams,
100 watch threads and 100 decodes of every event. Here a stream that starts at a revision the
shared watch has not passed yet simply joins it, and receives each event already converted
to its protobuf message; a stream that asks for older history gets a private watch that
replays it (`start_revision` stays exact either way: nothing is lost or repeated).

Watch streams are coroutines on the hub's event loop (`ros.hub.server`); the shared watch's
pump thread (one per model, not per stream) hands each event to every subscriber's queue and
wakes its coroutine with `loop.call_soon_threadsafe`. A subscriber's backlog is bounded
(`MAX_BACKLOG`): one that falls that far behind is cut off with `Unavailable`, and its client
resumes from its last revision. Private replays each hold an etcd watch and two threads, so
a replica runs at most `Limits.max_private_watches` of them at once (`Overloaded` past that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from consistency import Etcd, Keys, ModelWatch
from consistency.watch import WatchClosed, WatchEvent
from ros.hub.convert import event_to_pb
from ros.hub.limits import Limits, StreamLimits
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import TensorHubError, Unavailable

log = logging.getLogger(__name__)

MAX_BACKLOG = 10_000  # events queued for one subscriber before it is cut off


_VERSION_KINDS = (pb.WatchEvent.VERSION_PUBLISHED, pb.WatchEvent.RESYNC)


def wanted(message: pb.WatchEvent, versions_only: bool) -> bool:
    """Whether a stream with this filter receives `message` (RESYNC always goes through)."""
    return not versions_only or message.kind in _VERSION_KINDS


class Subscription:
    """The events of one Watch stream, from its start revision on: filled by a pump thread,
    drained by the stream's coroutine on `loop`."""

    def __init__(
        self, start_revision: int, versions_only: bool, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.start_revision = start_revision
        self.versions_only = versions_only
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[pb.WatchEvent] = deque()
        self._error: TensorHubError | None = None
        self._ready = asyncio.Event()
        self.closed = False

    def offer(self, item: pb.WatchEvent, wakes: list[Subscription] | None = None) -> bool:
        """Queue an event (from any thread); False if the subscriber already has
        `MAX_BACKLOG` waiting (it is too far behind: the caller cuts it off). With `wakes`,
        a subscriber to wake is added there (see `wake_all`) instead of woken now."""
        with self._lock:
            if len(self._items) >= MAX_BACKLOG:
                return False
            wake = not self._items
            self._items.append(item)
        if wake:
            if wakes is None:
                self._wake()
            else:
                wakes.append(self)
        return True

    def fail(self, exc: TensorHubError) -> None:
        """End the subscription with `exc`, raised to the stream at its next read (events
        still queued are dropped: the client resumes after the last one it received)."""
        with self._lock:
            if self._error is None:
                self._error = exc
        self._wake()

    def _wake(self) -> None:
        # A closed loop means the hub is stopping: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._ready.set)

    @staticmethod
    def wake_all(subs: list[Subscription]) -> None:
        """Wake many subscribers with one hop per event loop, not one each: an event for
        2,000 watchers of a model is one `call_soon_threadsafe`, not 2,000."""
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for sub in subs:
            by_loop.setdefault(sub._loop, []).append(sub._ready)
        for loop, events in by_loop.items():
            with contextlib.suppress(RuntimeError):  # closed: the hub is stopping
                loop.call_soon_threadsafe(_set_all, events)

    async def next(self) -> pb.WatchEvent:
        """The next event (waiting on the loop, no thread), or the error that ended it."""
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._items:
                    return self._items.popleft()
                self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        self.closed = True


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


class _PrivateSubscription(Subscription):
    """A subscription with its own etcd watch, for a start revision the shared one has
    passed; a forwarder thread moves the watch's events into the subscription's queue."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        tenant: str,
        model: str,
        start: int,
        versions_only: bool,
        loop: asyncio.AbstractEventLoop,
        streams: StreamLimits,
    ) -> None:
        super().__init__(start, versions_only, loop)
        streams.acquire_private()
        self._streams = streams
        self._released = False
        self._stop = threading.Event()
        try:
            self._watch = ModelWatch(etcd, keys, tenant, model, start_revision=start)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._forward, name=f"replay-{model}", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    event = self._watch.get(0.5)
                except WatchClosed:
                    return
                except TensorHubError as exc:
                    self.fail(exc)
                    return
                except Exception as exc:  # e.g. the etcd channel closed under a stopping hub
                    if not self._stop.is_set():
                        log.warning("watch replay failed: %r", exc)
                        self.fail(Unavailable(f"watch replay failed ({exc}); resume it"))
                    return
                if event is None:
                    continue
                message = event_to_pb(event)
                if wanted(message, self.versions_only) and not self.offer(message):
                    self.fail(Unavailable("watch subscriber fell too far behind; resume it"))
                    return
        finally:
            self._watch.close()
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._streams.release_private()

    def close(self) -> None:
        """Stop the replay; its thread closes the etcd watch and frees the slot (the stream's
        coroutine does not wait for that)."""
        super().close()
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait for the replay's thread to end (after `close`)."""
        self._thread.join(timeout)


class _SharedWatch:
    """One model's etcd watch and the subscriptions fed from it, pumped by one thread."""

    def __init__(self, etcd: Etcd, keys: Keys, tenant: str, model: str, start: int) -> None:
        self.watch = ModelWatch(etcd, keys, tenant, model, start_revision=start)
        self.delivered_through = start - 1  # revision of the last event handed out
        self.subscribers: set[Subscription] = set()
        self.lock = threading.Lock()
        self.failed = False
        self.thread = threading.Thread(target=self._pump, name=f"fanout-{model}", daemon=True)

    def _pump(self) -> None:
        while True:
            try:
                event = self.watch.get(0.5)
            except WatchClosed:
                return
            except TensorHubError as exc:
                self._fail(exc)
                return
            if event is not None:
                self._hand_out(event)

    def _hand_out(self, event: WatchEvent) -> None:
        message = event_to_pb(event)
        wakes: list[Subscription] = []
        with self.lock:
            self.delivered_through = event.revision
            for sub in list(self.subscribers):
                if event.revision < sub.start_revision or not wanted(message, sub.versions_only):
                    continue
                if not sub.offer(message, wakes):
                    self.subscribers.discard(sub)
                    sub.fail(Unavailable("watch subscriber fell too far behind; resume it"))
        Subscription.wake_all(wakes)

    def _fail(self, exc: TensorHubError) -> None:
        with self.lock:
            self.failed = True
            for sub in self.subscribers:
                sub.fail(exc)
            self.subscribers.clear()


class WatchFanout:
    """Shared watches of this replica, by (tenant, model)."""

    def __init__(self, etcd: Etcd, keys: Keys, streams: StreamLimits | None = None) -> None:
        self._etcd = etcd
        self._keys = keys
        self._streams = streams or StreamLimits(Limits())
        self._lock = threading.Lock()
        self._shared: dict[tuple[str, str], _SharedWatch] = {}
        self._replays: set[_PrivateSubscription] = set()
        # Closing an etcd watch joins its thread: done here, never on the event loop.
        self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fanout-close")

    def subscribe(
        self,
        tenant: str,
        model: str,
        start_revision: int,
        versions_only: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> Subscription:
        """Events of tenant/model from `start_revision` (explicit, > 0) on, delivered to a
        coroutine on `loop`; with `versions_only`, only new versions (and resyncs). Never
        blocks on etcd: a new watch only starts its threads. `Overloaded` if a private
        replay is needed and the replica runs its limit of them."""
        with self._lock:
            shared = self._shared.get((tenant, model))
            if shared is None or shared.failed:
                shared = _SharedWatch(self._etcd, self._keys, tenant, model, start_revision)
                self._shared[(tenant, model)] = shared
                shared.thread.start()
            with shared.lock:
                if start_revision > shared.delivered_through:
                    sub = Subscription(start_revision, versions_only, loop)
                    shared.subscribers.add(sub)
                    return sub
        replay = _PrivateSubscription(
            self._etcd, self._keys, tenant, model, start_revision, versions_only, loop,
            self._streams,
        )  # fmt: skip
        with self._lock:
            self._replays.add(replay)
        return replay

    def unsubscribe(self, tenant: str, model: str, sub: Subscription) -> None:
        """Drop a subscription; a shared watch left with none is closed (in the background:
        this never blocks, so a stream's coroutine may call it as it ends)."""
        sub.close()
        with self._lock:
            if isinstance(sub, _PrivateSubscription):
                self._replays.discard(sub)
            shared = self._shared.get((tenant, model))
            if shared is None:
                return
            with shared.lock:
                shared.subscribers.discard(sub)
                idle = not shared.subscribers
            if idle:
                del self._shared[(tenant, model)]
        if shared is not None and idle:
            try:
                self._closer.submit(shared.watch.close)
            except RuntimeError:  # closer shut down: the hub is stopping
                shared.watch.close()

    def close(self) -> None:
        """Close every shared watch and replay (waiting for their threads) and the closer,
        so none of them is left using the etcd client after the hub closes it."""
        with self._lock:
            shared, self._shared = list(self._shared.values()), {}
            replays, self._replays = list(self._replays), set()
        for replay in replays:
            replay.close()
        self._closer.shutdown(wait=True)
        for watch in shared:
            watch.watch.close()
        for replay in replays:
            replay.join(timeout=5)
