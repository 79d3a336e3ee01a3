"""Length-prefixed messages for the holder's control channels (RDMA, same-host CUDA IPC).

Each message is a u32 big-endian length and that many bytes; both channels put UTF-8 JSON
in it, tagged with the channel's format. A length over the receiver's limit is refused
before any of the body is read, so a peer cannot make the holder buffer more than the limit.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from tensorhub.errors import TransportError

_LEN = struct.Struct("!I")


def framed(data: bytes) -> bytes:
    """`data` as one length-prefixed message."""
    return _LEN.pack(len(data)) + data


def send_message(sock: socket.socket, data: bytes) -> None:
    """One length-prefixed message."""
    sock.sendall(framed(data))


def recv_message(sock: socket.socket, limit: int) -> bytes:
    """One length-prefixed message of at most `limit` bytes (`TransportError` otherwise)."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > limit:
        raise TransportError(f"control message of {n} bytes is over {limit}")
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise TransportError("control channel closed mid-message")
        buf += got
    return bytes(buf)


def decode_json(data: bytes, limit: int, what: str, fmt: str) -> dict[str, Any]:
    """A JSON object of at most `limit` bytes whose "format" is `fmt`; `TransportError`
    (its message names `what`) for anything else."""
    if len(data) > limit:
        raise TransportError(f"{what} of {len(data)} bytes is over {limit}")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TransportError(f"{what} is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise TransportError(f"{what}: format is not {fmt!r}")
    return doc
