"""A TCP relay between one hub replica and etcd that can stop at a chosen request (issue 25).

The fault tests kill a replica "in the middle of" a publish or a fetch. A sleep cannot say
where the replica is, so the replica dials etcd through a `Tap`: armed with the bytes of a
key (`arm(needle)`), it watches what the replica sends to etcd and, at the `nth` request
carrying that key:

- `drop`: forwards nothing more from that connection: the request never reaches etcd;
- `apply`: forwards it (etcd applies it) and from then on withholds every byte etcd sends
  back to the replica: the write happened and its reply is lost.

Either way `hit` is set, and the test kills the replica, knowing which step it was in.
gRPC sends protobuf fields as they are, so a key is found in the stream as its own bytes; a
key split over two reads is still found (the tail of the previous read is kept). Taps armed
together stop once between them (the retry on the other replica goes through). Loopback
only; nothing is dropped or reordered before the hit.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Tap:
    """Relay `listen` (127.0.0.1, a free port) → `target` (an etcd member's host:port)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._needle = b""
        self._nth = 1
        self._seen = 0
        self._mode = "drop"
        self._group = threading.Event()  # set by the first hit of the taps armed together
        self.hit = threading.Event()  # the chosen request was met
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="etcd-tap", daemon=True).start()

    def arm(
        self, needle: bytes, *, mode: str, nth: int = 1, group: threading.Event | None = None
    ) -> None:
        """Stop at the `nth` request to etcd that carries `needle` (`mode` drop or apply).

        Taps armed with one `group` stop once between them: the first hit sets it, and the
        others let everything through from then on (the client's retry of the request on
        another replica must reach etcd)."""
        if mode not in ("drop", "apply"):
            raise ValueError(f"mode must be drop or apply, not {mode!r}")
        with self._lock:
            self._needle, self._mode, self._nth, self._seen = needle, mode, nth, 0
            self._group = group or threading.Event()

    def close(self) -> None:
        """Stop relaying: every connection is cut, every held pump let go."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._to_etcd, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._to_hub, args=(upstream, client), daemon=True).start()

    def _matches(self, carry: bytes, data: bytes) -> bool:
        """Whether this read makes the armed request the chosen one (counted once a read)."""
        with self._lock:
            if not self._needle or self._group.is_set() or self._needle not in carry + data:
                return False
            self._seen += 1
            if self._seen < self._nth:
                return False
            self._group.set()
            return True

    def _to_etcd(self, src: socket.socket, dst: socket.socket) -> None:
        carry = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.hit.is_set() and self._mode == "drop":
                    self._closed.wait()  # the replica is being killed: nothing more goes
                    return
                if self._matches(carry, data):
                    self.hit.set()
                    if self._mode == "drop":
                        self._closed.wait()
                        return
                dst.sendall(data)
                carry = data[-max(len(self._needle) - 1, 0) :] if self._needle else b""
        self._shut(src, dst)

    def _to_hub(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.hit.is_set() and self._mode == "apply":
                    self._closed.wait()  # the reply is lost with the replica
                    return
                dst.sendall(data)
        self._shut(src, dst)

    @staticmethod
    def _shut(*sockets: socket.socket) -> None:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
