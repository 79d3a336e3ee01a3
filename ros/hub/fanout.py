"""The Watch streams of a hub replica: one etcd watch per watched model, shared by every
stream that watches it, and by the model's holder index (`ros.hub.model_feed`).

A stream that starts at a revision the model's shared watch has not passed yet simply joins
it, and receives each event already converted to its protobuf message; a stream that asks
for older history gets a private watch that replays it (`start_revision` stays exact either
way: nothing is lost or repeated). So 100 clients watching one model cost the replica one
etcd watch and one decode of every event.

Every etcd watch of the replica, shared or private, rides one etcd Watch stream
(`consistency.watch_mux.WatchMux`, owned by `ros.hub.model_feed.ModelFeeds`): one pump
thread reads it and hands each event to every subscriber's queue, waking their coroutines
on the event loop with one `loop.call_soon_threadsafe` per batch. So a tenant that watches
2,000 names (published or not) costs 2,000 etcd watchers on that stream and no thread;
opening or cancelling one is a request queued on the stream, never a blocking call, so a
flood of cancels stalls nobody. The mux reconnects, resumes each watch after its last event,
and re-lists a compacted one (`consistency.watch_mux`).

Watch streams are coroutines on the hub's event loop (`ros.hub.server`). A subscriber's
backlog is bounded (`MAX_BACKLOG`): one that falls that far behind is cut off with
`Unavailable`, and its client resumes from its last revision. The distinct models a tenant
watches and the private replays (per replica and per tenant) are bounded by
`ros.hub.limits` (`Overloaded` past them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Sequence

from consistency import Etcd, Keys
from consistency.events import WatchEvent
from consistency.watch import ModelEvents
from consistency.watch_mux import MuxWatch, RawEvent, Resync
from ros.hub.convert import event_to_pb
from ros.hub.limits import Limits, StreamLimits
from ros.hub.model_feed import Feed, ModelFeeds
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
    """A subscription with an etcd watch of its own (on the replica's mux), for a start
    revision the shared one has passed; it holds one private replay slot of its tenant
    (`StreamLimits.acquire_private`) until closed."""

    def __init__(
        self,
        keys: Keys,
        tenant: str,
        model: str,
        start: int,
        versions_only: bool,
        loop: asyncio.AbstractEventLoop,
        streams: StreamLimits,
    ) -> None:
        super().__init__(start, versions_only, loop)
        streams.acquire_private(tenant)
        self._tenant = tenant
        self._streams = streams
        self._released = False
        self.events = ModelEvents(keys, tenant, model)
        self.handle: MuxWatch | None = None

    def deliver(self, raws: Sequence[RawEvent | Resync]) -> None:
        """Queue a batch of the replay's etcd events (on the mux's thread)."""
        wakes: list[Subscription] = []
        for raw in raws:
            for event in self.events.translate(raw):
                message = event_to_pb(event)
                if not wanted(message, self.versions_only) or self.closed:
                    continue
                if not self.offer(message, wakes):
                    self.fail(Unavailable("watch subscriber fell too far behind; resume it"))
                    return
        Subscription.wake_all(wakes)

    def close(self) -> None:
        """Free the replay's slot (its etcd watch is cancelled by `WatchFanout`)."""
        super().close()
        with self._lock:
            if self._released:
                return
            self._released = True
        self._streams.release_private(self._tenant)


class _SharedWatch:
    """The fan-out's sink on one model's feed: the Watch streams fed from it."""

    def __init__(self, keys: Keys, tenant: str, model: str) -> None:
        self.events = ModelEvents(keys, tenant, model)
        self.subscribers: set[Subscription] = set()
        self.lock = threading.Lock()
        self.failed = False
        self.feed: Feed | None = None

    def deliver(self, raws: Sequence[RawEvent | Resync]) -> None:
        """Hand a batch of etcd events to every subscriber (on the mux's thread, under the
        feed's lock), waking each coroutine once for the batch."""
        wakes: list[Subscription] = []
        with self.lock:
            for raw in raws:
                for event in self.events.translate(raw):
                    self._hand_out(event, wakes)
        Subscription.wake_all(wakes)

    def _hand_out(self, event: WatchEvent, wakes: list[Subscription]) -> None:
        message = event_to_pb(event)
        for sub in list(self.subscribers):
            if event.revision < sub.start_revision or not wanted(message, sub.versions_only):
                continue
            if not sub.offer(message, wakes):
                self.subscribers.discard(sub)
                sub.fail(Unavailable("watch subscriber fell too far behind; resume it"))

    def fail(self, exc: TensorHubError) -> None:
        """The etcd watch ended (named): every subscriber ends with it and resumes; the next
        subscribe of the model starts a new shared watch."""
        with self.lock:
            self.failed = True
            for sub in self.subscribers:
                sub.fail(exc)
            self.subscribers.clear()

    def progress(self, revision: int) -> None:
        """Streams need no progress notifications (their clients resume from events)."""


class WatchFanout:
    """Shared watches of this replica, by (tenant, model), all on the replica's one mux.

    `feeds`: the replica's model feeds, shared with its holder index (one of its own when
    not given)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        streams: StreamLimits | None = None,
        feeds: ModelFeeds | None = None,
    ) -> None:
        self._keys = keys
        self._streams = streams or StreamLimits(Limits())
        self._own_feeds = feeds is None
        self._feeds = feeds or ModelFeeds(etcd)
        self._lock = threading.Lock()
        self._shared: dict[tuple[str, str], _SharedWatch] = {}
        self._replays: set[_PrivateSubscription] = set()
        self._closed = False

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
        blocks on etcd: a new watch is one request queued on the mux's stream. `Overloaded`
        if a private replay is needed and the replica or the tenant runs its limit of them."""
        if self._closed:
            raise Unavailable("this hub replica is stopping; watch through another")
        sub = Subscription(start_revision, versions_only, loop)
        with self._lock:
            shared = self._shared.get((tenant, model))
            if shared is None or shared.failed:
                created = _SharedWatch(self._keys, tenant, model)
                created.subscribers.add(sub)  # before it is fed: it misses nothing
                created.feed = self._feeds.join(
                    tenant, model, created.events.prefix, created, start_revision, exact=True
                )
                if created.feed is not None:
                    self._shared[(tenant, model)] = created
                    return sub
            elif shared.feed is not None:
                with shared.feed.lock, shared.lock:
                    if start_revision > shared.feed.delivered_through:
                        shared.subscribers.add(sub)
                        return sub
            replay = _PrivateSubscription(
                self._keys, tenant, model, start_revision, versions_only, loop, self._streams
            )
            try:
                replay.handle = self._feeds.mux().watch(
                    replay.events.prefix, prefix=True, start_revision=start_revision,
                    deliver=replay.deliver, fail=replay.fail,
                )  # fmt: skip
            except BaseException:
                replay.close()
                raise
            self._replays.add(replay)
            return replay

    def unsubscribe(self, tenant: str, model: str, sub: Subscription) -> None:
        """Drop a subscription; a shared watch left with none leaves its feed (whose etcd
        watch is cancelled if nothing else uses it). Never blocks (a cancel is one request
        queued on the mux's stream), so a stream's coroutine calls it as it ends, and
        thousands of streams ending at once stall nobody."""
        sub.close()
        with self._lock:
            if isinstance(sub, _PrivateSubscription):
                self._replays.discard(sub)
                if sub.handle is not None:
                    self._feeds.cancel(sub.handle)
                return
            shared = self._shared.get((tenant, model))
            if shared is None:
                return
            with shared.lock:
                shared.subscribers.discard(sub)
                idle = not shared.subscribers
            if not idle:
                return
            del self._shared[(tenant, model)]
        if shared.feed is not None:
            self._feeds.leave(shared.feed, shared)

    def watchers(self) -> int:
        """etcd watches this replica runs now (model feeds and private replays), all on one
        stream."""
        return self._feeds.watchers()

    def close(self) -> None:
        """End every shared watch and replay (and the feeds, when they are its own), so
        nothing is left using the etcd client after the hub closes it."""
        with self._lock:
            self._closed = True
            shared, self._shared = list(self._shared.values()), {}
            replays, self._replays = list(self._replays), set()
        for replay in replays:
            replay.close()
            if replay.handle is not None:
                self._feeds.cancel(replay.handle)
        for watch in shared:
            if watch.feed is not None:
                self._feeds.leave(watch.feed, watch)
        if self._own_feeds:
            self._feeds.close()
