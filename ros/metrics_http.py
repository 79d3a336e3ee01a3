"""The hub's Prometheus port (`tensorhub serve --metrics-port`): one thread, whatever the
number of connections, and a deadline on every one.

prometheus_client's `start_http_server` is a threading HTTP server: every connection gets a
thread that waits on it with no timeout, and the port needs no token, so 600 idle
connections would hold 600 hub threads for as long as they stay open. `MetricsServer` is one
`selectors` loop on one thread instead:

- **A deadline per connection.** The request must be complete within `timeout` of accept,
  and the answer taken within `timeout` of the request; past either the connection is
  closed. Nothing is kept alive: every answer says `Connection: close`.
- **Bounded connections.** At most `max_connections` are open. A newcomer past that evicts
  the oldest connection still waiting for its request (a scraper sends its request at once,
  so only a silent one is ever old); when every one is already being answered, the
  newcomer is closed.
- **Bounded requests.** A request head over `MAX_REQUEST_BYTES` is answered 431 and closed;
  only GET and HEAD are served (any path, as prometheus_client does: the exposition of the
  registry, OpenMetrics when asked for, `name[]` filters, gzip when accepted).

So the port costs one thread, at most `max_connections` sockets and their buffers, for at
most twice `timeout` each; a flood of connections costs churn, not threads.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import selectors
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from tensorhub.errors import InvalidArgument

log = logging.getLogger(__name__)

TIMEOUT = 5.0  # seconds for the request after accept, and again for the answer to be taken
MAX_CONNECTIONS = 64  # open at once; a scraper needs one
MAX_REQUEST_BYTES = 8192  # request line and headers


@dataclass(eq=False)
class _Conn:
    """One open connection: what it sent so far, what is left to send, and its deadline (a
    time.monotonic() value)."""

    sock: socket.socket
    deadline: float
    accepted: float = field(default_factory=time.monotonic)
    received: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None  # set once the request is complete


class MetricsServer:
    """Serve `registry` on `host:port` (0: a free port) from one thread (module docstring).
    `start` binds and starts it; `close` stops it and closes every connection."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        registry: CollectorRegistry = REGISTRY,
        timeout: float = TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if timeout <= 0 or max_connections < 1:
            raise InvalidArgument("timeout and max_connections must be positive")
        self._registry, self.timeout, self.max_connections = registry, timeout, max_connections
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the loop at once
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._open: dict[socket.socket, _Conn] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def __len__(self) -> int:
        """Connections open now (read from the loop's thread; a snapshot elsewhere)."""
        return len(self._open)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop (within 2 s) and close the port and every connection."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=2.0)
        for sock in list(self._open):
            sock.close()
        self._open.clear()
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            wait = min((c.deadline for c in self._open.values()), default=now + 1.0) - now
            try:
                events = self._selector.select(timeout=min(max(wait, 0.0), 1.0))
            except OSError as exc:  # the selector itself failed: nothing left to serve
                log.warning("metrics port stopped: %s", exc)
                return
            for key, mask in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        return
                    elif mask & selectors.EVENT_READ:
                        self._read(self._open[sock])
                    else:
                        self._write(self._open[sock])
                except KeyError:  # closed earlier in this batch of events
                    continue
                except Exception:  # a bug costs one connection, never the port
                    log.exception("metrics connection failed")
                    if sock in self._open:
                        self._close(self._open[sock])
            now = time.monotonic()
            for conn in [c for c in self._open.values() if c.deadline <= now]:
                self._close(conn)

    def _accept(self) -> None:
        """Take every pending connection (a few dozen at most per turn)."""
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: this connection, not the port
                log.warning("metrics port cannot accept: %s", exc)
                return
            sock.setblocking(False)
            if len(self._open) >= self.max_connections and not self._evict():
                sock.close()
                continue
            conn = _Conn(sock, time.monotonic() + self.timeout)
            self._open[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _evict(self) -> bool:
        """Close the oldest connection still waiting for its request; False if none is."""
        waiting = [c for c in self._open.values() if c.answer is None]
        if not waiting:
            return False
        self._close(min(waiting, key=lambda c: c.accepted))
        return True

    def _read(self, conn: _Conn) -> None:
        try:
            got = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not got:
            self._close(conn)
            return
        conn.received += got
        end = conn.received.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.received) > MAX_REQUEST_BYTES:
                self._answer(conn, 431, "Request Header Fields Too Large", b"")
            return
        self._answer(conn, *self._respond(bytes(conn.received[:end])))

    def _respond(self, head: bytes) -> tuple[int, str, bytes, list[tuple[str, str]], bool]:
        """Status, reason, body, headers and whether the body is sent (not for HEAD)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "Bad Request", b"", [], True
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, "Method Not Allowed", b"", [("Allow", "GET, HEAD")], True
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        params = urllib.parse.parse_qs(urllib.parse.urlparse(target).query)
        registry: Collector = self._registry
        if "name[]" in params:
            registry = self._registry.restricted_registry(params["name[]"])
        body = encoder(registry)
        extra = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        return 200, "OK", body, extra, method == "GET"

    def _answer(
        self,
        conn: _Conn,
        status: int,
        reason: str,
        body: bytes,
        headers: list[tuple[str, str]] | None = None,
        send_body: bool = True,
    ) -> None:
        """Queue the answer and wait for the socket to take it, within a fresh deadline."""
        head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers or []]
        head.append("Connection: close")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body if send_body else b"")
        conn.answer = memoryview(data)
        conn.received = bytearray()
        conn.deadline = time.monotonic() + self.timeout
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, None)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        if conn.answer is None:
            return
        try:
            sent = conn.sock.send(conn.answer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.answer = conn.answer[sent:]
        if not conn.answer:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)  # a clean end of the answer
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._open.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
