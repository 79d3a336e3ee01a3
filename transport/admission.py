"""Which connections a holder's data port keeps: frame deadlines, eviction, per-peer bounds.

A holder serves one thread per connection, so an open connection is a scarce slot. Without
bounds, 64 idle TCP connections (no token needed) that each send a byte now and then hold
every slot forever and every legitimate reader is answered BUSY. `Admission` keeps a record
of every open connection and enforces three rules, all cheap and all without a token:

- **Frame deadline.** A request frame must be complete within `frame_timeout` of the moment
  the holder starts to expect it: from accept (TLS handshake included) for a connection's
  first frame, from its first byte for a later one. A connection past its deadline is shut
  down (`expired`). A connection that has been served — presented a valid read token — may
  sit idle between requests up to `idle_timeout`.
- **Eviction.** At `max_connections`, a new connection is admitted by shutting down one that
  has not yet presented a valid read token (of the peer address with the most connections,
  oldest first). Connections that have been served are never evicted; if every slot is
  one of those, the newcomer is refused.
- **Per-peer bound.** At most `per_peer` connections from one peer address, so one host
  cannot take every slot. A newcomer from a peer at its bound is admitted by evicting that
  peer's oldest token-less connection, as at `max_connections`; it is refused only when
  every one of the peer's connections has presented a valid token. Refusing instead let a
  process holding `per_peer` token-less connections (reconnecting before each frame
  deadline) lock out every reader of its own host for as long as it liked.

A connection whose request frame is complete and being checked (`answering`) is never a
victim: it is about to prove itself or be refused, and evicting it would punish a reader
for the holder's own latency. So a reader connecting beside a flood of token-less
connections loses its slot only if `per_peer` newer ones arrive before its GET does, and
an evicted connection is told BUSY (`Conn.evicted`; on a port without TLS), which the SDK
retries within its deadline.

Thread-safe. The server does the socket work (shutdown, BUSY frames); this module decides.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from tensorhub.errors import InvalidArgument


@dataclass(eq=False)
class Conn:
    """One open connection as the holder sees it. `deadline` (a time.monotonic() value) is
    when the frame it is waiting for must be complete; None while the holder answers."""

    sock: socket.socket
    peer: str
    accepted: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    authenticated: bool = False  # it has presented a valid read token
    evicted: bool = False  # shut to make room: its thread answers BUSY if it still can


class Admission:
    """The open connections of one holder server and the rules for admitting more."""

    def __init__(
        self, max_connections: int, per_peer: int, frame_timeout: float, idle_timeout: float
    ) -> None:
        if max_connections < 1 or per_peer < 1 or frame_timeout <= 0 or idle_timeout <= 0:
            raise InvalidArgument("connection limits and timeouts must be positive")
        self.max_connections, self.per_peer = max_connections, per_peer
        self.frame_timeout, self.idle_timeout = frame_timeout, idle_timeout
        self._lock = threading.Lock()
        self._open: set[Conn] = set()
        self._peers: Counter[str] = Counter()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def admit(self, sock: socket.socket, peer: str) -> tuple[Conn | None, Conn | None, str]:
        """Decide on a newly accepted connection: `(record, victim, why)`. `record` is None
        when it is refused (`why` says why); `victim`, when set, is an unauthenticated
        connection the caller must shut down to make room (it is already forgotten here,
        and marked `evicted`). A peer at `per_peer` makes room among its own connections;
        otherwise a full holder makes room among the busiest peer's."""
        now = time.monotonic()
        with self._lock:
            victim = None
            if self._peers[peer] >= self.per_peer:
                victim = self._victim(peer)
                if victim is None:
                    return (
                        None,
                        None,
                        (
                            f"too many connections from {peer} (at most {self.per_peer}, "
                            "all serving readers)"
                        ),
                    )
            elif len(self._open) >= self.max_connections:
                victim = self._victim()
                if victim is None:
                    return None, None, f"too many connections (at most {self.max_connections})"
            if victim is not None:
                victim.evicted = True
                self._drop(victim)
            conn = Conn(sock, peer, now, now + self.frame_timeout)
            self._open.add(conn)
            self._peers[peer] += 1
            return conn, victim, ""

    def _victim(self, peer: str | None = None) -> Conn | None:
        """An unauthenticated connection to evict, not one whose request is being checked:
        of `peer` when given, else of the busiest peer address; the oldest first."""
        unproven = [
            c
            for c in self._open
            if not c.authenticated and c.deadline is not None and peer in (None, c.peer)
        ]
        if not unproven:
            return None
        return min(unproven, key=lambda c: (-self._peers[c.peer], c.accepted))

    def _drop(self, conn: Conn) -> bool:
        if conn not in self._open:
            return False
        self._open.discard(conn)
        self._peers[conn.peer] -= 1
        if not self._peers[conn.peer]:
            del self._peers[conn.peer]
        return True

    def forget(self, conn: Conn) -> None:
        """The connection has closed (idempotent: an evicted or expired one is gone already)."""
        with self._lock:
            self._drop(conn)

    def replace_socket(self, conn: Conn, sock: socket.socket) -> None:
        """The connection's socket is now `sock` (wrapped in TLS)."""
        with self._lock:
            conn.sock = sock

    def authenticated(self, conn: Conn) -> None:
        """The connection presented a valid read token: it is no longer evictable."""
        with self._lock:
            conn.authenticated = True

    def answering(self, conn: Conn) -> None:
        """A complete frame arrived; the holder answers it (no deadline meanwhile)."""
        with self._lock:
            conn.deadline = None

    def idle(self, conn: Conn) -> None:
        """The answer went out; the next frame may start within `idle_timeout`."""
        with self._lock:
            conn.deadline = time.monotonic() + self.idle_timeout

    def frame_started(self, conn: Conn) -> None:
        """The first byte of a later frame arrived: the rest is due within `frame_timeout`."""
        with self._lock:
            conn.deadline = time.monotonic() + self.frame_timeout

    def expired(self) -> list[Conn]:
        """Forget and return every connection past its deadline (the caller shuts them)."""
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._open if c.deadline is not None and c.deadline <= now]
            for conn in late:
                self._drop(conn)
        return late

    def sockets(self) -> list[socket.socket]:
        with self._lock:
            return [c.sock for c in self._open]
