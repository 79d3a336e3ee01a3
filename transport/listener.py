"""The one accept loop and lifecycle of every holder backend's port: the TCP data port
(`transport.server`) and the control channels of RDMA, same-host CUDA IPC and NIXL (each a
`ControlServer`: the store it serves from, the verifier every request passes, its limits,
and the one way a control request is read).

`start` binds and starts the accept thread (a backend that prepares more extends it), `stop`
stops it, and a port is a context manager over both. One thread accepts; each admitted
connection gets a thread of its own running the subclass's `serve`. Admission is
`transport.admission`'s: at most `max_connections`, at most `per_peer` from one address; at
either bound an unauthenticated connection is evicted (`evict`) to admit a newcomer, and only
when none is left is the newcomer refused with the subclass's BUSY message (`busy`); a
request that is not whole within `frame_timeout` is cut. `stop` cuts every connection, so no
thread waits on a peer past it.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Self, TypedDict, TypeVar, Unpack

from tensorhub.errors import TransportError
from transport.admission import Admission, Conn
from transport.frames import framed, recv_message, send_message
from transport.store import HeldVersion, Key
from transport.verifier import Refused, lookup
from transport.wire import ErrorCode

if TYPE_CHECKING:
    from transport.store import HolderStore
    from transport.verifier import Verifier

log = logging.getLogger(__name__)

R = TypeVar("R")

IO_TIMEOUT = 10.0
MAX_CONNECTIONS = 128  # as the TCP data port (transport.server)
PER_PEER = 64
FRAME_TIMEOUT = 10.0


def shut(sock: socket.socket) -> None:
    """Cut a connection so the thread blocked on it returns at once (it closes the socket).
    At the TCP level even for a TLS socket: `SSLSocket.shutdown` would also drop the TLS
    state under the thread still reading it."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class Listener(abc.ABC):
    """Accepts connections on `host:port` (0: a free port, bound by `start`) and serves
    each one in a thread. Subclasses implement `serve` and `busy`; `evict` and `tick` have
    defaults, and `start`/`stop` are extended by a backend with more to set up or drop."""

    name = "listener"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        per_peer: int = PER_PEER,
        frame_timeout: float = FRAME_TIMEOUT,
        io_timeout: float = IO_TIMEOUT,
    ) -> None:
        # io_timeout bounds each send and receive, and the idle time between requests.
        self.admission = Admission(max_connections, per_peer, frame_timeout, io_timeout)
        self.io_timeout = io_timeout
        self._bind = (host, port)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.stopping = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        """Where this port listens (`TransportError` before `start`)."""
        if self._sock is None:
            raise TransportError(f"{self.name} is not started")
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> Self:
        """Bind and start the accept thread; idempotence is the caller's
        (`ros.client.serving.Serving.start`)."""
        sock = socket.create_server(self._bind, backlog=128)
        # the loop wakes at least this often: it notices a stop and late frames
        sock.settimeout(min(0.5, self.admission.frame_timeout / 4))
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, cut every open connection, and wait briefly for the loop."""
        self.stopping.set()
        if self._sock is not None:
            # shut first: on Linux that wakes the thread blocked in accept() at once, where
            # closing alone leaves it there until its timeout (half a second per stop)
            shut(self._sock)
            self._sock.close()
        for sock in self.admission.sockets():
            shut(sock)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @abc.abstractmethod
    def serve(self, record: Conn) -> None:
        """Answer one admitted connection (`record.sock`), in its own thread; the listener
        forgets it and closes its socket afterwards."""

    @abc.abstractmethod
    def busy(self, why: str) -> bytes:
        """The encoded BUSY refusal this port's readers understand."""

    def evict(self, victim: Conn) -> None:
        """Make room: cut `victim`, a connection that has presented no valid token."""
        shut(victim.sock)

    def tick(self) -> None:
        """Housekeeping on every turn of the accept loop (at least twice a second)."""
        return  # nothing by default

    def _accept(self) -> None:
        sock = self._sock
        while sock is not None and not self.stopping.is_set():
            self.tick()
            for late in self.admission.expired():  # no whole request in time: cut it
                log.debug("%s: cutting %s: no complete request in time", self.name, late.peer)
                shut(late.sock)
            try:
                conn, addr = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            record, victim, why = self.admission.admit(conn, str(addr[0]))
            if victim is not None:
                log.debug("%s: evicting unauthenticated %s: full", self.name, victim.peer)
                self.evict(victim)
            if record is None:
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    conn.sendall(self.busy(why))
                continue
            try:
                threading.Thread(
                    target=self._run, args=(record,), name=f"{self.name}-conn", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread to be had: this connection, not the port
                log.warning("%s cannot serve a connection: %s", self.name, exc)
                self.admission.forget(record)
                conn.close()

    def _run(self, record: Conn) -> None:
        try:
            self.serve(record)
        except OSError as exc:
            log.debug("%s connection closed: %s", self.name, exc)
        except Exception:  # a bug must cost one connection, never the port
            log.exception("%s connection failed", self.name)
        finally:
            self.admission.forget(record)
            record.sock.close()  # the TLS socket when the handshake replaced it


class PortLimits(TypedDict, total=False):
    """A port's admission limits (`transport.admission.Admission`); each one left out is
    this module's default."""

    max_connections: int
    per_peer: int
    frame_timeout: float


class ControlServer(Listener):
    """The control port of a holder backend that hands out access to held memory (RDMA,
    CUDA IPC, NIXL): it serves from `store`, and each request passes `verifier`
    (`transport.verifier.lookup`) before anything is shared. Subclasses speak their own
    hand-shake in `serve`, after reading its request with `request` and the version it names
    with `offered`, and encode their own refusals (`refusal`, which also makes the BUSY
    answer)."""

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        host: str = "127.0.0.1",
        port: int = 0,
        **limits: Unpack[PortLimits],
    ) -> None:
        super().__init__(host, port, **limits)
        self._store, self._verifier = store, verifier
        self._lock = threading.Lock()  # the subclass's own state

    @abc.abstractmethod
    def refusal(self, code: ErrorCode, message: str) -> bytes:
        """This backend's encoded refusal (unframed) with `code` and `message`."""

    def busy(self, why: str) -> bytes:
        return framed(self.refusal(ErrorCode.BUSY, why))

    def refuse(self, conn: socket.socket, code: ErrorCode, message: str) -> None:
        """Send this backend's refusal on `conn`."""
        send_message(conn, self.refusal(code, message))

    def request(self, record: Conn, decode: Callable[[bytes], R], max_bytes: int) -> R | None:
        """The one request a control connection opens with (at most `max_bytes`), decoded by
        `decode`; None after answering BAD_FRAME when it is not whole within `IO_TIMEOUT`
        or does not decode. A whole request lifts the frame deadline (`answering`)."""
        conn = record.sock
        try:
            conn.settimeout(IO_TIMEOUT)
            request = decode(recv_message(conn, max_bytes))
        except (TransportError, OSError) as exc:
            with contextlib.suppress(OSError):
                self.refuse(conn, ErrorCode.BAD_FRAME, str(exc))
            return None
        self.admission.answering(record)
        return request

    def offered(
        self, record: Conn, key: Key, token: bytes, digest: int, *, on_cuda: str = ""
    ) -> HeldVersion | None:
        """The version `key` names, if `token` passes (`transport.verifier.lookup`) and this
        backend offers it: COMPLETE here and, when `on_cuda` says why not, in host memory
        (else NOT_READY: read it over tcp). None once the refusal is sent. An accepted token
        authenticates the connection: it is never evicted from then on."""
        found = lookup(self._store, self._verifier, key, token, digest)
        if isinstance(found, HeldVersion) and (not found.complete or (on_cuda and found.on_cuda)):
            why = "PARTIAL here" if not found.complete else on_cuda
            message = f"{key[1]}@{key[2]} is {why}: read over tcp"
            found = Refused(ErrorCode.NOT_READY, message, token_ok=True)
        if isinstance(found, Refused):
            self.refuse(record.sock, found.code, found.message)
            return None
        self.admission.authenticated(record)
        return found
