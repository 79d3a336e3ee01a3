"""The demo's control channel: JSON lines over local TCP between the driver and its workers.

Rewards, progress reports and commands travel here; weights never do (they go through the
hub's data plane). A socket, unlike a multiprocessing queue, survives a SIGKILLed peer: the
driver just sees EOF on that worker's connection.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from tensorhub.errors import DeadlineExceeded, TransportError

Message = dict[str, Any]


def _send(sock: socket.socket, lock: threading.Lock, message: Message) -> None:
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    with lock:
        sock.sendall(data)


def _lines(sock: socket.socket) -> Any:
    """Yield decoded messages until EOF or a socket error."""
    with sock.makefile("rb") as stream:
        try:
            for line in stream:
                yield json.loads(line)
        except (OSError, ValueError):
            return


@dataclass
class Inbound:
    """One message from worker `sender` (or `{"type": "eof"}` when its connection closed)."""

    sender: str
    message: Message


class Driver:
    """The driver's end: accepts workers (each says `hello` with its name first), delivers
    every message into one queue, and sends commands to a worker by name."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self._peers: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="demo-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(sock,), daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        name = ""
        for message in _lines(sock):
            if not name:
                name = str(message.get("name", ""))
                with self._lock:
                    self._peers[name] = (sock, threading.Lock())
            self.inbox.put(Inbound(name, message))
        if name:
            self.inbox.put(Inbound(name, {"type": "eof"}))

    def send(self, name: str, message: Message) -> bool:
        """Send to one worker; False if it is not connected (or its socket broke)."""
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            return False
        try:
            _send(peer[0], peer[1], message)
        except OSError:
            return False
        return True

    def next(self, timeout: float) -> Inbound | None:
        try:
            return self.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            peers = list(self._peers.values())
        for sock, _ in peers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class Link:
    """A worker's end: connects, says hello, sends reports, and receives commands."""

    def __init__(self, port: int, name: str, timeout: float = 30.0) -> None:
        try:
            self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"cannot reach the demo driver on port {port}: {exc}") from exc
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self.name = name
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.send({"type": "hello"})
        threading.Thread(target=self._read, name="demo-link", daemon=True).start()

    def _read(self) -> None:
        for message in _lines(self._sock):
            self.inbox.put(message)
        self.inbox.put({"type": "eof"})

    def send(self, message: Message) -> None:
        _send(self._sock, self._lock, {"name": self.name, **message})

    def receive(self, timeout: float, kinds: tuple[str, ...]) -> Message:
        """The next message of one of `kinds` (others are dropped), or `DeadlineExceeded`.
        EOF (the driver went away) comes back as a message of type "eof"."""
        end = time.monotonic() + timeout
        while True:
            try:
                message = self.inbox.get(timeout=max(end - time.monotonic(), 0.0))
            except queue.Empty:
                raise DeadlineExceeded(
                    f"{self.name}: no {'/'.join(kinds)} within {timeout:.0f}s"
                ) from None
            if message.get("type") in (*kinds, "eof"):
                return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
