"""The client's session, and its recovery after a loss: one owner for both.

A lost session (no renewal before its TTL ran out, or a call answered `SessionExpired`)
stops the holder server from serving at once; the client then needs a new session and every
held version re-registered under it (DESIGN.md §3). Before, each loss started a thread of its
own that tried `OpenSession` once: when that failed (the hub down or refusing), it logged and
gave up, and since a lost session reports its loss only once, the client stayed dead for
good. Nothing owned that thread either: `close()` neither waited for it nor stopped it, so a
recovery that won the race against `close()` left a new session renewed by nobody's client.

`Sessions` owns both now:

- one recovery thread at a time, started by a loss, that tries `OpenSession` and then the
  re-registration of every held version (`Holdings.reregister`) on `RECOVERY_POLICY`
  (`consistency.retry`: full-jitter backoff, no deadline) until both are done or the client
  closes. A failure of any kind is tried again; a version the hub refuses for good is
  skipped (logged) and does not keep the others unregistered.
- `close()` takes the session under the same lock a recovery installs a new one under, so
  a session is either the client's (and `close()` ends it) or opened after `close()` (and
  the recovery ends it itself, never renewing it); then it joins the thread, bounded by
  `RECOVERY_JOIN_TIMEOUT`. A backoff wait is cut short by `close()`; a call in flight ends
  when the client closes its channel.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from consistency.retry import RetryPolicy
from ros.client.holdings import Holdings
from ros.client.session import ClientSession
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InternalError
from transport.store import Key

log = logging.getLogger(__name__)

# Every failure of a recovery is worth another try: the hub may come back, a quota may free
# up, a replica may stop lagging. The backoff grows to `maximum` and stays there.
RECOVERY_POLICY = RetryPolicy(initial=0.1, maximum=2.0, retry_on=lambda e: isinstance(e, Exception))
RECOVERY_JOIN_TIMEOUT = 2.0  # the most close() waits for a recovery to stop (s)
DISPOSE_TIMEOUT = 1.0  # CloseSession of a session opened after close() (s)


class Opener(Protocol):
    """What recovery needs of the client: open a session, and register one held version."""

    def _open_session_rpc(self) -> pb.OpenSessionResponse: ...

    def _session_of(self, opened: pb.OpenSessionResponse) -> ClientSession: ...

    def _register(
        self, model: str, version: int, *, complete: bool, shard: int | None = None
    ) -> int: ...

    def _close_session_rpc(self, session_id: int, timeout: float) -> None: ...


class Sessions:
    """The client's current session and the one thread that recovers it after a loss."""

    def __init__(
        self, client: Opener, holdings: Holdings, policy: RetryPolicy = RECOVERY_POLICY
    ) -> None:
        self._client = client
        self._holdings = holdings
        self._policy = policy
        self._lock = threading.Lock()
        self._current: ClientSession | None = None
        self._closed = threading.Event()  # set by close(): cuts every backoff wait short
        self._wanted = threading.Event()  # a loss the running recovery has not seen yet
        self._thread: threading.Thread | None = None
        self._pending: set[Key] = set()  # held versions not yet re-registered
        self.failures = 0  # failed recovery attempts, all losses together
        self.recoveries = 0  # sessions opened by a recovery

    # -- the session -------------------------------------------------------------------------

    @property
    def current(self) -> ClientSession | None:
        """The session in use (None before the first is open); it may be lost."""
        return self._current

    @property
    def recovering(self) -> bool:
        """Whether a recovery thread is running now."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def open_first(self) -> ClientSession:
        """Open the client's first session (connect): errors propagate, nothing is retried."""
        session = self._client._session_of(self._client._open_session_rpc())
        with self._lock:
            self._current = session
        return session

    def lost(self, session: ClientSession) -> None:
        """`session` was lost (its `on_lost`): start a recovery, unless one runs already
        (it sees this loss on its next try) or the client is closing."""
        with self._lock:
            if self._closed.is_set():
                return
            self._wanted.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._supervise, name="hub-session-recover", daemon=True
                )
                self._thread.start()

    # -- recovery ----------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._closed.is_set():
            self._wanted.clear()
            try:
                self._policy.retrying(
                    None, stop=self._closed.is_set, sleep=self._closed.wait,
                    before_sleep=self._failed,
                )(self._attempt)  # fmt: skip
            except Exception as exc:  # only when closing: the policy retries everything else
                log.info("session recovery stopped by close(): %s", exc)
                return
            with self._lock:
                if self._closed.is_set():
                    return
                if not self._wanted.is_set():  # done: a later loss starts a new thread
                    self._thread = None
                    return

    def _failed(self, exc: BaseException, delay: float) -> None:
        self.failures += 1
        log.warning("session recovery failed (%s); trying again in %.2fs", exc, delay)

    def _attempt(self) -> None:
        """One try: a new session if the current one is lost, then the versions not yet
        re-registered under it. Raises whatever failed; the policy tries again."""
        current = self._current
        if current is None or current.lost.is_set():
            opened = self._client._open_session_rpc()
            session = self._install(opened)
            if session is None:
                return  # closed meanwhile: disposed of
            log.info("session %x replaces lost session %x", session.id, getattr(current, "id", 0))
        if self._pending:
            self._holdings.reregister(self._pending, self._register)

    def _install(self, opened: pb.OpenSessionResponse) -> ClientSession | None:
        """Make `opened` the client's session, unless close() came first: then end it."""
        old: ClientSession | None = None
        with self._lock:
            installed = not self._closed.is_set()
            if installed:
                old, self._current = self._current, self._client._session_of(opened)
                self._pending = {h.key for h in self._holdings.held()}
                self.recoveries += 1
            session = self._current
        if not installed:
            self._dispose(int(opened.session_id))
            return None
        if old is not None:
            old.stop()  # lost: its thread is ending (outside the lock: it may call lost())
        return session

    def _dispose(self, session_id: int) -> None:
        """End a session opened after close(): never renewed, revoked if the hub still
        answers, else it expires within its TTL."""
        try:
            self._client._close_session_rpc(session_id, DISPOSE_TIMEOUT)
        except Exception as exc:  # a TensorHubError, or the channel closed by close()
            log.info("session %x opened while closing: %s; it expires within its TTL",
                     session_id, exc)  # fmt: skip

    def _register(self, model: str, version: int, complete: bool, shard: int | None) -> int:
        return self._client._register(model, version, complete=complete, shard=shard)

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> ClientSession:
        """Stop recovering (no session is installed after this); the session to end."""
        with self._lock:
            self._closed.set()
            if self._current is None:
                raise InternalError("closing a client that never opened a session")
            return self._current

    def join(self, timeout: float = RECOVERY_JOIN_TIMEOUT) -> bool:
        """Wait up to `timeout` for the recovery thread to stop; whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True
