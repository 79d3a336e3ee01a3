"""The rate floor: a holder that has a chunk but withholds it is suspected (docs/transport.md).

The stall timeout catches a silent holder. A holder that sends a byte now and then is never
silent, so it would keep a reader on it until the fetch's deadline although another holder
has the bytes. A `Pace` judges one CHUNK frame while it arrives: from the frame's first byte
the holder has the whole chunk (a holder sends a CHUNK header only for a chunk it holds,
COMPLETE or PARTIAL past it), so every byte of it the holder has not sent yet is a byte it
withholds. Over each window of `window` seconds (the fetch's stall timeout) the frame must
arrive at `floor` bytes/s or more, else `SlowHolder` is raised and the reader suspects the
holder as it does a silent one.

**The verdict is on time, whatever the byte pattern.** A window is judged at the moment it
fails — its end, or later while the bytes already in hand still cover the floor — not at
the next byte after it: the pace owns the socket's receive timeout while the window is at
risk and shortens it so the receive returns by then (`netio.recv_views` asks `timed_out`,
which judges and says whether to receive on). Judged at the next byte instead, a holder
sending one byte every 4 s of a 5 s window would be caught only at its third byte, 8 s in;
judged on time, a chunk that cannot meet the floor is abandoned within one window of its
first byte.

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
import math
import socket
import ssl
import struct
import termios
import time

from tensorhub.errors import SlowHolder

DEFAULT_RATE_FLOOR = 256 * 1024  # bytes/s: far below any useful link, far above a trickle
_MIN_WAIT = 0.001  # seconds: the shortest receive timeout set (0 would mean "none")


class Pace:
    """The delivery rate of one frame, judged window by window (a `netio.Meter`). `window`
    is also the stall timeout of the receives it meters, and none outlasts `deadline` (a
    time.monotonic() value): the bounds the caller armed the socket with (`netio.arm`)."""

    def __init__(
        self, floor: float, window: float, sock: socket.socket, deadline: float = math.inf
    ) -> None:
        self.floor, self.window, self._sock = floor, window, sock
        self.deadline = deadline
        self._start: float | None = None  # when the current window began
        self._got = 0  # bytes received in the current window
        self._last = 0.0  # when bytes last arrived (the stall clock)
        self._short = False  # the socket's receive timeout is ours, shorter than the caller's

    def note(self, n: int) -> None:
        """`n` more bytes of the frame arrived; raise `SlowHolder` if a window closed with
        fewer than `floor * elapsed` bytes."""
        now = time.monotonic()
        if self._start is None:  # the frame's first bytes: from now the holder has it all
            self._start, self._got, self._last = now, n, now
        else:
            self._got += n
            if n:
                self._last = now
            if now - self._start >= self.window:
                self._judge(now, self._start)
        self._arm(now)

    def timed_out(self) -> bool:
        """A receive timed out. Judge the window if it has closed (`SlowHolder`), and say
        whether to receive again: True when the timeout was this pace's own wake-up and the
        holder is neither silent for a whole window nor past the deadline; False when the
        caller's stall or deadline it is (before the frame's first byte, too)."""
        if self._start is None:
            return False
        now = time.monotonic()
        if now - self._start >= self.window:
            self._judge(now, self._start)
        if now >= min(self._last + self.window, self.deadline):
            return False
        self._arm(now)
        return True

    def rearm(self) -> None:
        """The caller armed the socket again (a new frame of a judge kept across frames):
        shorten its timeout again if the window is at risk."""
        self._short = False
        if self._start is not None:
            self._arm(time.monotonic())

    def _judge(self, now: float, start: float) -> None:
        """Raise `SlowHolder` if the window since `start` is under the floor, counting what
        waits in our socket, unless our own buffer held the holder back; else start anew."""
        elapsed = now - start
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

    def _arm(self, now: float) -> None:
        """Make the next receive return by the window's verdict: the first moment at or past
        its end at which the bytes in hand fall under the floor, if that comes before the
        stall timeout or the deadline would end it anyway. Costs a system call only while
        the window is at risk (its first bytes, or a slow holder), and once to give the
        caller's timeout back."""
        if self._start is None:
            return
        verdict = self._start + max(self.window, self._got / self.floor)
        until = min(self._last + self.window, self.deadline)
        if verdict < until:
            _wait_at_most(self._sock, verdict - now)
            self._short = True
        elif self._short:
            _wait_at_most(self._sock, until - now)
            self._short = False


def _wait_at_most(sock: socket.socket, seconds: float) -> None:
    """Let the next receive on `sock` block at most `seconds`: its SO_RCVTIMEO (the socket
    is blocking, as `netio.set_kernel_timeout` leaves it), or for TLS the socket timeout (an
    SSLSocket retries a read that the kernel timed out, so only its own timeout ends one)."""
    secs = max(seconds, _MIN_WAIT)
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(secs)
        return
    tv = struct.pack("ll", int(secs), int((secs % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def _queued(sock: socket.socket) -> tuple[int, int]:
    """Bytes received in `sock` that we have not read yet, and its receive buffer size."""
    pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        capacity = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        return pending, 0
    return pending + int(struct.unpack("i", raw)[0]), int(capacity)
