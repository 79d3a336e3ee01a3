"""Socket helpers shared by the attack tests of the holder data port and the RDMA control
port: wait for the server to cut a connection, and send a frame one byte at a time."""

from __future__ import annotations

import socket
import threading

WAIT = 30.0  # generous bound on any wait for the server (a noisy shared machine)


def closed_by_peer(sock: socket.socket, wait: float = WAIT) -> bool:
    """Wait (bounded) until the server closes `sock` (EOF or reset); True if it did."""
    sock.settimeout(wait)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def trickle(sock: socket.socket, data: bytes, stop: threading.Event, every: float = 0.2) -> None:
    """Send `data` one byte every `every` seconds until it is sent, the server cuts the
    connection, or `stop` is set (bounded by `WAIT` in all)."""
    for i in range(min(len(data), int(WAIT / every))):
        try:
            sock.send(data[i : i + 1])
        except OSError:
            return
        if stop.wait(every):
            return
