"""Byte ranges within chunks over TCP (GET_RANGES, docs/transport.md): what a reader that
needs only parts of a holder's chunks asks for, and how it receives them.

A range's bytes cannot be checked against the publisher's manifest (its checksums are of
whole chunks): `read_ranges` checks each range's CHUNK header and the xxh3-64 in it (what
the holder computed over the range: corruption on the way), writes the bytes into place
and marks nothing present. Its caller checks what the ranges make up against a checksum
of the publisher's (a reader in a declared layout: each chunk of its own block set against
the publisher's wsum64) before anything is marked present or served, and reads whole
chunks where that check fails or where the holder does not know the frame
(`RangesUnsupported`).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence

import xxhash

from tensorhub.errors import (
    BadRange,
    DeadlineExceeded,
    IntegrityError,
    RangesUnsupported,
    TransportError,
)
from transport.layout import Layout
from transport.netio import arm, recv_views
from transport.planner import Source
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.wire import (
    ChunkRange,
    ErrorCode,
    FrameType,
    RangeRequest,
    check_ranges,
    decode_chunk_header,
    decode_error,
    encode_get_ranges,
    read_frame,
)

__all__ = ["check_in_chunks", "ranged_views", "read_ranges"]


def ranged_views(views: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The views over bytes `[offset, offset + length)` of the concatenation of `views`
    (a chunk's segments), no copy; `BadRange` when the range passes their end."""
    out: list[memoryview] = []
    at, end = offset, offset + length
    base = 0
    for view in views:
        size = len(view)
        lo, hi = max(at, base), min(end, base + size)
        if lo < hi:
            out.append(view[lo - base : hi - base])
        base += size
    if end > base or sum(len(v) for v in out) != length:
        raise BadRange(f"range [{offset}, {end}) passes the end of a {base}-byte chunk")
    return out


def check_in_chunks(layout: Layout, ranges: Sequence[ChunkRange]) -> None:
    """`BadRange` unless every range lies inside its chunk of `layout`."""
    for r in ranges:
        if not 0 <= r.chunk < layout.num_chunks:
            raise BadRange(f"range names chunk {r.chunk} of {layout.num_chunks}")
        size = layout.payload_bytes(r.chunk)
        if r.offset + r.length > size:
            raise BadRange(
                f"range [{r.offset}, {r.offset + r.length}) of chunk {r.chunk} passes its "
                f"{size} bytes"
            )


def _connect(source: Source, deadline: float, stall: float, tls: TlsConfig | None) -> socket.socket:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("deadline passed before the ranges were asked for")
    try:
        sock = socket.create_connection((source.host, source.port), timeout=min(stall, left))
    except OSError as exc:
        raise TransportError(f"cannot connect to {source.holder_id}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return sock
    try:
        return tls.client_context().wrap_socket(sock)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise TransportError(f"TLS handshake with {source.holder_id} failed: {exc}") from exc


def read_ranges(
    source: Source,
    dest: HeldVersion,
    ranges: Sequence[ChunkRange],
    *,
    token: bytes,
    deadline: float,
    stall: float = 5.0,
    tls: TlsConfig | None = None,
    wait_ms: int = 0,
    landed: Callable[[int], None] | None = None,
) -> int:
    """Ask `source` for `ranges` of `dest`'s version and layout on one connection, and
    write each range's bytes into `dest`'s memory (host memory: a version in GPU memory is
    read in whole chunks). Returns the payload bytes received. Marks nothing present: the
    caller checks the bytes against the publisher's checksums first. `landed` is told each
    chunk once the last of its ranges in `ranges` (sorted by chunk) is in place.

    Raises `BadRange` (before any I/O) for ranges the frame refuses or that pass their
    chunk, `RangesUnsupported` when the holder does not know GET_RANGES (read whole chunks
    instead), `IntegrityError` when a range's bytes differ from the xxh3-64 its CHUNK header
    carries or the header names another version, `TransportError` for a broken or refused
    exchange (a refusal's own class where it has one: `Refusal.error`), `DeadlineExceeded`."""
    if dest.on_cuda:
        raise BadRange("ranges are received into host memory; a GPU destination reads whole")
    ranges = list(ranges)
    check_ranges(ranges)
    check_in_chunks(dest.layout, ranges)
    tenant, model, version = dest.key
    request = RangeRequest(
        tenant, model, version, dest.layout.digest, token, tuple(ranges), wait_ms
    )
    frame = encode_get_ranges(request)
    chunk_size = dest.layout.chunk_size
    received = 0
    sock = _connect(source, deadline, stall, tls)
    try:
        arm(sock, deadline, stall)
        sock.sendall(frame)
        for k, r in enumerate(ranges):
            arm(sock, deadline, stall)
            ftype, body = read_frame(sock)
            if ftype is FrameType.ERROR:
                refusal = decode_error(body)
                if refusal.code is ErrorCode.BAD_FRAME:
                    raise RangesUnsupported(
                        f"{source.holder_id} does not serve byte ranges: {refusal.message}"
                    )
                raise refusal.error()
            if ftype is not FrameType.CHUNK:
                raise TransportError(f"holder sent {ftype.name} where a CHUNK was due")
            h = decode_chunk_header(body)
            if (h.tenant, h.model, h.version) != (tenant, model, version):
                raise IntegrityError(f"holder sent {h.model}@{h.version} for {model}@{version}")
            want = (r.chunk, r.chunk * chunk_size + r.offset, r.length)
            if (h.index, h.offset, h.length) != want:
                raise TransportError(
                    f"holder sent {h.length} B of chunk {h.index} at {h.offset}, wanted "
                    f"{r.length} B of chunk {r.chunk} at {want[1]}"
                )
            views = ranged_views(dest.sink_views(r.chunk), r.offset, r.length)
            hasher = xxhash.xxh3_64()
            recv_views(sock, views, hasher)
            if hasher.intdigest() != h.checksum:
                raise IntegrityError(
                    f"range [{r.offset}, {r.offset + r.length}) of chunk {r.chunk} failed "
                    "its checksum"
                )
            received += r.length
            if landed is not None and (k + 1 == len(ranges) or ranges[k + 1].chunk != r.chunk):
                landed(r.chunk)
    except OSError as exc:
        raise TransportError(f"ranges from {source.holder_id}: {exc}") from exc
    finally:
        sock.close()
    return received
