"""A small fault-injecting TCP proxy: the chaos run's stand-in for a network it can break.

Clients reach hub replicas and holders through these proxies, so a failpoint can blackhole
the traffic (connections stay open, no byte moves either way, as when packets are dropped
and TCP keeps retransmitting), delay it (every forwarded read waits first), switch the
upstream (a stale replica answers instead), or cut every connection. The kernel here has no
netem, and nftables rules would need every process in a namespace; a proxy needs neither.
Bytes are never dropped or reordered: when a fault ends, the held traffic flows again.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

log = logging.getLogger(__name__)

_READ = 256 * 1024
_POLL = 0.05  # how often a held (blackholed) pump looks whether the fault has ended


class Proxy:
    """Forward `listen` → `upstream`; `mode` is "pass", "blackhole" or "delay"."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.delay = 0.0
        self._listener = socket.create_server(listen, backlog=128)
        self._listener.settimeout(0.2)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="chaos-proxy", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def set(self, mode: str, delay: float = 0.0) -> None:
        """Change how traffic flows from now on (existing connections included)."""
        self.mode, self.delay = mode, delay

    def switch(self, upstream: tuple[str, int]) -> None:
        """Send new connections to `upstream` and cut the current ones."""
        self.upstream = upstream
        self.cut()

    def cut(self) -> None:
        """Reset every open connection (both sides see the connection drop)."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stopped.set()
        self.cut()
        with contextlib.suppress(OSError):  # wakes the thread in accept() now, not at its timeout
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=2)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(
                target=self._connect, args=(client,), name="chaos-proxy-conn", daemon=True
            ).start()

    def _connect(self, client: socket.socket) -> None:
        self._hold()  # a blackholed link does not even complete the upstream connect
        try:
            server = socket.create_connection(self.upstream, timeout=5.0)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.settimeout(None)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns.update((client, server))
        threading.Thread(
            target=self._pump, args=(server, client), name="chaos-proxy-down", daemon=True
        ).start()
        self._pump(client, server)

    def _hold(self) -> None:
        """Wait while the link is blackholed (bounded by the proxy's life)."""
        while self.mode == "blackhole" and not self._stopped.is_set():
            time.sleep(_POLL)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stopped.is_set():
                self._hold()
                data = src.recv(_READ)
                if not data:
                    break
                self._hold()
                if self.mode == "delay" and self.delay > 0:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            src.close()
