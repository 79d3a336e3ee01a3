"""Fetch one version from several holders straight into the destination tensors.

`fetch` plans the missing chunks of `dest` across `sources` (nearest first), then runs
`parallel` worker connections. Each worker asks its holder for a batch of chunks, receives
every payload with recv_into directly into the destination memory while hashing it, checks
the CHUNK header (tenant, model, version, index, offset, length) and the xxh3-64, and only
then marks the chunk present — from that moment `dest` (registered in the local store by
the caller) serves it to other readers. A holder that errs, sends bad bytes or stays
silent for `stall_timeout`, or sends a chunk it has below `rate_floor` bytes/s for as long
(transport/pace.py), is dropped for this fetch and its unfinished chunks re-planned at
once; only chunks not yet received are fetched again.
"""

from __future__ import annotations

import contextlib
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

import tenacity
import xxhash

from tensorhub.errors import (
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    SlowHolder,
    TensorHubError,
    TransportError,
    VersionUnavailable,
)
from tensorhub.names import validate_name, validate_version
from tensorhub.planted import planted_bug
from transport.layout import Layout
from transport.netio import arm, recv_views
from transport.outcome import FetchStats, final_error
from transport.pace import DEFAULT_RATE_FLOOR, Pace
from transport.planner import ChunkScheduler, Source, rank
from transport.staging import StagingBuffer
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.topology import Topology
from transport.wire import (
    FLAG_COMPLETE,
    MAX_CHUNKS_PER_GET,
    NOT_READY_TEXT,
    FrameType,
    GetRequest,
    decode_chunk_header,
    encode_get,
    raise_error_frame,
    read_flagged_frame,
)

__all__ = ["DEFAULT_RATE_FLOOR", "FetchStats", "Source", "fetch"]

DEFAULT_PARALLEL = 4
DEFAULT_STALL = 5.0
BATCH_BYTES = 64 * 1024 * 1024  # chunks asked for per GET: one round trip per ~64 MiB


class _Fetch:
    """The state shared by one fetch's workers."""

    def __init__(
        self,
        tenant: str,
        model: str,
        version: int,
        dest: HeldVersion,
        token: bytes,
        deadline: float,
        stall: float,
        expected: Sequence[int] | None = None,
        tls: TlsConfig | None = None,
        rate_floor: float = DEFAULT_RATE_FLOOR,
    ) -> None:
        self.tenant, self.model, self.version = tenant, model, version
        self.rate_floor = rate_floor
        self.expected = expected
        self.tls = tls.client_context() if tls is not None else None
        self.dest, self.layout, self.token = dest, dest.layout, token
        self.deadline, self.stall = deadline, stall
        self.stats = FetchStats()
        self.touched: set[int] = set()  # chunks with bytes received in a failed attempt
        self.lock = threading.Lock()
        self.socks: set[socket.socket] = set()
        self.aborted = False
        # BATCH_BYTES per request, but never more chunks than a holder accepts in one GET
        # (small chunks: 4 KiB chunks would ask 16,384 at a time, and be refused).
        self.batch = min(max(1, BATCH_BYTES // self.layout.chunk_size), MAX_CHUNKS_PER_GET)

    def abort(self) -> None:
        """Cut every connection so workers stop promptly (the fetch has ended)."""
        with self.lock:
            self.aborted = True
            socks = list(self.socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def connect(self, source: Source) -> socket.socket:
        """Connect with a short bounded retry (a holder may be just starting to listen)."""
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3)
            | tenacity.stop_after_delay(
                max(0.0, min(self.stall, self.deadline - time.monotonic()))
            ),
            wait=tenacity.wait_exponential(multiplier=0.02, max=0.2),
            retry=tenacity.retry_if_exception_type(ConnectionRefusedError),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    left = self.deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded("fetch deadline passed while connecting")
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
        return Pace(self.rate_floor, self.stall, sock) if self.rate_floor > 0 else None

    def receive(
        self, sock: socket.socket, index: int, staging: StagingBuffer | None, pace: Pace | None
    ) -> tuple[int, bool]:
        """Receive one CHUNK for `index` into `dest`, verify it, mark it present; returns its
        payload bytes and whether the holder said it has the whole version. A chunk that
        fails part-way is remembered in `touched`. The frame is judged by `pace` when given
        (a COMPLETE holder: across frames), else from its own first byte (transport/pace)."""
        arm(sock, self.deadline, self.stall)
        pace = pace or self.pace(sock)
        ftype, flags, body = read_flagged_frame(sock, pace)
        if ftype is FrameType.ERROR:
            raise_error_frame(body)
        if ftype is not FrameType.CHUNK:
            raise TransportError(f"holder sent {ftype.name} where a CHUNK was due")
        h = decode_chunk_header(body)
        unchecked = planted_bug("no-version-check")  # test-only: chaos planted-bug runs
        same = (h.tenant, h.model, h.version) == (self.tenant, self.model, self.version)
        if not same and not unchecked:
            raise IntegrityError(
                f"holder sent {h.model}@{h.version} for {self.model}@{self.version}"
            )
        expected = self.layout.payload_bytes(index)
        if (h.index, h.offset, h.length) != (index, index * self.layout.chunk_size, expected):
            raise TransportError(f"holder sent chunk {h.index} ({h.length} B), wanted {index}")
        hasher = xxhash.xxh3_64()
        try:
            recv_views(sock, self.dest.sink_views(index, staging), hasher, pace)
        except TransportError:
            self.touched.add(index)
            raise
        if hasher.intdigest() != h.checksum and not unchecked:
            self.touched.add(index)
            with self.lock:
                self.stats.discarded_bytes += expected
            raise IntegrityError(f"chunk {index} failed its checksum")
        if self.expected is not None and h.checksum != self.expected[index] and not unchecked:
            # Intact on the wire but not what was published: the holder's memory changed.
            self.touched.add(index)
            with self.lock:
                self.stats.discarded_bytes += expected
            raise IntegrityError(f"chunk {index} differs from the published version")
        self.dest.commit(index, h.checksum, staging)
        return expected, bool(flags & FLAG_COMPLETE)


def _pull(
    f: _Fetch,
    sched: ChunkScheduler,
    source: Source,
    conn: list[socket.socket],
    batch: list[int],
    staging: StagingBuffer | None,
) -> None:
    """Request and receive batches from `source` until no work is left for it, connecting
    on the first batch (into `conn`). `batch` holds the chunks asked for and not yet
    received, for the caller to re-plan if this raises."""
    while True:
        batch[:] = sched.take(source.holder_id, f.batch, f.deadline - time.monotonic())
        if not batch or f.aborted:
            return
        if not conn:
            conn.append(f.connect(source))
        sock = conn[0]
        arm(sock, f.deadline, f.stall)
        wait_ms = int(f.stall * 500)  # a PARTIAL holder may wait stall/2 for a chunk
        request = GetRequest(
            f.tenant, f.model, f.version, f.layout.digest, f.token, tuple(batch), wait_ms
        )
        sock.sendall(encode_get(request))
        # Once the holder says it has every chunk, the time between its frames is time it
        # withholds bytes it has too: one judge for the rest of the batch.
        pace: Pace | None = None
        while batch:
            index = batch[0]
            n, complete = f.receive(sock, index, staging, pace)
            if complete and pace is None and (pace := f.pace(sock)) is not None:
                pace.note(0)  # its window starts now
            with f.lock:
                stats = f.stats
                stats.bytes_per_source[source.holder_id] = (
                    stats.bytes_per_source.get(source.holder_id, 0) + n
                )
                stats.chunks += 1
                if index in f.touched:
                    stats.refetched_bytes += n
            sched.finished(batch.pop(0))


def _worker(f: _Fetch, sched: ChunkScheduler, source: Source) -> None:
    """One connection's worth of work against `source`; reconnects only after NOT_READY
    (a PARTIAL holder that lacks a chunk yet), and gives the holder up on anything else
    or on a second NOT_READY without progress in between."""
    staging = StagingBuffer(f.layout.chunk_size) if f.dest.on_cuda else None
    strikes = 0
    while not f.aborted:
        batch: list[int] = []
        conn: list[socket.socket] = []
        received = f.stats.bytes_per_source.get(source.holder_id, 0)
        try:
            _pull(f, sched, source, conn, batch, staging)
            return
        except TransportError as exc:
            progress = f.stats.bytes_per_source.get(source.holder_id, 0) != received
            strikes = 1 if progress else strikes + 1
            if NOT_READY_TEXT in str(exc) and strikes < 2:
                sched.requeue(source.holder_id, batch)
                continue
            sched.fail(source.holder_id, batch, exc)
            return
        except (TensorHubError, OSError) as exc:
            sched.fail(source.holder_id, batch, exc)
            return
        finally:
            for sock in conn:
                with f.lock:
                    f.socks.discard(sock)
                sock.close()


def _round(f: _Fetch, sources: Sequence[Source], me: Topology, parallel: int) -> ChunkScheduler:
    """Fetch the missing chunks from `sources` until done, no source is left, or deadline."""
    missing = f.dest.missing()
    sched = ChunkScheduler(missing, f.layout.payload_bytes, sources, me)
    per_source = max(1, math.ceil(parallel / max(1, len(sources))))
    threads = [
        threading.Thread(
            target=_worker, args=(f, sched, s), name=f"fetch-{s.holder_id}", daemon=True
        )
        for s in rank(me, sources)
        for _ in range(per_source)
    ]
    f.aborted = False
    for t in threads:
        t.start()
    try:
        sched.wait(f.deadline - time.monotonic())
    finally:
        f.abort()
        sched.wake()
        for t in threads:
            t.join(timeout=max(0.1, f.stall))
    for holder, exc in sched.failures.items():
        f.stats.failed_sources[holder] = repr(exc)
        if isinstance(exc, SlowHolder):
            f.stats.slow_sources[holder] = exc.rate
    return sched


def fetch(
    tenant: str,
    model: str,
    version: int,
    layout: Layout,
    dest: HeldVersion,
    sources: Sequence[Source],
    *,
    token: bytes,
    deadline: float,
    me: Topology,
    refresh_sources: Callable[[], Sequence[Source]] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    stall_timeout: float = DEFAULT_STALL,
    expected: Sequence[int] | None = None,
    tls: TlsConfig | None = None,
    rate_floor: float = DEFAULT_RATE_FLOOR,
) -> FetchStats:
    """Fill `dest`'s missing chunks of tenant/model@version from `sources` before
    `deadline` (a time.monotonic() value). Raises `VersionUnavailable` when no holder is
    left, `IntegrityError` when the only bytes on offer were bad, `DeadlineExceeded` when
    time ran out; never blocks past `deadline`. `expected`, when given, is the publisher's
    xxh3 of every chunk (from the manifest): a chunk that is intact on the wire but differs
    from it is treated like a corrupt one and fetched elsewhere. `tls` makes every
    connection mutual TLS (holders must serve TLS with a certificate from the same CA).
    `rate_floor` (bytes/s, 0: off) suspects a holder that sends a chunk it has slower than
    that for `stall_timeout` (a trickler), as a silent one is suspected."""
    validate_name(tenant, "tenant")
    validate_name(model, "model")
    validate_version(version)
    if dest.key != (tenant, model, version) or dest.layout.digest != layout.digest:
        raise InvalidArgument("dest does not hold this tenant/model/version/layout")
    if expected is not None and len(expected) != layout.num_chunks:
        raise InvalidArgument(f"{len(expected)} expected checksums for {layout.num_chunks} chunks")
    if parallel < 1 or stall_timeout <= 0 or rate_floor < 0:
        raise InvalidArgument("parallel must be >= 1, stall_timeout > 0 and rate_floor >= 0")
    start = time.monotonic()
    what = f"fetch {model}@{version}"
    f = _Fetch(
        tenant, model, version, dest, token, deadline, stall_timeout, expected, tls, rate_floor
    )
    suspects: set[str] = set()
    current = list(sources)
    # A round that ends with holders unreachable (VersionUnavailable) or with bad bytes from
    # every holder it tried (IntegrityError) is repeated with a fresh holder list, less the
    # suspects: a pipelined reader that starts from one predecessor must fall back to the
    # other holders when that predecessor fails it, whichever way it fails.
    retryable = (VersionUnavailable, IntegrityError)
    rounds = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(4)
        | tenacity.stop_after_delay(max(0.0, deadline - time.monotonic())),
        wait=tenacity.wait_exponential(multiplier=0.05, max=1.0),
        retry=tenacity.retry_if_exception(
            lambda e: refresh_sources is not None and isinstance(e, retryable)
        ),
        reraise=True,
        sleep=lambda s: time.sleep(min(s, max(0.0, deadline - time.monotonic()))),
    )
    last: TensorHubError | None = None
    for attempt in rounds:
        with attempt:
            if dest.complete:
                break
            usable = [s for s in current if s.holder_id not in suspects]
            if usable:
                sched = _round(f, usable, me, parallel)
                suspects.update(sched.failures)
                if dest.complete:
                    break
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"{what}: deadline passed with {len(dest.missing())} chunks missing"
                    )
                last = final_error(sched, what)
            elif not isinstance(last, IntegrityError):  # keep the most telling reason
                last = VersionUnavailable(f"{what}: no holder left")
            if refresh_sources is None or not isinstance(last, retryable):
                raise last
            current = list(refresh_sources())
            raise last
    f.stats.duration = time.monotonic() - start
    return f.stats
