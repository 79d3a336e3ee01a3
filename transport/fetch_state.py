"""What one round's workers share, whatever their backend: `FetchState`.

It holds the destination (a PARTIAL `HeldVersion`: the sink), the deadline and stall
timeout, the fetch's stats (shared by its rounds), the open sockets (so the round can cut
them when it ends), the read token's source and the chunk checks to run
(`transport.verification`). Each round has its own, so a worker a round left behind can
start nothing in the next one. Every reader backend (`transport.backend.ReaderBackend`)
reads from it: TCP's data connection and the RDMA and IPC control connections are all
opened by `connect`.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from tensorhub.errors import DeadlineExceeded, TransportError
from transport.checks import STRICT, ChunkChecks
from transport.checksums import XXH3, kind_of
from transport.outcome import FetchStats
from transport.pace import DEFAULT_RATE_FLOOR
from transport.planner import Source
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.verification import ChunkVerifier
from transport.wire import MAX_CHUNKS_PER_GET

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
        digests: Sequence[int] | None = None,
    ) -> None:
        self.tenant, self.model, self.version = tenant, model, version
        self.rate_floor = rate_floor
        self.checks = checks
        # the manifest's checksums, by their algorithm (transport.checksums), and under a
        # linear one the xxh3-64 its delta section records: every backend checks each chunk
        # against them before committing it (transport.verification)
        self.verify = ChunkVerifier(expected, kind_of(checksum), checks, digests)
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

    def token(self) -> bytes:
        """The read token for the next GET (counted in `stats.read_tokens` when new)."""
        token = self._tokens()
        with self.lock:
            if token != self._last_token:
                self._last_token = token
                self.stats.read_tokens += 1
        return token

    def discard(self, chunks: Sequence[int]) -> None:
        """Count `chunks` received and thrown away (corrupt, or copied under a release):
        a later copy of them is a refetch (`FetchStats`)."""
        with self.lock:
            self.stats.touched.update(chunks)
            self.stats.discarded_bytes += sum(self.layout.payload_bytes(i) for i in chunks)

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
