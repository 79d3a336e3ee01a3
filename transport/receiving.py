"""One round's shared state and the receipt of one chunk (the reader's hot path).

`FetchState` holds what a round's workers share: the destination, the deadline, the fetch's
stats (shared by its rounds), the open sockets (so the round can cut them when it ends), the
read token's source and the checks to run. Each round has its own, so a worker a round left
behind can start nothing in the next one. `receive` reads one CHUNK (or ERROR) frame,
receives the payload with recv_into straight into the destination while hashing it,
verifies it and commits it, and says how that went as a typed `ChunkOutcome`
(transport/outcome.py).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import xxhash

from tensorhub.errors import DeadlineExceeded, IntegrityError, TransportError
from transport.checks import STRICT, ChunkChecks
from transport.checksums import WSUM64, XXH3, kind_of, wsum64_of_views
from transport.netio import arm, recv_views
from transport.outcome import ChunkOutcome, ChunkStatus, FetchStats
from transport.pace import DEFAULT_RATE_FLOOR, Pace
from transport.planner import Source
from transport.staging import StagingBuffer
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.wire import (
    FLAG_COMPLETE,
    MAX_CHUNKS_PER_GET,
    FrameType,
    decode_chunk_header,
    decode_error,
    read_flagged_frame,
)

BATCH_BYTES = 64 * 1024 * 1024  # chunks asked for per GET: one round trip per ~64 MiB

TokenSource = Callable[[], bytes]
"""Called before every GET for the read token to send: a fetch that outlives one token
gets a fresh one from the SDK (ros.client.read_token) without stopping."""


class FetchState:
    """The state shared by one round's workers."""

    def __init__(
        self,
        tenant: str,
        model: str,
        version: int,
        dest: HeldVersion,
        token: bytes | TokenSource,
        deadline: float,
        stall: float,
        expected: Sequence[int] | None = None,
        tls: TlsConfig | None = None,
        rate_floor: float = DEFAULT_RATE_FLOOR,
        checks: ChunkChecks = STRICT,
        stats: FetchStats | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
        checksum: str = XXH3,
    ) -> None:
        self.tenant, self.model, self.version = tenant, model, version
        self.rate_floor = rate_floor
        self.expected = expected
        self.checksum = kind_of(checksum)  # the algorithm of `expected` (transport.checksums)
        self.checks = checks
        self.tls = tls.client_context() if tls is not None else None
        self.dest, self.layout = dest, dest.layout
        self._tokens: TokenSource = token if callable(token) else (lambda: token)
        self._last_token: bytes | None = None
        self.deadline, self.stall = deadline, stall
        self.stats = FetchStats() if stats is None else stats  # the fetch's, across rounds
        self.on_chunk = on_chunk  # told of each chunk committed (the SDK's progress)
        self.lock = threading.Lock()
        self.socks: set[socket.socket] = set()
        self.aborted = False
        # BATCH_BYTES per request, but never more chunks than a holder accepts in one GET
        # (small chunks: 4 KiB chunks would ask 16,384 at a time, and be refused).
        self.batch = min(max(1, BATCH_BYTES // self.layout.chunk_size), MAX_CHUNKS_PER_GET)

    def published(self, index: int, xxh3: int, views: Sequence[memoryview]) -> bool:
        """Whether chunk `index`, received into `views` (whose xxh3-64 is `xxh3`), is what the
        publisher's manifest says, by the manifest's algorithm: the xxh3 itself, or a wsum64
        of the received bytes. True without a manifest to check against."""
        if self.expected is None or not self.checks.manifest:
            return True
        if self.checksum == WSUM64:
            return wsum64_of_views(views) == self.expected[index]
        return xxh3 == self.expected[index]

    def token(self) -> bytes:
        """The read token for the next GET (counted in `stats.read_tokens` when new)."""
        token = self._tokens()
        with self.lock:
            if token != self._last_token:
                self._last_token = token
                self.stats.read_tokens += 1
        return token

    def abort(self) -> None:
        """Cut every connection so workers stop promptly (the fetch has ended)."""
        with self.lock:
            self.aborted = True
            socks = list(self.socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def connect(self, source: Source) -> socket.socket:
        """One connection to `source`, bounded by the stall timeout and the deadline. No
        retry here: a holder that refuses is given up on for this round, and whether to try
        it again later is the fetch orchestrator's call (ros/client/orchestrator.py)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("fetch deadline passed while connecting")
        try:
            sock = socket.create_connection(
                (source.host, source.port), timeout=min(self.stall, left)
            )
        except OSError as exc:
            raise TransportError(f"cannot connect to {source.holder_id}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:  # the handshake is bounded by the connect timeout
            try:
                sock = self.tls.wrap_socket(sock)
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                raise TransportError(
                    f"TLS handshake with {source.holder_id} failed: {exc}"
                ) from exc
        with self.lock:
            self.socks.add(sock)
            if self.aborted:
                sock.shutdown(socket.SHUT_RDWR)
        return sock

    def pace(self, sock: socket.socket) -> Pace | None:
        """A fresh rate-floor judge of `sock` (None when the floor is off)."""
        if self.rate_floor <= 0:
            return None
        return Pace(self.rate_floor, self.stall, sock, self.deadline)

    def receive(
        self, sock: socket.socket, index: int, staging: StagingBuffer | None, pace: Pace | None
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
        arm(sock, self.deadline, self.stall)
        if pace is None:
            pace = self.pace(sock)
        else:  # a judge kept across frames: arm() gave the socket the caller's timeout back
            pace.rearm()
        ftype, flags, body = read_flagged_frame(sock, pace)
        if ftype is FrameType.ERROR:
            return ChunkOutcome.refused(index, decode_error(body))
        if ftype is not FrameType.CHUNK:
            raise TransportError(f"holder sent {ftype.name} where a CHUNK was due")
        h = decode_chunk_header(body)
        same = (h.tenant, h.model, h.version) == (self.tenant, self.model, self.version)
        if not same and self.checks.version:
            why = f"holder sent {h.model}@{h.version} for {self.model}@{self.version}"
            return ChunkOutcome(index, ChunkStatus.CORRUPT, IntegrityError(why))
        expected = self.layout.payload_bytes(index)
        if (h.index, h.offset, h.length) != (index, index * self.layout.chunk_size, expected):
            raise TransportError(f"holder sent chunk {h.index} ({h.length} B), wanted {index}")
        hasher = xxhash.xxh3_64()
        views = self.dest.sink_views(index, staging)
        try:
            recv_views(sock, views, hasher, pace)
        except TransportError:
            self.stats.touched.add(index)
            raise
        why = ""
        if hasher.intdigest() != h.checksum and self.checks.checksum:
            why = f"chunk {index} failed its checksum"
        elif not self.published(index, h.checksum, views):
            # intact on the wire but not what was published: the holder's memory changed
            why = f"chunk {index} differs from the published version"
        if why:
            self.stats.touched.add(index)
            with self.lock:
                self.stats.discarded_bytes += expected
            return ChunkOutcome(index, ChunkStatus.CORRUPT, IntegrityError(why))
        self.dest.commit(index, h.checksum, staging)
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
