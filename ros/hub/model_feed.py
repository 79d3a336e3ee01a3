"""One etcd watch per hot model per hub replica, shared by the holder index and the fan-out.

A model is hot on a replica when it is indexed for Resolve (`ros.hub.holder_index`) or
watched by a client (`ros.hub.fanout`), or both. Either way it costs ONE etcd watch, a
`Feed`: the watch's items (`RawEvent`, `Resync`) go to every sink attached to it (the
model's index, the fan-out's shared watch of it), in order, once each. Every feed rides the
replica's one multiplexed etcd Watch stream (`consistency.watch_mux.WatchMux`), so a hot
model costs no thread either: the replica's watch threads are the mux's, fixed whatever the
number of models (its pump, gRPC's feeder of its request side, its re-list worker).

A sink that needs every item from some revision on joins with `exact=True`: it is attached
only if the feed has not passed that revision (else it replays on a watch of its own, as
the fan-out's private replays do). The index joins at any point and reads the model at the
revision the feed has delivered through (`Feed.delivered_through`), so that what it read
and what the feed delivers after meet exactly.

Progress: the index must know how current it is when nothing under its model changes, as
Kubernetes' watch cache does. `ModelFeeds.request_progress` asks etcd for a progress
notification on the mux's stream; etcd answers with a revision through which every watch of
the stream has delivered (releases before etcd-io/etcd#15220's fix may answer before a
watcher created in the past has caught up: a notification that soon after such a create is
dropped, and the index counts one only once the next one confirms it). Each active feed
hands it to its sinks (`Sink.progress`). The price of one stream: on etcd releases with the
fix, a notification waits until every watch of the stream has caught up, so a replay from
far back delays it for every index of the replica (a Resolve that cannot wait reads etcd
directly, `ros.hub.holder_index.FRESH_WAIT`); and on older ones, watches created from the
past keep resetting the mux's grace (`consistency.watch_mux.UNSYNCED_GRACE`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from consistency import Etcd
from consistency.watch_mux import MuxWatch, RawEvent, Resync, WatchMux
from tensorhub.errors import TensorHubError, Unavailable

log = logging.getLogger(__name__)

Item = RawEvent | Resync


class Sink(Protocol):
    """What a feed hands its items to. Called on the mux's thread, under the feed's lock:
    each must be quick and must not block."""

    def deliver(self, items: Sequence[Item]) -> None: ...

    def fail(self, error: TensorHubError) -> None: ...

    def progress(self, revision: int) -> None: ...


class Feed:
    """One model's etcd watch and the sinks it feeds."""

    def __init__(self, key: tuple[str, str], start_revision: int) -> None:
        self.key = key
        self.lock = threading.Lock()
        self.delivered_through = start_revision - 1  # revision of the last item handed out
        self.sinks: list[Sink] = []
        self.handle: MuxWatch | None = None
        self.failed = False

    def deliver(self, items: Sequence[Item]) -> None:
        """Hand a batch of the watch's items to every sink (on the mux's thread)."""
        with self.lock:
            for item in items:
                self.delivered_through = max(self.delivered_through, item.revision)
            for sink in self.sinks:
                sink.deliver(items)

    def fail(self, error: TensorHubError) -> None:
        """The etcd watch ended (named): every sink ends with it; the next join of the model
        starts a new feed."""
        with self.lock:
            self.failed = True
            sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.fail(error)

    def progress(self, revision: int) -> None:
        """etcd's progress notification: this feed's watch has delivered through `revision`,
        if it is created and not being re-listed."""
        with self.lock:
            handle = self.handle
            if self.failed or handle is None or not handle.active:
                return
            for sink in self.sinks:
                sink.progress(revision)


class ModelFeeds:
    """A replica's feeds, by (tenant, model), on one multiplexed etcd Watch stream; also the
    stream the fan-out's private replays ride (`mux`)."""

    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd
        self._lock = threading.Lock()
        self._feeds: dict[tuple[str, str], Feed] = {}
        self._mux: WatchMux | None = None  # started by the first watch
        self._closed = False

    def mux(self) -> WatchMux:
        """The replica's live mux: a new one if none runs or the last one gave up (its
        watches have all been told, so nothing is left on it)."""
        with self._lock:
            return self._live_mux()

    def _live_mux(self) -> WatchMux:
        if self._closed:
            raise Unavailable("this hub replica is stopping; watch through another")
        if self._mux is None or self._mux.failed is not None:
            if self._mux is not None:
                self._mux.close()  # its pump has already ended: no wait
            self._mux = WatchMux(self._etcd, name="feed-mux", on_progress=self._progress)
        return self._mux

    def join(
        self, tenant: str, model: str, prefix: str, sink: Sink, start_revision: int, *, exact: bool
    ) -> Feed | None:
        """Attach `sink` to the model's feed (watching `prefix`); a new feed starts at
        `start_revision` when none is live. Returns the feed: the sink receives every item
        after its `delivered_through` as read now. With `exact`, None (and not attached) when
        that is at or past `start_revision`: the sink would miss items it needs. Never
        blocks on etcd: a new watch is one request queued on the mux's stream."""
        key = (tenant, model)
        with self._lock:
            mux = self._live_mux()
            feed = self._feeds.get(key)
            if feed is None or feed.failed:
                feed = Feed(key, start_revision)
                feed.sinks.append(sink)
                feed.handle = mux.watch(
                    prefix, prefix=True, start_revision=start_revision,
                    deliver=feed.deliver, fail=feed.fail,
                )  # fmt: skip
                self._feeds[key] = feed
                return feed
            with feed.lock:
                if exact and feed.delivered_through >= start_revision:
                    return None
                feed.sinks.append(sink)
            return feed

    def leave(self, feed: Feed, sink: Sink) -> None:
        """Detach `sink`; a feed left with none is cancelled (one request queued)."""
        with self._lock:
            with feed.lock:
                if sink in feed.sinks:
                    feed.sinks.remove(sink)
                idle = not feed.sinks
            if not idle:
                return
            if self._feeds.get(feed.key) is feed:
                del self._feeds[feed.key]
            mux, handle = self._mux, feed.handle
        if mux is not None and handle is not None:
            mux.cancel(handle)

    def cancel(self, handle: MuxWatch) -> None:
        """Cancel a watch made on `mux()` (one request queued; none if that mux has ended)."""
        with self._lock:
            mux = self._mux
        if mux is not None:
            mux.cancel(handle)

    def request_progress(self) -> None:
        """Ask etcd for a progress notification on the stream (see the module docstring)."""
        with self._lock:
            mux = self._mux
        if mux is not None:
            mux.request_progress()

    def _progress(self, revision: int) -> None:
        with self._lock:
            feeds = list(self._feeds.values())
        for feed in feeds:
            feed.progress(revision)

    def feeds(self) -> int:
        """Models fed now (one etcd watch each)."""
        with self._lock:
            return len(self._feeds)

    def watchers(self) -> int:
        """etcd watches on the replica's stream now: one per feed, plus private replays."""
        with self._lock:
            return 0 if self._mux is None else len(self._mux)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            mux, self._mux = self._mux, None
            self._feeds.clear()
        if mux is not None:
            mux.close()
