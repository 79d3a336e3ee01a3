"""One etcd watch per watched model per hub replica, shared by every Watch stream it serves,
and every such watch on ONE multiplexed etcd stream, so threads do not grow with names.

Without sharing, 100 clients watching one model cost the replica 100 etcd watches and 100
decodes of every event. Here a stream that starts at a revision the shared watch has not
passed yet simply joins it, and receives each event already converted to its protobuf
message; a stream that asks for older history gets a private watch that replays it
(`start_revision` stays exact either way: nothing is lost or repeated).

Every etcd watch of the replica, shared or private, rides one etcd Watch stream
(`consistency.watch_mux.WatchMux`): one pump thread reads it and hands each event to every
subscriber's queue, waking their coroutines on the event loop with one
`loop.call_soon_threadsafe` per batch. So a tenant that watches 2,000 names (published or
not) costs 2,000 etcd watchers on that stream and no thread; opening or cancelling one is a
request queued on the stream, never a blocking call, so a flood of cancels stalls nobody.
The mux reconnects, resumes each watch after its last event, and re-lists a compacted one,
exactly as a watch of its own would (`consistency.watch`).

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
from consistency.watch import ModelEvents, RawEvent, Resync, WatchEvent
from consistency.watch_mux import MuxWatch, WatchMux
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
    """One model's etcd watch (on the replica's mux) and the subscriptions fed from it."""

    def __init__(self, keys: Keys, tenant: str, model: str, start: int) -> None:
        self.events = ModelEvents(keys, tenant, model)
        self.delivered_through = start - 1  # revision of the last event handed out
        self.subscribers: set[Subscription] = set()
        self.lock = threading.Lock()
        self.failed = False
        self.handle: MuxWatch | None = None

    def deliver(self, raws: Sequence[RawEvent | Resync]) -> None:
        """Hand a batch of etcd events to every subscriber (on the mux's thread), waking
        each coroutine once for the batch."""
        wakes: list[Subscription] = []
        with self.lock:
            for raw in raws:
                for event in self.events.translate(raw):
                    self._hand_out(event, wakes)
        Subscription.wake_all(wakes)

    def _hand_out(self, event: WatchEvent, wakes: list[Subscription]) -> None:
        message = event_to_pb(event)
        self.delivered_through = event.revision
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


class WatchFanout:
    """Shared watches of this replica, by (tenant, model), all on one `WatchMux`."""

    def __init__(self, etcd: Etcd, keys: Keys, streams: StreamLimits | None = None) -> None:
        self._etcd = etcd
        self._keys = keys
        self._streams = streams or StreamLimits(Limits())
        self._lock = threading.Lock()
        self._shared: dict[tuple[str, str], _SharedWatch] = {}
        self._replays: set[_PrivateSubscription] = set()
        self._mux: WatchMux | None = None  # started by the first subscribe
        self._closed = False

    def _live_mux(self) -> WatchMux:
        """The replica's mux (under `_lock`): a new one if none runs or the last one gave up
        (its watches have all been told, so nothing is left on it)."""
        if self._closed:
            raise Unavailable("this hub replica is stopping; watch through another")
        if self._mux is None or self._mux.failed is not None:
            if self._mux is not None:
                self._mux.close()  # its pump has already ended: no wait
            self._mux = WatchMux(self._etcd, name="fanout-mux")
        return self._mux

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
        with self._lock:
            mux = self._live_mux()
            shared = self._shared.get((tenant, model))
            if shared is None or shared.failed:
                shared = _SharedWatch(self._keys, tenant, model, start_revision)
                shared.handle = mux.watch(
                    shared.events.prefix, prefix=True, start_revision=start_revision,
                    deliver=shared.deliver, fail=shared.fail,
                )  # fmt: skip
                self._shared[(tenant, model)] = shared
            with shared.lock:
                if start_revision > shared.delivered_through:
                    sub = Subscription(start_revision, versions_only, loop)
                    shared.subscribers.add(sub)
                    return sub
            replay = _PrivateSubscription(
                self._keys, tenant, model, start_revision, versions_only, loop, self._streams
            )
            try:
                replay.handle = mux.watch(
                    replay.events.prefix, prefix=True, start_revision=start_revision,
                    deliver=replay.deliver, fail=replay.fail,
                )  # fmt: skip
            except BaseException:
                replay.close()
                raise
            self._replays.add(replay)
            return replay

    def unsubscribe(self, tenant: str, model: str, sub: Subscription) -> None:
        """Drop a subscription; a shared watch left with none is cancelled. Never blocks (a
        cancel is one request queued on the mux's stream), so a stream's coroutine calls it
        as it ends, and thousands of streams ending at once stall nobody."""
        sub.close()
        handle: MuxWatch | None = None
        with self._lock:
            mux = self._mux
            if isinstance(sub, _PrivateSubscription):
                self._replays.discard(sub)
                handle = sub.handle
            else:
                shared = self._shared.get((tenant, model))
                if shared is None:
                    return
                with shared.lock:
                    shared.subscribers.discard(sub)
                    idle = not shared.subscribers
                if idle:
                    del self._shared[(tenant, model)]
                    handle = shared.handle
        if handle is not None and mux is not None:
            mux.cancel(handle)

    def watchers(self) -> int:
        """etcd watches this replica runs now (shared and private), all on one stream."""
        with self._lock:
            return 0 if self._mux is None else len(self._mux)

    def close(self) -> None:
        """End every shared watch and replay, and the mux (waiting for its pump, bounded),
        so nothing is left using the etcd client after the hub closes it."""
        with self._lock:
            self._closed = True
            mux, self._mux = self._mux, None
            self._shared = {}
            replays, self._replays = list(self._replays), set()
        for replay in replays:
            replay.close()
        if mux is not None:
            mux.close()
