"""A gRPC stream pumped into a queue by a background thread: the shape of every watch.

The pump thread (`_run`, written by the subclass) opens calls, registers each with
`_attach` so it can be cancelled, and `_put`s items into its `Inbox`; a failure meant for the
consumer is put as an exception and raised from `get`. Consumers call `get(timeout)` or
iterate, and `close()` cancels the live call and joins the thread.

`_pump` runs a watch's streams in the one reopen loop (`consistency.reopen.keep_open`), on a
`consistency.retry.RetryPolicy`: a stream that ended, broke after delivering something, or
was broken by `force_reconnect` is reopened at once; one that broke before delivering
anything is reopened after the policy's backoff (the resumable conditions of its table);
anything else ends the pump and is raised to the consumer.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Generic, Self, TypeVar

from consistency.reopen import keep_open
from consistency.retry import RetryPolicy
from tensorhub.errors import StreamClosed

__all__ = ["Inbox", "StreamPump"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class Inbox(Generic[T]):
    """What a watch hands its consumer: its items in order, and a failure (an exception
    put) raised by `get`. Once `closed` is set and nothing is left, `get` raises
    `StreamClosed`."""

    def __init__(self, closed: threading.Event) -> None:
        self._queue: queue.Queue[T | BaseException] = queue.Queue()
        self._closed = closed

    def put(self, item: T | BaseException) -> None:
        self._queue.put(item)

    def get(self, timeout: float) -> T | None:
        """The next item, or None if none arrives within `timeout` seconds."""
        if self._closed.is_set() and self._queue.empty():
            raise StreamClosed("stream closed")
        try:
            item = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[T]:
        """Blocks between items; ends when the stream is closed."""
        while not self._closed.is_set():
            item = self.get(0.5)
            if item is not None:
                yield item


class StreamPump(ABC, Generic[T]):
    """Base of the watches: a queue filled by one thread, drained by the consumer."""

    def __init__(self, name: str) -> None:
        self.reconnects = 0  # how often the stream was reopened
        self._delivered = 0  # items put so far: a stream that delivered some worked
        self._forced = False  # the live call was broken by force_reconnect, not by a failure
        self._closed = threading.Event()
        self._inbox: Inbox[T] = Inbox(self._closed)
        self._call: Any = None
        self._call_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    @abstractmethod
    def _run(self) -> None:
        """The pump: open calls, `_attach` each, `_put` what they bring, until closed."""

    # -- pump side -------------------------------------------------------------------------

    def _pump(
        self,
        policy: RetryPolicy,
        once: Callable[[], None],
        failed: Callable[[BaseException], BaseException],
    ) -> None:
        """Run `once()` (open one stream and read it to its end) until closed, reopening it
        as the module docstring says; a failure not retried is put as `failed(exc)`."""
        opened = False

        def stream() -> None:
            nonlocal opened
            if opened:
                self.reconnects += 1
            opened = True
            self._forced = False  # set only while a call is attached: by this stream's end
            try:
                once()
            except BaseException as exc:
                forced, self._forced = self._forced, False
                if forced and policy.retryable(exc, resumable=True):
                    self._reopening(exc, 0.0)
                    return  # broken on purpose: reopened at once, as a stream that ended
                raise

        try:
            keep_open(
                stream,
                policy=policy,
                stopped=self._closed.is_set,
                wait=self._closed.wait,  # close() ends a backoff at once
                progress=lambda: self._delivered,
                at_once_after_progress=True,
                on_reopen=self._reopening,
            )
        except BaseException as exc:
            if not self._closed.is_set():
                self._put(failed(exc))

    def _reopening(self, exc: BaseException, seconds: float) -> None:
        if seconds:
            log.info(
                "%s: stream failed (%s); reopening in %.2fs", self._thread.name, _why(exc), seconds
            )
        else:
            log.info("%s: stream broke (%s); reopening", self._thread.name, _why(exc))

    def _attach(self, call: Any) -> bool:
        """Make `call` the live one (cancelled by `close`); False if closed meanwhile."""
        with self._call_lock:
            if self._closed.is_set():
                call.cancel()
                return False
            self._call = call
            return True

    def _detach(self) -> None:
        with self._call_lock:
            self._call = None

    def _put(self, item: T | BaseException) -> None:
        self._delivered += 1
        self._inbox.put(item)

    # -- consumer side ---------------------------------------------------------------------

    def get(self, timeout: float) -> T | None:
        """The next item, or None if none arrives within `timeout` seconds."""
        return self._inbox.get(timeout)

    def __iter__(self) -> Iterator[T]:
        """Blocks between items; ends when the stream is closed."""
        return iter(self._inbox)

    def force_reconnect(self) -> None:
        """Break the live call (as a server failure would); the pump resumes by itself."""
        with self._call_lock:
            if self._call is not None:
                self._forced = True
                self._call.cancel()

    def close(self) -> None:
        self._closed.set()
        self.force_reconnect()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _why(exc: BaseException) -> str:
    """A short reason for the log: the gRPC code, else the error itself."""
    code = getattr(exc, "code", None)
    return str(code()) if callable(code) and isinstance(exc, Exception) else repr(exc)
