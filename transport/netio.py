"""Blocking socket I/O with timeouts, scatter-gather and no intermediate copies.

Every call here blocks for at most the socket's timeout, which callers set from their
deadline (`arm`). A timeout or a peer that closes early becomes `TransportError`, so a
stalled or dead peer is always reported, never waited on forever.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Sequence
from typing import Protocol

from tensorhub.errors import DeadlineExceeded, TransportError

IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg_into call


class Hasher(Protocol):
    """What `recv_views` needs from a streaming checksum (xxhash.xxh3_64 fits)."""

    def update(self, data: memoryview, /) -> None: ...


class Meter(Protocol):
    """What `recv_views` tells about the pace of arrival (transport.pace.Pace fits): it is
    called after every receive with the bytes it got, and may raise to abort. It may also
    shorten the socket's receive timeout to judge on time: a receive that times out asks
    `timed_out`, which may raise, and receives again when it returns True."""

    def note(self, n: int, /) -> None: ...

    def timed_out(self) -> bool: ...


def set_kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every send/recv on `sock` by `seconds` with SO_RCVTIMEO/SO_SNDTIMEO.

    The socket stays in blocking mode, so a large recv with MSG_WAITALL or a large sendmsg
    is one syscall, not a poll()+call pair per fragment as with `settimeout`; a timeout
    surfaces as EAGAIN, which the helpers here turn into `TransportError`.

    A TLS socket gets a socket timeout instead: an SSLSocket in blocking mode retries a read
    that the kernel timed out (EAGAIN is "want read" to it), so SO_RCVTIMEO never ended one
    and a silent TLS peer held the call until the socket was shut."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(max(seconds, 0.001))
        return
    sock.settimeout(None)
    secs = max(seconds, 0.001)
    tv = struct.pack("ll", int(secs), int((secs % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def arm(sock: socket.socket, deadline: float, stall: float) -> None:
    """Let each following blocking call on `sock` wait at most `stall` seconds and never
    past `deadline` (a `time.monotonic()` value); raise `DeadlineExceeded` if it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("deadline passed before the socket operation")
    set_kernel_timeout(sock, min(stall, left))


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Receive exactly `n` bytes (small frames: headers and request bodies)."""
    buf = bytearray(n)
    recv_views(sock, [memoryview(buf)])
    return buf


def recv_views(
    sock: socket.socket,
    views: Sequence[memoryview],
    hasher: Hasher | None = None,
    meter: Meter | None = None,
) -> int:
    """Fill `views` in order straight from the socket (recv_into / recvmsg_into), feeding
    each received piece to `hasher` while it is still in cache, and its size to `meter`.
    Returns bytes received."""
    views = [v for v in views if len(v)]
    total, i, pos, n = 0, 0, 0, len(views)  # i: current view, pos: offset inside it
    one_at_a_time = isinstance(sock, ssl.SSLSocket)  # TLS has no recvmsg_into
    try:
        while i < n:
            rest = views[i][pos:]
            try:
                if len(rest) >= 65536 or i + 1 == n or one_at_a_time:
                    got = sock.recv_into(rest)
                else:  # many small views: one syscall fills several of them
                    got = sock.recvmsg_into([rest, *views[i + 1 : i + IOV_MAX]])[0]
            except (TimeoutError, BlockingIOError):
                if meter is not None and meter.timed_out():
                    continue  # the meter's own wake-up: it judged, and the peer is not stalled
                raise
            if got == 0:
                raise TransportError("peer closed the connection mid-frame")
            total += got
            if meter is not None:
                meter.note(got)
            while got:
                view = views[i]
                take = min(got, len(view) - pos)
                if hasher is not None:
                    hasher.update(view[pos : pos + take])
                pos += take
                got -= take
                if pos == len(view):
                    i, pos = i + 1, 0
    except (TimeoutError, BlockingIOError) as exc:
        raise TransportError("peer stalled: no bytes within the stall timeout") from exc
    except OSError as exc:
        raise TransportError(f"receive failed: {exc}") from exc
    return total


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send `views` back to back with sendmsg (gather, no joins); partial sends resume."""
    pending = [v for v in views if len(v)]
    i, n = 0, len(pending)
    try:
        if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg: one buffer at a time
            for view in pending:
                sock.sendall(view)
            return
        while i < n:
            sent = sock.sendmsg(pending[i : i + IOV_MAX])
            while sent:
                head = pending[i]
                if sent >= len(head):
                    sent -= len(head)
                    i += 1
                else:
                    pending[i] = head[sent:]
                    sent = 0
    except (TimeoutError, BlockingIOError) as exc:
        raise TransportError("peer stopped reading within the stall timeout") from exc
    except OSError as exc:
        raise TransportError(f"send failed: {exc}") from exc
