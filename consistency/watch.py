"""Watches that resume from an explicit revision, survive reconnects, and handle compaction.

`KeyWatch` streams raw etcd events for a key or prefix from `start_revision` (always explicit:
0 would mean "now" to etcd and silently skip history). When the stream breaks (a member died,
the connection reset) it reopens on a member that answers, from the revision after the last
event it delivered, so nothing is lost or repeated. When the start revision has been compacted,
it re-lists: it yields one `Resync` holding every key under the watched range as read at a
current revision R, then resumes from R + 1.

`ModelWatch` turns a model's raw events into `WatchEvent`s (new versions, holder changes),
with `ModelEvents`, which the hub's fan-out also uses on the watches it multiplexes over one
etcd stream (`consistency.watch_mux`).

Progress (opt-in, `progress=True`): a cache fed by a watch must know how current it is even
when nothing under its range changes. Such a watch also yields `Progress(revision)`: after
the events of each etcd response (every event up to that revision has been delivered), and
for every etcd progress notification, which `request_progress()` asks for on the watch's own
stream (`WatchRequest.progress_request`, etcd 3.4 and 3.5). A watch without the flag never
yields one, so consumers that only want events (the hub's fan-out) never see them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from consistency import ops
from consistency.etcd import Etcd
from consistency.etcd_auth import token_refused
from consistency.etcd_errors import translate
from consistency.keys import Keys
from consistency.ops import KV
from consistency.records import HolderRecord
from consistency.retry import is_retryable
from consistency.stream import StreamPump
from tensorhub.errors import InvalidArgument, StreamClosed, Unavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawEvent:
    """One etcd change: a put (with the new KV) or a delete (KV holds only key and revision)."""

    deleted: bool
    kv: KV

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True)
class Resync:
    """After a compaction: the full state of the watched range at `revision`."""

    revision: int
    kvs: list[KV] = field(default_factory=list)


@dataclass(frozen=True)
class Progress:
    """Every event of the watched range up to `revision` has been delivered (opt-in).

    `notified`: it came from an etcd progress notification (not after events of a response);
    see `_UNSYNCED_GRACE` for why a careful consumer confirms one with the next.
    """

    revision: int
    notified: bool = False


# etcd releases before the fix of etcd-io/etcd#15220 answer a progress request on a side
# channel with the store's revision, even for a watcher still catching up from an older
# start revision (etcd syncs those every 100 ms). A notification that arrives this soon
# after a watch was (re)created from the past is therefore not trusted.
_UNSYNCED_GRACE = 0.25


class KeyWatch(StreamPump[RawEvent | Resync | Progress]):
    """A resumable watch on a key or prefix, delivering events exactly once, in order.

    With `progress=True` it also yields `Progress` items (see the module docstring).
    """

    def __init__(
        self, etcd: Etcd, key: str, *, prefix: bool, start_revision: int, progress: bool = False
    ) -> None:
        if start_revision <= 0:
            raise InvalidArgument(
                f"start_revision must be explicit and positive, got {start_revision} "
                "(0 would mean 'now' to etcd and lose events)"
            )
        super().__init__(f"watch-{key}")
        self._etcd = etcd
        self._key = key
        self._prefix = prefix
        self._progress = progress
        # the live stream's request side: True asks for progress, False ends it
        self._requests: queue.Queue[bool] = queue.Queue()
        self._trusted_from = 0.0  # monotonic time from which progress notifications count
        self.next_revision = start_revision
        self._start()

    def request_progress(self) -> None:
        """Ask etcd for a progress notification on this watch's stream (needs `progress`).

        It arrives as a `Progress` item, unless the stream is reconnecting (ask again) or
        etcd has nothing to report for a watcher still catching up."""
        if not self._progress:
            raise InvalidArgument("request_progress needs a watch created with progress=True")
        self._requests.put(True)

    # -- stream side -----------------------------------------------------------------------

    def _run(self) -> None:
        """Reopen the stream from `next_revision` whenever it breaks, backing off on the etcd
        client's `RetryPolicy` (`Etcd.policy`: its sleep is what tests replace); a failure
        it does not retry (an etcd refusal) is raised to the consumer, named."""
        self._pump(self._etcd.policy, self._stream_once, _named)

    def _stream_once(self) -> None:
        create = etcdrpc.WatchCreateRequest(key=ops.b(self._key), start_revision=self.next_revision)
        if self._prefix:
            create.range_end = ops.prefix_end(self._key)
        stop = threading.Event()
        requested: queue.Queue[bool] = queue.Queue()
        self._requests = requested  # progress asked while reconnecting went to the old one

        def requests() -> Iterator[Any]:
            yield etcdrpc.WatchRequest(create_request=create)
            # keep the request side open until the stream ends; send progress requests
            while not stop.is_set():
                try:
                    ask = requested.get(timeout=0.5)
                except queue.Empty:
                    continue
                if not ask or stop.is_set():
                    return
                yield etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())

        member, call = self._etcd.watch_stream(requests())
        if not self._attach(call):
            return
        try:
            for response in call:
                if response.compact_revision:
                    self._resync()
                    return  # reopen from the revision after the re-list
                if response.canceled:
                    return
                if response.created:
                    # A watcher created at a revision etcd has already passed catches up
                    # in the background: do not trust progress before it can have.
                    behind = int(response.header.revision) >= self.next_revision
                    grace = _UNSYNCED_GRACE if behind else 0.0
                    self._trusted_from = time.monotonic() + grace
                    continue
                last = 0
                for event in response.events:
                    kv = KV.from_pb(event.kv)
                    self._put(RawEvent(event.type == kv_pb2.Event.DELETE, kv))
                    last = kv.mod_revision
                if last:
                    self.next_revision = last + 1
                    if self._progress:
                        self._put(Progress(last))
                elif self._progress and time.monotonic() >= self._trusted_from:
                    revision = int(response.header.revision)
                    if revision >= self.next_revision - 1:
                        self._put(Progress(revision, notified=True))
        except grpc.RpcError as exc:
            if is_retryable(exc):
                self._etcd.mark_failed(member)
            if token_refused(exc):  # the next stream opens with a fresh token
                raise Unavailable(f"etcd refused the watch's auth token ({exc.details()})") from exc
            raise
        finally:
            stop.set()
            requested.put(False)  # wake the request side so it ends with the stream
            self._detach()

    def _resync(self) -> None:
        result = self._etcd.range(self._key, prefix=self._prefix)
        self._put(Resync(result.revision, result.kvs))
        self.next_revision = result.revision + 1

    def close(self) -> None:
        self._requests.put(False)
        super().close()


def _named(exc: BaseException) -> BaseException:
    """What a watch that ended raises to its consumer: an etcd error as its TensorHubError."""
    return translate(exc, 0.0) if isinstance(exc, grpc.RpcError) else exc


class EventKind(StrEnum):
    VERSION_PUBLISHED = "version_published"
    HOLDER_UPDATED = "holder_updated"
    HOLDER_REMOVED = "holder_removed"
    RESYNC = "resync"


@dataclass(frozen=True)
class WatchEvent:
    """A change to a model: a new latest version, or a holder added/changed/removed.

    A RESYNC event (after compaction) carries the model's latest version and every live
    holder per version in `holders`; events after it continue from its revision.
    """

    kind: EventKind
    version: int
    revision: int
    holder: HolderRecord | None = None
    holder_name: str = ""
    holders: dict[int, list[HolderRecord]] = field(default_factory=dict)


class ModelEvents:
    """Turns the raw etcd events under one model's prefix into `WatchEvent`s.

    Shared by `ModelWatch` (a watch of its own) and the hub's fan-out, whose model watches
    ride one multiplexed etcd stream (`consistency.watch_mux`): both must read the same raw
    history as the same model events, so the translation lives in one place.
    """

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


class ModelWatch:
    """New versions and holder changes of one model, from an explicit revision.

    With `progress=True`, `get_item` also passes up the raw watch's `Progress` items and
    `request_progress` asks etcd for one; `get` (what the hub's fan-out uses) never returns
    them either way.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        tenant: str,
        model: str,
        *,
        start_revision: int,
        progress: bool = False,
    ) -> None:
        self._events = ModelEvents(keys, tenant, model)
        self._raw = KeyWatch(
            etcd,
            self._events.prefix,
            prefix=True,
            start_revision=start_revision,
            progress=progress,
        )
        self._pending: list[WatchEvent | Progress] = []

    @property
    def next_revision(self) -> int:
        return self._raw.next_revision

    def get(self, timeout: float) -> WatchEvent | None:
        """The next model event, or None if none arrives within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.get_item(max(deadline - time.monotonic(), 0.0))
            if item is None or isinstance(item, WatchEvent):
                return item

    def get_item(self, timeout: float) -> WatchEvent | Progress | None:
        """The next model event or (with `progress`) `Progress`, or None after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self._pending:
            raw = self._raw.get(max(deadline - time.monotonic(), 0.0))
            if raw is None:
                return None
            if isinstance(raw, Progress):
                return raw
            self._pending.extend(self._translate(raw))
        return self._pending.pop(0)

    def request_progress(self) -> None:
        """Ask etcd for a `Progress` item (the watch must have been made with `progress`)."""
        self._raw.request_progress()

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            try:
                event = self.get(0.5)
            except StreamClosed:
                return
            if event is not None:
                yield event

    def close(self) -> None:
        self._raw.close()

    def force_reconnect(self) -> None:
        self._raw.force_reconnect()

    def __enter__(self) -> ModelWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _translate(self, raw: RawEvent | Resync) -> list[WatchEvent]:
        return self._events.translate(raw)
