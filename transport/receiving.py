"""The TCP reader's hot path: the receipt of one CHUNK frame, and `Settling`.

`receive` reads one CHUNK (or ERROR) frame, receives the payload with recv_into straight
into the destination (or a host staging buffer) while hashing it, verifies it
(`transport.verification`, as every backend does) and commits it, and says how that went
as a typed `ChunkOutcome` (transport/outcome.py).
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Iterator

import xxhash

from tensorhub.errors import IntegrityError, TransportError
from transport.fetch_state import FetchState
from transport.netio import arm, recv_views
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.pace import Pace
from transport.staging import StagingBuffer
from transport.verification import HostBytes
from transport.wire import (
    FLAG_COMPLETE,
    FrameType,
    decode_chunk_header,
    decode_error,
    read_flagged_frame,
)


def pace_for(f: FetchState, sock: socket.socket) -> Pace | None:
    """A fresh rate-floor judge of `sock` (None when the floor is off)."""
    if f.rate_floor <= 0:
        return None
    return Pace(f.rate_floor, f.stall, sock, f.deadline)


def receive(
    f: FetchState,
    sock: socket.socket,
    index: int,
    staging: StagingBuffer | None,
    pace: Pace | None,
) -> ChunkOutcome:
    """Receive one CHUNK for `index` into `dest`, verify it, commit it. What the
    holder answered is the outcome: DONE (with its payload bytes and whether the holder
    has the whole version), CORRUPT, or the status of its ERROR frame's code. I/O
    failures (a timeout, a cut connection, the rate floor) raise, and a chunk that
    fails part-way is remembered in `touched`. The frame is judged by `pace` when given
    (a COMPLETE holder: across frames), else from its own first byte (transport/pace).
    Through `staging` (CUDA) the chunk is received and verified in a host buffer, and a
    DONE means its copy to the device was started: it is marked present once that copy
    completed, and `Settling` holds its DONE back until then."""
    arm(sock, f.deadline, f.stall)
    if pace is None:
        pace = pace_for(f, sock)
    else:  # a judge kept across frames: arm() gave the socket the caller's timeout back
        pace.rearm()
    ftype, flags, body = read_flagged_frame(sock, pace)
    if ftype is FrameType.ERROR:
        return ChunkOutcome.refused(index, decode_error(body))
    if ftype is not FrameType.CHUNK:
        raise TransportError(f"holder sent {ftype.name} where a CHUNK was due")
    h = decode_chunk_header(body)
    same = (h.tenant, h.model, h.version) == (f.tenant, f.model, f.version)
    if not same and f.checks.version:
        why = f"holder sent {h.model}@{h.version} for {f.model}@{f.version}"
        return ChunkOutcome(index, ChunkStatus.CORRUPT, IntegrityError(why))
    expected = f.layout.payload_bytes(index)
    if (h.index, h.offset, h.length) != (index, index * f.layout.chunk_size, expected):
        raise TransportError(f"holder sent chunk {h.index} ({h.length} B), wanted {index}")
    hasher = xxhash.xxh3_64()
    views = f.dest.sink_views(index, staging)
    try:
        recv_views(sock, views, hasher, pace)
    except TransportError:
        f.stats.touched.add(index)
        raise
    bad = f.verify.check(index, HostBytes(views, hasher.intdigest()), claimed=h.checksum)
    if bad is not None:
        f.discard([index])
        return ChunkOutcome(index, ChunkStatus.CORRUPT, bad)
    f.dest.commit(index, h.checksum, staging)
    return ChunkOutcome(
        index, ChunkStatus.DONE, nbytes=expected, complete=bool(flags & FLAG_COMPLETE)
    )


class Settling:
    """The DONE outcomes of one channel's batch, reported only once their chunks are
    committed. Without staging a chunk is present when `receive` returns, so its DONE goes
    out at once. Through `staging` its copy to the device is still running: its DONE waits
    until the copy completed and the chunk was marked present, so a chunk is never
    counted, told (`on_chunk`), or taken off the schedule before its bytes are in `dest`.
    Outcomes leave in the order the chunks were received."""

    def __init__(self, staging: StagingBuffer | None) -> None:
        self._staging = staging
        self._waiting: deque[ChunkOutcome] = deque()

    def done(self, out: ChunkOutcome) -> Iterator[ChunkOutcome]:
        """Hold `out` (a DONE from `receive`); yield every DONE whose chunk is committed."""
        self._waiting.append(out)
        yield from self._report(None if self._staging is None else self._staging.settled())

    def flush(self) -> Iterator[ChunkOutcome]:
        """Wait for every pending copy, commit it, and yield the DONEs still held: at the end
        of a batch and before any outcome that is not DONE (a failure included)."""
        yield from self._report(None if self._staging is None else self._staging.flush())

    def _report(self, settled: list[int] | None) -> Iterator[ChunkOutcome]:
        if settled is None:  # no staging: committed in `receive`
            settled = [out.index for out in self._waiting]
        for index in settled:
            out = self._waiting.popleft()
            if out.index != index:
                raise TransportError(f"chunk {index} committed where {out.index} was due")
            yield out
