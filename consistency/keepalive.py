"""Lease renewals multiplexed over one long-lived etcd `LeaseKeepAlive` stream per client.

`Etcd.lease_keepalive` opens a fresh bidi stream for every renewal, which is fine for one
session but not for a hub replica renewing thousands of them: each renewal would cost a
stream set-up and, on gRPC's synchronous API, a thread to feed its request iterator.
`LeaseKeeper` keeps ONE stream open to the current member and feeds it from a queue;
`renew(lease_id, timeout)` returns a future that resolves with the TTL etcd granted when the
matching response comes back (0: the lease no longer exists). Renewals of one lease that
overlap share one request and one response.

Threads: one feeds the stream from the queue (gRPC's request-iterator consumer), one reads
responses and reconnects; that is all, whatever the number of leases. When the stream breaks,
or a renewal has waited longer than `stall_seconds` for its answer (a hung member), the member
is marked failed, the stream reopens on the next member, and every unanswered renewal is sent
again there (renewing twice is harmless). Every renewal has a deadline: a future not answered
by then fails with `DeadlineExceeded`; `close()` fails the rest with `Unavailable`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from etcd3 import etcdrpc

from consistency.etcd import Etcd
from consistency.reopen import Broken, keep_open
from tensorhub.errors import DeadlineExceeded, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.1  # how often the feeder checks deadlines and stalls while idle


@dataclass
class _Pending:
    """The unanswered renewals of one lease: their futures with deadlines, and when the
    request that will answer them was last sent (0.0: not sent on the current stream)."""

    waiters: list[tuple[float, Future[int]]] = field(default_factory=list)
    sent_at: float = 0.0


class LeaseKeeper:
    """Renews etcd leases over one shared `LeaseKeepAlive` stream (see the module doc)."""

    def __init__(self, etcd: Etcd, *, stall_seconds: float = 2.0) -> None:
        self._etcd = etcd
        self._stall = stall_seconds
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._outbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._call: Any = None
        self._generation = 0
        self._reader: threading.Thread | None = None
        self._answered = 0  # responses read: a stream that got some worked
        self.reconnects = 0

    # -- caller side -----------------------------------------------------------------------

    def renew(self, lease_id: int, timeout: float) -> Future[int]:
        """Ask for one renewal of `lease_id`; the future gives the TTL granted (0: expired),
        or fails with `DeadlineExceeded` after `timeout` seconds, or `Unavailable` on close."""
        if timeout <= 0:
            raise InvalidArgument(f"renewal timeout must be positive, got {timeout}")
        future: Future[int] = Future()
        future.set_running_or_notify_cancel()
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed.is_set():
                future.set_exception(Unavailable("the lease keeper is closed"))
                return future
            self._ensure_started()
            pending = self._pending.setdefault(lease_id, _Pending())
            pending.waiters.append((deadline, future))
            send = pending.sent_at == 0.0
            if send:
                pending.sent_at = time.monotonic()
        if send:
            self._outbox.put(lease_id)
        return future

    def keepalive(self, lease_id: int, timeout: float) -> int:
        """Renew once and wait: the TTL granted, 0 if the lease no longer exists."""
        return self.renew(lease_id, timeout).result(timeout=timeout + 1.0)

    def close(self) -> None:
        """Stop the stream and its threads; unanswered renewals fail with `Unavailable`."""
        with self._lock:
            self._closed.set()
            call, self._call = self._call, None
            pending, self._pending = self._pending, {}
        self._outbox.put(None)
        if call is not None:
            call.cancel()
        for entry in pending.values():
            for _, future in entry.waiters:
                _fail(future, Unavailable("the lease keeper closed before etcd answered"))
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5)

    # -- stream side -----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
            self._reader.start()

    def _run(self) -> None:
        """Open the stream, read its responses, and reopen it on another member when it
        breaks or ends, until closed: the one reopen loop (`consistency.reopen.keep_open`),
        waiting the etcd client's backoff (`Etcd.policy`, and its injectable sleep) after
        each break, counted from the last answer."""
        keep_open(
            self._stream,
            policy=replace(self._etcd.policy, retry_on=_broken, tries=None),  # until closed
            stopped=self._closed.is_set,
            wait=self._closed.wait,
            progress=lambda: self._answered,
        )

    def _stream(self) -> None:
        """One stream to the current member, read to its end; `Broken` when it broke or
        ended (the member is marked failed), unless the keeper closed meanwhile."""
        member = self._etcd.member()
        with self._lock:
            if self._closed.is_set():
                return
            self._generation += 1
            generation = self._generation
            resend = list(self._pending)
            now = time.monotonic()
            for entry in self._pending.values():
                entry.sent_at = now
        call = member.lease.LeaseKeepAlive(self._requests(generation, resend))
        with self._lock:
            self._call = call
        try:
            for response in call:
                self._answer(int(response.ID), int(response.TTL))
                self._answered += 1
        except grpc.RpcError as exc:
            if self._closed.is_set():
                return
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.info("lease keepalive stream to %s broke (%s)", member.target, exc.code())
            self._etcd.mark_failed(member)
        finally:
            with self._lock:
                if self._call is call:
                    self._call = None
        if self._closed.is_set():
            return
        self.reconnects += 1
        self._expire(time.monotonic())
        raise Broken(f"the lease keepalive stream to {member.target} ended")

    def _requests(self, generation: int, resend: list[int]) -> Iterator[Any]:
        """The request side of stream `generation`: first every unanswered lease, then each
        lease id queued; between items, expire overdue renewals and break a stalled stream."""
        for lease in resend:
            yield etcdrpc.LeaseKeepAliveRequest(ID=lease)
        # Deadlines are checked at most every _POLL_SECONDS: a scan of every pending
        # renewal after each request would cost O(pending) per request, the hub's main cost
        # at thousands of sessions.
        next_check = time.monotonic() + _POLL_SECONDS
        while not self._closed.is_set() and generation == self._generation:
            lease_id: int | None
            try:
                lease_id = self._outbox.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                lease_id = None
            if generation != self._generation:
                if lease_id is not None:
                    self._outbox.put(lease_id)  # the next stream sends it
                return
            if lease_id is not None:
                yield etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + _POLL_SECONDS
            if self._expire(now):
                self._break_stalled()
                return

    def _answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            entry = self._pending.pop(lease_id, None)
        for _, future in entry.waiters if entry is not None else ():
            if not future.done():
                future.set_result(ttl)

    def _expire(self, now: float) -> bool:
        """Fail renewals past their deadline; True if one has waited past `stall_seconds`
        for an answer on the current stream (the member is hung)."""
        stalled = False
        failed: list[Future[int]] = []
        with self._lock:
            for lease_id, entry in list(self._pending.items()):
                keep = [(d, f) for d, f in entry.waiters if d > now and not f.done()]
                failed.extend(f for d, f in entry.waiters if d <= now)
                if not keep:
                    del self._pending[lease_id]
                    continue
                entry.waiters = keep
                if entry.sent_at and now - entry.sent_at > self._stall:
                    stalled = True
        for future in failed:
            _fail(future, DeadlineExceeded("etcd did not renew the lease within its deadline"))
        return stalled

    def _break_stalled(self) -> None:
        with self._lock:
            call = self._call
        log.info("lease keepalive stream stalled for %.1fs; reconnecting", self._stall)
        if call is not None:
            call.cancel()  # the reader sees CANCELLED, marks the member failed, reconnects


def _broken(exc: BaseException) -> bool:
    """What the keeper reopens after: its stream broke or ended (`Broken`); anything else
    ends its thread."""
    return isinstance(exc, Broken)


def _fail(future: Future[int], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
