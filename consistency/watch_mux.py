"""Many etcd watches on ONE etcd Watch stream, pumped by one thread, whatever their number:
the one etcd watch implementation of TensorHub (`consistency.watch.KeyWatch` is a blocking
queue over a mux of its own).

A stream, a thread reading it and gRPC's thread feeding its request side per watch is fine
for the few watches a process keeps, but one per watched model would let a tenant make a hub
start three threads per model name it asks about (2,000 names: 1,436 threads, 170 % CPU,
every tenant slowed). etcd's Watch RPC is a bidirectional stream that carries
any number of watchers, each created by a `WatchCreateRequest` and named by the `watch_id`
of its `created` response. `WatchMux` keeps one such stream per owner and multiplexes every
watch of that owner over it: adding or cancelling a watch is one request queued on the
stream (never a blocking call), and the threads are fixed: the pump that reads the stream
(`StreamPump`), gRPC's feeder of its request side, and one worker that re-lists a range after
a compaction. The stream's responses name no request, so a `created` response is matched to
the oldest create still waiting for one: etcd answers the creates of one stream in the order
it received them (its v3 client relies on the same).

Each watch keeps these guarantees:

- **Explicit start.** A watch starts at an explicit revision (never 0, which etcd reads as
  "now" and would skip history).
- **Exactly once, in order, across reconnects.** When the stream breaks, the pump reopens it
  (on `Etcd.policy`, on a member that answers, with a fresh auth token when the old one is
  older than `STREAM_TOKEN_AGE`) and creates every watch again from the revision after the
  last event it delivered.
- **Compaction.** A watch whose next revision was compacted is re-listed: it delivers one
  `Resync` holding every key of its range read at a current revision R (by the re-list
  worker, off the pump), then is created again from R + 1. Other watches go on meanwhile.
- **Auth.** etcd checks a create against the token the stream opened with, which the stream
  outlives: a create refused for it reopens the stream with a fresh token (at most once per
  `_AUTH_REOPEN_EVERY`; a refusal that survives that ends the watch), and every watch
  resumes as after any reconnect.

Progress (opt-in, `on_progress`): an owner that caches what its watches deliver must know how
current it is when nothing under its keys changes, as Kubernetes' watch cache does.
`request_progress()` queues etcd's `WatchProgressRequest` on the stream; etcd answers with a
response that names no watch (`watch_id` -1, no events) whose header revision R is one
through which every watch synced on the stream has delivered. The mux hands R to
`on_progress`, on the pump's thread, after the events before it. It holds for the watches
that are `active` when it arrives (a pending or re-listing one has not caught up). etcd
releases before the fix of etcd-io/etcd#15220 answer with the store's revision even while a
watcher created from the past is still catching up (etcd syncs those every 100 ms): a
notification within `UNSYNCED_GRACE` of such a create is dropped, so an owner that needs
certainty confirms one with the next (the hub's holder index does).

Items are handed to each watch's `deliver` callback on the pump's thread (a `Resync` on the
re-list worker's), never two at once for one watch: the callback must not block (the hub's
fan-out queues them for coroutines). A watch that etcd refuses, or that cannot be re-listed,
ends with its `fail` callback and a named error; a stream failure that is not retried ends
every watch that way and the mux with them (`failed`), and its owner starts a new one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from consistency import ops
from consistency.etcd import Etcd
from consistency.etcd_auth import token_refused
from consistency.etcd_errors import translate
from consistency.ops import KV
from consistency.retry import is_retryable
from consistency.stream import StreamPump
from tensorhub.errors import InvalidArgument, TensorHubError, Unavailable

log = logging.getLogger(__name__)

# How often the request feeder looks up from its queue to see that its stream ended (a
# deadline on its wait; an ended stream also wakes it at once with a sentinel).
_FEED_WAIT = 5.0
# How etcd words a create refused for the stream's auth token (etcd 3.4 and 3.5 say
# "permission denied" for an expired token as for a missing permission).
_AUTH_REFUSALS = ("permission denied", "invalid auth token", "auth store is old")
# The stream is reopened for such a refusal at most this often (seconds): a refusal that
# survives a fresh stream is the watch's own, and ends that watch.
_AUTH_REOPEN_EVERY = 60.0
# A progress notification this soon (seconds) after a watch was created from a revision etcd
# has passed is dropped (see the module docstring).
UNSYNCED_GRACE = 0.25
_NO_WATCH = -1  # the watch_id of etcd's progress notification, which names no watch


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
    """Every event of a watched range up to `revision` has been delivered (the items of a
    `KeyWatch` made with `progress`). `notified`: it came from an etcd progress notification
    (not after the events of a response); see `UNSYNCED_GRACE` for why a careful consumer
    confirms one with the next."""

    revision: int
    notified: bool = False


class _State(Enum):
    WAITING = "waiting"  # to be created when a stream opens
    PENDING = "pending"  # create sent on the live stream, no `created` response yet
    ACTIVE = "active"  # created: has a watch id on the live stream
    RESYNCING = "resyncing"  # compacted: being re-listed, no etcd watcher
    ENDED = "ended"  # cancelled or failed: nothing more is delivered


Deliver = Callable[[Sequence[RawEvent | Resync]], None]
Fail = Callable[[TensorHubError], None]
OnProgress = Callable[[int], None]


def check_start(start_revision: int) -> None:
    """`InvalidArgument` unless `start_revision` is explicit (positive): 0 would mean "now"
    to etcd and lose every event before it."""
    if start_revision <= 0:
        raise InvalidArgument(
            f"start_revision must be explicit and positive, got {start_revision} "
            "(0 would mean 'now' to etcd and lose events)"
        )


class MuxWatch:
    """One watch of a `WatchMux`: a key or prefix from `next_revision` on (see the module
    docstring). Its fields are the mux's to change, under the mux's lock."""

    def __init__(
        self, key: str, prefix: bool, start_revision: int, deliver: Deliver, fail: Fail
    ) -> None:
        check_start(start_revision)
        self.key = key
        self.prefix = prefix
        self.next_revision = start_revision  # revision after the last item delivered
        self.deliver = deliver
        self.fail = fail
        self.state = _State.WAITING
        self.watch_id = -1

    @property
    def ended(self) -> bool:
        return self.state is _State.ENDED

    @property
    def active(self) -> bool:
        """Created on the live stream and not being re-listed: what an etcd progress
        notification vouches for (see the module docstring)."""
        return self.state is _State.ACTIVE

    def create_request(self) -> Any:
        create = etcdrpc.WatchCreateRequest(key=ops.b(self.key), start_revision=self.next_revision)
        if self.prefix:
            create.range_end = ops.prefix_end(self.key)
        return etcdrpc.WatchRequest(create_request=create)


class WatchMux(StreamPump[None]):
    """Every watch of one owner (a hub replica's fan-out) on one etcd Watch stream; with
    `on_progress`, also etcd's progress notifications for them (see the module docstring)."""

    def __init__(
        self, etcd: Etcd, name: str = "watch-mux", *, on_progress: OnProgress | None = None
    ) -> None:
        super().__init__(name)
        self._etcd = etcd
        self._on_progress = on_progress
        self._trusted_from = 0.0  # monotonic time from which progress notifications count
        self._lock = threading.Lock()
        self._watches: dict[MuxWatch, None] = {}  # live ones, in creation order
        self._pending: deque[MuxWatch] = deque()  # creates sent on the live stream, in order
        self._by_id: dict[int, MuxWatch] = {}  # created on the live stream
        self._requests: queue.Queue[Any] | None = None  # the live stream's request side
        self._auth_reopened_at = -_AUTH_REOPEN_EVERY  # when an auth refusal last reopened
        self.failed: TensorHubError | None = None  # set when the pump gave up (see `_put`)
        self._relister = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-relist")
        self._start()

    # -- the owner's side ------------------------------------------------------------------

    def watch(
        self, key: str, *, prefix: bool, start_revision: int, deliver: Deliver, fail: Fail
    ) -> MuxWatch:
        """Start watching `key` (a prefix with `prefix`) from `start_revision`: queued on the
        stream, never waiting for etcd. `Unavailable` if the mux has ended."""
        watch = MuxWatch(key, prefix, start_revision, deliver, fail)
        with self._lock:
            if self.failed is not None or self._closed.is_set():
                raise Unavailable(f"the etcd watch stream has ended ({self.failed}); retry")
            self._watches[watch] = None
            if self._requests is not None:
                self._send_create(watch)
        return watch

    def cancel(self, watch: MuxWatch) -> None:
        """Stop `watch`: nothing more is delivered to it after this returns (an item being
        handed out right now may still arrive). Never blocks: one request is queued."""
        with self._lock:
            if watch not in self._watches:
                return  # already ended
            del self._watches[watch]
            if watch.state is _State.ACTIVE and self._by_id.pop(watch.watch_id, None) is not None:
                self._send(etcdrpc.WatchRequest(
                    cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch.watch_id)
                ))  # fmt: skip
            # PENDING: its `created` response finds it ENDED and cancels it then
            watch.state = _State.ENDED

    def request_progress(self) -> None:
        """Ask etcd for a progress notification, handed to `on_progress` when it comes.
        Never blocks: one request is queued (dropped while the stream reconnects, so an owner
        that waits for one asks again). `InvalidArgument` on a mux made without
        `on_progress`."""
        if self._on_progress is None:
            raise InvalidArgument("request_progress needs a WatchMux made with on_progress")
        with self._lock:
            self._send(etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._watches)

    def close(self) -> None:
        """End the stream and every watch (none is told: the owner is stopping), and wait
        for the pump (bounded by `StreamPump.close`)."""
        with self._lock:
            for watch in self._watches:
                watch.state = _State.ENDED
            self._watches.clear()
        self._relister.shutdown(wait=False, cancel_futures=True)
        super().close()

    # -- under the lock --------------------------------------------------------------------

    def _send(self, request: Any) -> None:
        if self._requests is not None:
            self._requests.put(request)

    def _send_create(self, watch: MuxWatch) -> None:
        watch.state = _State.PENDING
        self._pending.append(watch)
        self._send(watch.create_request())

    def _end(self, watch: MuxWatch) -> None:
        watch.state = _State.ENDED
        self._watches.pop(watch, None)

    # -- the pump --------------------------------------------------------------------------

    def _run(self) -> None:
        """Reopen the stream whenever it breaks, on the etcd client's `RetryPolicy`
        (`Etcd.policy`: its sleep is what tests replace); a failure not retried ends every
        watch (`_put`)."""
        self._pump(self._etcd.policy, self._stream_once, _named)

    def _put(self, item: BaseException | None) -> None:
        """The pump gave up with `item` (an exception): every watch fails with it, named."""
        if not isinstance(item, BaseException):
            return
        error = item if isinstance(item, TensorHubError) else Unavailable(
            f"the etcd watch stream failed ({item!r}); resume"
        )  # fmt: skip
        with self._lock:
            self.failed = error
            ended = list(self._watches)
            for watch in ended:
                watch.state = _State.ENDED
            self._watches.clear()
        for watch in ended:
            watch.fail(error)

    def _stream_once(self) -> None:
        """One stream: create every live watch on it, then read it to its end."""
        requests: queue.Queue[Any] = queue.Queue()
        stop = threading.Event()
        with self._lock:
            self._requests = requests
            self._pending.clear()
            self._by_id.clear()
            for watch in self._watches:
                if watch.state is not _State.RESYNCING:
                    self._send_create(watch)

        def feed() -> Iterator[Any]:
            while not stop.is_set():
                try:
                    request = requests.get(timeout=_FEED_WAIT)
                except queue.Empty:
                    continue
                if request is None:
                    return
                yield request

        try:
            member, call = self._etcd.watch_stream(feed())
        except BaseException:
            self._detach_requests(stop, requests)
            raise
        if not self._attach(call):
            self._detach_requests(stop, requests)
            return
        try:
            for response in call:
                self._handle(response)
        except grpc.RpcError as exc:
            if is_retryable(exc):
                self._etcd.mark_failed(member)
            if token_refused(exc):  # the next stream opens with a fresh token
                raise Unavailable(f"etcd refused the watch's auth token ({exc.details()})") from exc
            raise
        finally:
            self._detach_requests(stop, requests)
            self._detach()

    def _detach_requests(self, stop: threading.Event, requests: queue.Queue[Any]) -> None:
        """The stream ended: its request side stops, and every watch on it waits for the
        next one (re-listing ones carry on and are created there)."""
        stop.set()
        requests.put(None)
        with self._lock:
            if self._requests is requests:
                self._requests = None
            for watch in self._watches:
                if watch.state in (_State.PENDING, _State.ACTIVE):
                    watch.state = _State.WAITING
            self._pending.clear()
            self._by_id.clear()

    def _handle(self, response: Any) -> None:
        """One response of the stream: a create answered, a watch ended, events, or a
        progress notification. What it tells a watch's owner is told after the lock is
        released (`later`), so an owner may call back into the mux."""
        if not response.created and response.watch_id == _NO_WATCH and not response.events:
            self._progressed(int(response.header.revision))
            return
        later: list[Callable[[], None]] = []
        try:
            with self._lock:
                if response.created:
                    self._created(response, later)
                    return
                watch = self._by_id.get(response.watch_id)
                if watch is None:
                    return  # a cancelled watch's last events, or etcd confirming a cancel
                if response.compact_revision or response.canceled:
                    del self._by_id[response.watch_id]
                    self._stopped(watch, response, later)
                    return
        finally:
            for tell in later:
                tell()
        events = [
            RawEvent(event.type == kv_pb2.Event.DELETE, KV.from_pb(event.kv))
            for event in response.events
        ]
        events = [e for e in events if e.revision >= watch.next_revision]  # never twice
        if not events:
            return
        watch.next_revision = events[-1].revision + 1  # only the pump moves an active one
        self._delivered += 1  # the stream works: a break now reopens it at once
        watch.deliver(events)

    def _created(self, response: Any, later: list[Callable[[], None]]) -> None:
        """A `created` response: it answers the oldest create still waiting (under the lock)."""
        if not self._pending:
            log.warning("etcd answered a watch create that was not sent; ignored")
            return
        watch = self._pending.popleft()
        if int(response.header.revision) >= watch.next_revision:  # created from the past
            self._trusted_from = time.monotonic() + UNSYNCED_GRACE
        if response.canceled and not response.compact_revision:
            self._refused(watch, response.cancel_reason, later)
            return
        if watch.ended:  # cancelled while its create was on the way
            if not response.canceled:
                self._send(etcdrpc.WatchRequest(
                    cancel_request=etcdrpc.WatchCancelRequest(watch_id=response.watch_id)
                ))  # fmt: skip
            return
        if response.compact_revision:  # an etcd that says both in one response
            self._stopped(watch, response, later)
            return
        watch.watch_id = response.watch_id
        watch.state = _State.ACTIVE
        self._by_id[response.watch_id] = watch

    def _progressed(self, revision: int) -> None:
        """etcd's progress notification: to `on_progress`, unless too soon after a create
        from the past to be trusted (see the module docstring)."""
        with self._lock:
            trusted = time.monotonic() >= self._trusted_from
        if trusted and self._on_progress is not None:
            self._on_progress(revision)

    def _refused(self, watch: MuxWatch, reason: str, later: list[Callable[[], None]]) -> None:
        """etcd refused a create (under the lock). etcd refuses a create on the stream's auth
        token when that token expired after the stream opened: the first such refusal in
        `_AUTH_REOPEN_EVERY` reopens the stream (`Unavailable` ends it; the pump reopens it
        at once, with a fresh token when the old one is stale). Any other refusal ends that
        watch only, named."""
        if watch.ended:
            return
        now = time.monotonic()
        if any(words in reason for words in _AUTH_REFUSALS) and (
            now - self._auth_reopened_at >= _AUTH_REOPEN_EVERY
        ):
            self._auth_reopened_at = now
            self._forced = True  # not a failure of etcd's: reopen without a backoff
            raise Unavailable(f"etcd refused a watch on the stream's auth token ({reason})")
        self._end(watch)
        error = Unavailable(f"etcd refused the watch of {watch.key}: {reason}")
        later.append(lambda: watch.fail(error))

    def _stopped(self, watch: MuxWatch, response: Any, later: list[Callable[[], None]]) -> None:
        """etcd ended an active watch (under the lock): compacted past its next revision
        (re-listed, then created again), or cancelled (it fails, named)."""
        if watch.ended:
            return
        if response.compact_revision:
            watch.state = _State.RESYNCING
            try:
                self._relister.submit(self._relist, watch)
                return
            except RuntimeError:  # the mux is closing
                error: TensorHubError = Unavailable("the etcd watch stream is closing")
        else:
            reason = response.cancel_reason or "no reason given"
            error = Unavailable(f"etcd cancelled the watch of {watch.key}: {reason}")
        self._end(watch)
        later.append(lambda: watch.fail(error))

    def _relist(self, watch: MuxWatch) -> None:
        """On the re-list worker: deliver the range's whole state as one `Resync`, then
        create the watch again from the revision after it."""
        try:
            result = self._etcd.range(watch.key, prefix=watch.prefix)
        except TensorHubError as exc:
            with self._lock:
                if watch.ended:
                    return
                self._end(watch)
            watch.fail(exc)
            return
        with self._lock:
            if watch.ended:
                return
        watch.deliver([Resync(result.revision, result.kvs)])
        with self._lock:
            if watch.ended:
                return
            watch.next_revision = result.revision + 1
            if self._requests is not None:
                self._send_create(watch)
            else:
                watch.state = _State.WAITING  # created when the next stream opens


def _named(exc: BaseException) -> BaseException:
    """What the watches of a mux that gave up fail with: an etcd error as its TensorHubError."""
    return translate(exc, 0.0) if isinstance(exc, grpc.RpcError) else exc
