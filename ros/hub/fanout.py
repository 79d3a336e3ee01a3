"""One etcd watch per model per hub replica, shared by every Watch stream it serves.

Without sharing, 100 clients watching one model cost the replica 100 etcd watch streams,
100 watch threads and 100 decodes of every event. Here a stream that starts at a revision the
shared watch has not passed yet simply joins it, and receives each event already converted
to its protobuf message; a stream that asks for older history gets a private watch that
replays it (`start_revision` stays exact either way: nothing is lost or repeated).
A subscriber that falls too far behind is cut off; its client resumes from its last revision.
"""

from __future__ import annotations

import logging
import queue
import threading

from consistency import Etcd, Keys, ModelWatch
from consistency.watch import WatchClosed, WatchEvent
from ros.hub.convert import event_to_pb
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import TensorHubError, Unavailable

log = logging.getLogger(__name__)

MAX_BACKLOG = 10_000  # events queued for one subscriber before it is cut off


_VERSION_KINDS = (pb.WatchEvent.VERSION_PUBLISHED, pb.WatchEvent.RESYNC)


def wanted(message: pb.WatchEvent, versions_only: bool) -> bool:
    """Whether a stream with this filter receives `message` (RESYNC always goes through)."""
    return not versions_only or message.kind in _VERSION_KINDS


class Subscription:
    """The events of one Watch stream, from its start revision on."""

    def __init__(self, start_revision: int, versions_only: bool = False) -> None:
        self.start_revision = start_revision
        self.versions_only = versions_only
        self._queue: queue.Queue[pb.WatchEvent | TensorHubError] = queue.Queue(MAX_BACKLOG)
        self._on_close: list[object] = []
        self.closed = False

    def offer(self, item: pb.WatchEvent | TensorHubError) -> bool:
        """Queue an item; False if the subscriber is too far behind (it is then failed)."""
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    def get(self, timeout: float) -> pb.WatchEvent | None:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, TensorHubError):
            raise item
        return item

    def close(self) -> None:
        self.closed = True


class _PrivateSubscription(Subscription):
    """A subscription with its own etcd watch, for a start revision the shared one has passed."""

    def __init__(
        self, etcd: Etcd, keys: Keys, tenant: str, model: str, start: int, versions_only: bool
    ) -> None:
        super().__init__(start, versions_only)
        self._watch = ModelWatch(etcd, keys, tenant, model, start_revision=start)

    def get(self, timeout: float) -> pb.WatchEvent | None:
        event = self._watch.get(timeout)
        if event is None:
            return None
        message = event_to_pb(event)
        return message if wanted(message, self.versions_only) else None

    def close(self) -> None:
        super().close()
        self._watch.close()


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
        with self.lock:
            self.delivered_through = event.revision
            for sub in list(self.subscribers):
                if event.revision < sub.start_revision or not wanted(message, sub.versions_only):
                    continue
                if not sub.offer(message):
                    self.subscribers.discard(sub)
                    sub.offer(Unavailable("watch subscriber fell too far behind; resume it"))

    def _fail(self, exc: TensorHubError) -> None:
        with self.lock:
            self.failed = True
            for sub in self.subscribers:
                sub.offer(exc)
            self.subscribers.clear()


class WatchFanout:
    """Shared watches of this replica, by (tenant, model)."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self._etcd = etcd
        self._keys = keys
        self._lock = threading.Lock()
        self._shared: dict[tuple[str, str], _SharedWatch] = {}

    def subscribe(
        self, tenant: str, model: str, start_revision: int, versions_only: bool = False
    ) -> Subscription:
        """Events of tenant/model from `start_revision` (explicit, > 0) on; with
        `versions_only`, only new versions (and resyncs)."""
        with self._lock:
            shared = self._shared.get((tenant, model))
            if shared is None or shared.failed:
                shared = _SharedWatch(self._etcd, self._keys, tenant, model, start_revision)
                self._shared[(tenant, model)] = shared
                shared.thread.start()
            with shared.lock:
                if start_revision > shared.delivered_through:
                    sub = Subscription(start_revision, versions_only)
                    shared.subscribers.add(sub)
                    return sub
        return _PrivateSubscription(
            self._etcd, self._keys, tenant, model, start_revision, versions_only
        )

    def unsubscribe(self, tenant: str, model: str, sub: Subscription) -> None:
        """Drop a subscription; a shared watch left with none is closed."""
        sub.close()
        with self._lock:
            shared = self._shared.get((tenant, model))
            if shared is None:
                return
            with shared.lock:
                shared.subscribers.discard(sub)
                idle = not shared.subscribers
            if idle:
                del self._shared[(tenant, model)]
        if shared is not None and idle:
            shared.watch.close()

    def close(self) -> None:
        with self._lock:
            shared, self._shared = list(self._shared.values()), {}
        for watch in shared:
            watch.watch.close()
