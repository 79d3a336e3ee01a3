"""Watches for a consumer that blocks: `KeyWatch`, and a model's events (`ModelEvents`).

`KeyWatch` streams etcd's events for a key or prefix from `start_revision` (always explicit:
0 would mean "now" to etcd and silently skip history) to a consumer that calls `get` or
iterates. It is a queue over a `consistency.watch_mux.WatchMux` of its own, the one etcd
watch implementation, and keeps its guarantees: across reconnects every event is delivered
exactly once, in order; after a compaction it yields one `Resync` holding every key under
the watched range as read at a current revision R, then resumes from R + 1.

Progress (opt-in, `progress=True`): a cache fed by a watch must know how current it is even
when nothing under its range changes. Such a watch also yields `Progress(revision)`: after
the events of each etcd response (every event up to that revision has been delivered), and
for every etcd progress notification that `request_progress()` asks for, once the watch is
created and not being re-listed (`notified=True`; see `watch_mux.UNSYNCED_GRACE`). A watch
without the flag never yields one.

`ModelEvents` turns the raw events under one model's prefix into `WatchEvent`s (new
versions, holder changes): the hub's fan-out reads every model watch through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Self

from consistency.etcd import Etcd
from consistency.events import EventKind, WatchEvent
from consistency.keys import Keys
from consistency.records import HolderRecord
from consistency.stream import Inbox
from consistency.watch_mux import MuxWatch, Progress, RawEvent, Resync, WatchMux, check_start
from tensorhub.errors import InvalidArgument

__all__ = ["KeyWatch", "ModelEvents", "Progress", "RawEvent", "Resync"]

Item = RawEvent | Resync | Progress


class KeyWatch:
    """A resumable watch on a key or prefix, delivering its items exactly once, in order
    (module docstring). A failure that ends it (an etcd refusal, a stream that cannot be
    reopened) is raised by `get`, named."""

    def __init__(
        self, etcd: Etcd, key: str, *, prefix: bool, start_revision: int, progress: bool = False
    ) -> None:
        check_start(start_revision)
        self._closed = threading.Event()
        self._inbox: Inbox[Item] = Inbox(self._closed)
        self._progress = progress
        self._watch: MuxWatch | None = None
        self._mux = WatchMux(etcd, f"watch-{key}", on_progress=self._notified if progress else None)
        self._watch = self._mux.watch(
            key, prefix=prefix, start_revision=start_revision,
            deliver=self._deliver, fail=self._inbox.put,
        )  # fmt: skip

    @property
    def next_revision(self) -> int:
        """The revision after the last item delivered."""
        return self._watch.next_revision if self._watch is not None else 0

    @property
    def reconnects(self) -> int:
        """How often the etcd stream was reopened."""
        return self._mux.reconnects

    def request_progress(self) -> None:
        """Ask etcd for a progress notification (needs `progress`). It arrives as a
        `Progress` item, unless the stream is reconnecting (ask again) or etcd has nothing
        to report for a watcher still catching up."""
        if not self._progress:
            raise InvalidArgument("request_progress needs a watch created with progress=True")
        self._mux.request_progress()

    def get(self, timeout: float) -> Item | None:
        """The next item, or None if none arrives within `timeout` seconds."""
        return self._inbox.get(timeout)

    def __iter__(self) -> Iterator[Item]:
        """Blocks between items; ends when the watch is closed."""
        return iter(self._inbox)

    def force_reconnect(self) -> None:
        """Break the etcd stream (as a member failure would); the watch resumes by itself."""
        self._mux.force_reconnect()

    def close(self) -> None:
        self._closed.set()
        self._mux.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the mux's threads --------------------------------------------------------------

    def _deliver(self, items: Sequence[RawEvent | Resync]) -> None:
        """One etcd response's events (or one re-list), then, with `progress`, the revision
        they reach."""
        for item in items:
            self._inbox.put(item)
        last = items[-1] if items else None
        if self._progress and isinstance(last, RawEvent):
            self._inbox.put(Progress(last.revision))

    def _notified(self, revision: int) -> None:
        """etcd's progress notification: it holds for this watch once it is created and not
        being re-listed, and only if it does not fall behind what was delivered."""
        watch = self._watch
        if watch is not None and watch.active and revision >= watch.next_revision - 1:
            self._inbox.put(Progress(revision, notified=True))


class ModelEvents:
    """Turns the raw etcd events under one model's prefix into `WatchEvent`s: the hub's
    fan-out reads each model watch it multiplexes over one etcd stream through it."""

    def __init__(self, keys: Keys, tenant: str, model: str) -> None:
        self._keys = keys
        self._tenant = tenant
        self._model = model
        self._latest_key = keys.latest(tenant, model)
        self.prefix = keys.model(tenant, model)  # the key range a model watch covers

    def translate(self, raw: RawEvent | Resync) -> list[WatchEvent]:
        """The model events one raw event (or re-list) means: none for keys that are not
        `latest` or a holder record."""
        if isinstance(raw, Resync):
            return [self._resync_event(raw)]
        key = raw.kv.key.decode()
        if key == self._latest_key:
            if raw.deleted:
                return []
            return [WatchEvent(EventKind.VERSION_PUBLISHED, int(raw.kv.value), raw.revision)]
        try:
            version, kind, name = self._keys.parse_version_key(self._tenant, self._model, key)
        except InvalidArgument:
            return []
        if kind != "h":
            return []
        if raw.deleted:
            return [WatchEvent(EventKind.HOLDER_REMOVED, version, raw.revision, holder_name=name)]
        record = HolderRecord.decode(raw.kv.value, raw.kv.create_revision)
        return [WatchEvent(EventKind.HOLDER_UPDATED, version, raw.revision, record, name)]

    def _resync_event(self, raw: Resync) -> WatchEvent:
        latest = 0
        holders: dict[int, list[HolderRecord]] = {}
        for kv in raw.kvs:
            key = kv.key.decode()
            if key == self._latest_key:
                latest = int(kv.value)
                continue
            try:
                version, kind, _ = self._keys.parse_version_key(self._tenant, self._model, key)
            except InvalidArgument:
                continue
            if kind == "h":
                holders.setdefault(version, []).append(
                    HolderRecord.decode(kv.value, kv.create_revision)
                )
        return WatchEvent(EventKind.RESYNC, latest, raw.revision, holders=holders)
