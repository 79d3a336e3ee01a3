"""A gRPC stream pumped into a queue by a background thread: the shape of every watch.

The pump thread (`_run`, written by the subclass) opens calls, registers each with
`_attach` so it can be cancelled, and `_put`s items; a failure meant for the consumer is put
as an exception and raised from `get`. Consumers call `get(timeout)` or iterate, and `close()`
cancels the live call and joins the thread.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Generic, Self, TypeVar

from tensorhub.errors import TensorHubError

T = TypeVar("T")


class StreamClosed(TensorHubError):
    """The stream was closed; no more items will come."""

    code = "CANCELLED"


class StreamPump(ABC, Generic[T]):
    """Base of the watches: a queue filled by one thread, drained by the consumer."""

    def __init__(self, name: str) -> None:
        self.reconnects = 0
        self._queue: queue.Queue[T | BaseException] = queue.Queue()
        self._closed = threading.Event()
        self._call: Any = None
        self._call_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    @abstractmethod
    def _run(self) -> None:
        """The pump: open calls, `_attach` each, `_put` what they bring, until closed."""

    # -- pump side -------------------------------------------------------------------------

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
        self._queue.put(item)

    # -- consumer side ---------------------------------------------------------------------

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

    def force_reconnect(self) -> None:
        """Break the live call (as a server failure would); the pump resumes by itself."""
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def close(self) -> None:
        self._closed.set()
        self.force_reconnect()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
