"""The fault proxy on real sockets: pass, blackhole (bytes held, then delivered), cut."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from chaos.proxy import Proxy


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)

    def serve() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    server.close()


@pytest.mark.timeout(30)
def test_blackhole_holds_bytes_until_recovery_then_cut_drops_the_connection(
    echo: tuple[str, int],
) -> None:
    proxy = Proxy(("127.0.0.1", 0), echo).start()
    try:
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as client:
            client.sendall(b"one")
            assert client.recv(16) == b"one"
            proxy.set("blackhole")
            client.sendall(b"two")
            client.settimeout(0.5)
            with pytest.raises(TimeoutError):
                client.recv(16)
            proxy.set("pass")
            client.settimeout(5)
            assert client.recv(16) == b"two"
            proxy.cut()
            assert client.recv(16) == b""
    finally:
        proxy.stop()
