"""A misbehaving holder, injected from outside: `Fault` is a `ChunkSender` for
`HolderServer(send=...)` (or `ros.connect(hooks=ClientHooks(send=...))`), wrapping
`transport.server.send_chunk`.

TEST ONLY: chaos runs (the `corrupt-holder` failpoint) and tests use it to make a holder
corrupt bytes, lie about the version, pause or trickle. The production server knows none
of this: it calls whatever sender it was built with (`transport.server.send_chunk`).

A `Fault` is mutable and read at every chunk, so its owner can switch a misbehaviour on
and off while the server runs (chaos: SIGUSR1/SIGUSR2; a test: after a first fetch).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace

from transport.netio import send_views
from transport.server import send_chunk
from transport.wire import ChunkHeader, encode_chunk_header


@dataclass
class Fault:
    """What a holder does wrong; all off: it sends like `send_chunk`."""

    corrupt: bool = False  # flip one payload byte (in a copy; the tensors stay intact)
    wrong_version: bool = False  # advertise version + 1 in every CHUNK header
    chunk_delay: float = 0.0  # sleep before each chunk (throttle, so tests can kill mid-way)
    trickle: float = 0.0  # send every frame at this many bytes/s, in small pieces (a trickler)

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        if self.chunk_delay:
            time.sleep(self.chunk_delay)  # a stopped server's cut socket fails the send
        if self.wrong_version:
            header = replace(header, version=header.version + 1)
        if self.corrupt and header.length:
            data = bytearray(b"".join(views))
            data[len(data) // 2] ^= 0xFF
            views = [memoryview(data)]
        if not self.trickle:
            send_chunk(conn, header, views, complete)
            return
        frame = memoryview(b"".join([encode_chunk_header(header, complete=complete), *views]))
        _trickle(conn, frame, self.trickle)


def _trickle(conn: socket.socket, data: memoryview, rate: float) -> None:
    """Send `data` at `rate` bytes/s, a piece every 50 ms (never silent for long)."""
    piece = max(1, int(rate / 20))
    for start in range(0, len(data), piece):
        time.sleep(min(piece, len(data) - start) / rate)
        send_views(conn, [data[start : start + piece]])
