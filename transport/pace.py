"""The rate floor: a holder that has a chunk but withholds it is suspected (docs/transport.md).

The stall timeout catches a silent holder. A holder that sends a byte now and then is never
silent, so it would keep a reader on it until the fetch's deadline although another holder
has the bytes. A `Pace` judges one CHUNK frame while it arrives: from the frame's first byte
the holder has the whole chunk (a holder sends a CHUNK header only for a chunk it holds,
COMPLETE or PARTIAL past it), so every byte of it the holder has not sent yet is a byte it
withholds. Over each window of `window` seconds (the fetch's stall timeout) the frame must
arrive at `floor` bytes/s or more, else `SlowHolder` is raised and the reader suspects the
holder as it does a silent one.

Only the holder's withholding counts, never the reader's own slowness: bytes already queued
in our socket (FIONREAD) count as delivered, and a window that closes with our receive
buffer half full or more is not judged at all — the holder was flow-controlled by us (the
reader was CPU-starved, or its process stopped and resumed) — and the window starts again.

Time before a frame's first byte is not judged: a PARTIAL holder may legitimately wait for a
chunk it is still receiving itself (bounded by the request's wait and NOT_READY), so a
pipelined reader behind a slow upstream is never penalised for its upstream's upstream.
"""

from __future__ import annotations

import fcntl
import socket
import ssl
import struct
import termios
import time

from tensorhub.errors import SlowHolder

DEFAULT_RATE_FLOOR = 256 * 1024  # bytes/s: far below any useful link, far above a trickle


class Pace:
    """The delivery rate of one frame, judged window by window (a `netio.Meter`)."""

    def __init__(self, floor: float, window: float, sock: socket.socket) -> None:
        self.floor, self.window, self._sock = floor, window, sock
        self._start: float | None = None  # when the current window began
        self._got = 0  # bytes received in the current window

    def note(self, n: int) -> None:
        """`n` more bytes of the frame arrived; raise `SlowHolder` if a window closed with
        fewer than `floor * elapsed` bytes."""
        now = time.monotonic()
        if self._start is None:  # the frame's first bytes: from now the holder has it all
            self._start, self._got = now, n
            return
        self._got += n
        elapsed = now - self._start
        if elapsed < self.window:
            return
        if self._got < self.floor * elapsed:  # rare: look at what is waiting for us
            queued, capacity = _queued(self._sock)
            delivered = self._got + queued
            rate = delivered / elapsed
            if rate < self.floor and queued < capacity // 2:
                err = SlowHolder(
                    f"holder sent {delivered} B of chunks it has in {elapsed:.1f}s "
                    f"({rate:.0f} B/s, under the rate floor of {self.floor:.0f} B/s)"
                )
                err.rate = rate
                raise err
        self._start, self._got = now, 0


def _queued(sock: socket.socket) -> tuple[int, int]:
    """Bytes received in `sock` that we have not read yet, and its receive buffer size."""
    pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        capacity = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        return pending, 0
    return pending + int(struct.unpack("i", raw)[0]), int(capacity)
