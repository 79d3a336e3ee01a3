"""The accept loop of a holder's control channels (RDMA descriptors, same-host CUDA IPC).

One thread accepts; each admitted connection gets a thread of its own running the
subclass's `serve`. Admission is the data port's (`transport.admission`): at most
`max_connections`, at most `per_peer` from one address; at either bound an unauthenticated
connection (of that peer, at the per-peer bound) is evicted to admit a newcomer, and only
when none is left is the newcomer refused BUSY; a request that is not whole within
`frame_timeout` of accept is cut. `stop` cuts every connection, so no thread waits on a
peer past it.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import socket
import threading

from transport.admission import Admission, Conn
from transport.frames import send_message
from transport.wire import ErrorCode

log = logging.getLogger(__name__)

IO_TIMEOUT = 10.0
MAX_CONNECTIONS = 128  # as the TCP data port (transport.server)
PER_PEER = 64
FRAME_TIMEOUT = 10.0


def shut(sock: socket.socket) -> None:
    """Cut a connection at the TCP level; the thread blocked on it sees the error and ends."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class ControlListener(abc.ABC):
    """Accepts control connections on `host:port` (0: a free port) and serves each one in a
    thread. Subclasses implement `serve`, `refusal` and `tick` (run on every loop turn)."""

    name = "control"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        per_peer: int = PER_PEER,
        frame_timeout: float = FRAME_TIMEOUT,
    ) -> None:
        self.admission = Admission(max_connections, per_peer, frame_timeout, IO_TIMEOUT)
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(min(0.5, frame_timeout / 4))
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=self.name, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start_listening(self) -> None:
        self._thread.start()

    def stop_listening(self) -> None:
        """Stop accepting and cut every open connection."""
        self.stopping.set()
        self._sock.close()
        for sock in self.admission.sockets():
            shut(sock)
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    @abc.abstractmethod
    def serve(self, conn: socket.socket, record: Conn) -> None:
        """Answer one admitted connection (its thread); the listener forgets and closes it."""

    @abc.abstractmethod
    def refusal(self, code: ErrorCode, message: str) -> bytes:
        """The encoded refusal this channel's readers understand."""

    @abc.abstractmethod
    def tick(self) -> None:
        """Housekeeping on every turn of the accept loop (at least twice a second)."""

    def _accept(self) -> None:
        while not self.stopping.is_set():
            self.tick()
            for late in self.admission.expired():  # no whole request in time: cut it
                shut(late.sock)
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            record, victim, why = self.admission.admit(conn, str(addr[0]))
            if victim is not None:
                shut(victim.sock)
            if record is None:
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    send_message(conn, self.refusal(ErrorCode.BUSY, why))
                continue
            try:
                threading.Thread(
                    target=self._run, args=(conn, record), name=f"{self.name}-conn", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread to be had: this connection, not the port
                log.warning("%s cannot serve a connection: %s", self.name, exc)
                self.admission.forget(record)
                conn.close()

    def _run(self, conn: socket.socket, record: Conn) -> None:
        try:
            with conn:
                self.serve(conn, record)
        except OSError as exc:
            log.debug("%s connection closed: %s", self.name, exc)
        except Exception:  # a bug must cost one connection, never the channel
            log.exception("%s connection failed", self.name)
        finally:
            self.admission.forget(record)
