"""A session owns one etcd lease and keeps it alive in the background.

Modelled on etcd's `concurrency.Session`: `done` is set when the lease is lost (expired,
revoked, or not renewable before its TTL ran out); `close()` stops renewing *and* revokes, so
every record attached to the lease disappears at once; `orphan()` only stops renewing, so the
records live until the TTL runs out (what a crashed process looks like to everyone else).
The session id is the lease id, so another process (a hub replica) can adopt and renew it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import TracebackType

from consistency.etcd import Etcd
from tensorhub.errors import InvalidArgument, LeaseLost, TensorHubError

log = logging.getLogger(__name__)

DEFAULT_TTL = 10


class Session:
    """A leased session. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        etcd: Etcd,
        *,
        ttl: int = DEFAULT_TTL,
        lease_id: int | None = None,
        keepalive: bool = True,
    ) -> None:
        """Grant a lease (or adopt `lease_id`) and renew it in the background unless told not to."""
        if ttl < 1:
            raise InvalidArgument(f"session TTL must be at least 1 second, got {ttl}")
        self._etcd = etcd
        self.ttl = ttl
        if lease_id is None:
            self.id, self.ttl = etcd.lease_grant(ttl)
        else:
            remaining = etcd.lease_ttl(lease_id)
            if remaining < 0:  # -1: etcd does not know it; 0 is "alive, under a second left"
                raise LeaseLost(f"session {lease_id:x} has expired")
            self.id = lease_id
        self.done = threading.Event()
        self._stop = threading.Event()
        self._expires_at = time.monotonic() + self.ttl
        self._thread: threading.Thread | None = None
        if keepalive:
            self._thread = threading.Thread(
                target=self._keepalive_loop, name=f"session-{self.id:x}", daemon=True
            )
            self._thread.start()

    @property
    def alive(self) -> bool:
        return not self.done.is_set()

    def check(self) -> None:
        """Raise `LeaseLost` if the session is gone: call before acting on its records."""
        if self.done.is_set():
            raise LeaseLost(f"session {self.id:x} is lost; its records are gone")

    def renew(self, timeout: float | None = None) -> int:
        """Renew the lease once; returns the TTL granted. Sets `done` if it has expired."""
        ttl = self._etcd.lease_keepalive(self.id, timeout=timeout)
        if ttl <= 0:
            self._lose("lease expired")
            raise LeaseLost(f"session {self.id:x} has expired")
        self._expires_at = time.monotonic() + ttl
        return ttl

    def _keepalive_loop(self) -> None:
        normal = max(self.ttl / 3.0, 0.2)
        interval = normal
        while not self._stop.wait(interval):
            remaining = self._expires_at - time.monotonic()
            if remaining <= 0:
                self._lose("could not renew before the TTL ran out")
                return
            try:
                self.renew(timeout=max(min(normal, remaining), 0.1))
                interval = normal
            except LeaseLost:
                return
            except TensorHubError as exc:
                # A transient etcd failure: keep trying until the TTL would have run out,
                # since the lease may still be alive on the cluster.
                log.warning("session %x: renewal failed (%s); retrying", self.id, exc)
                interval = 0.2

    def _lose(self, why: str) -> None:
        if not self.done.is_set():
            log.warning("session %x lost: %s", self.id, why)
        self._stop.set()
        self.done.set()

    def orphan(self) -> None:
        """Stop renewing without revoking: the records live until the TTL runs out."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def close(self, timeout: float | None = None) -> None:
        """Stop renewing and revoke the lease, deleting every record attached to it."""
        self.orphan()
        if not self.done.is_set():
            # If the revoke fails, the lease expires by itself within its TTL anyway.
            with contextlib.suppress(TensorHubError):
                self._etcd.lease_revoke(self.id, timeout=timeout)
        self.done.set()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
