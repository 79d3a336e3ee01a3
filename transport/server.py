"""The TCP holder backend (`transport.backend.HolderBackend`): serves chunks of the
versions in a `HolderStore`.

One thread per connection, accepted by `transport.listener` and admitted by
`transport.admission`: at most `max_connections`
and at most `per_peer` from one address; at either bound a connection that has not presented
a valid read token is evicted to admit a newcomer (told BUSY, on a port without TLS), and
only when every candidate has presented one is the newcomer refused BUSY. A request frame
must be complete within `frame_timeout` or the connection is closed — so idle or
byte-trickling connections cannot hold the port, even from the readers' own host. Each
request is checked — frame, names, then `transport.verifier.lookup`: read token (the
pluggable `verifier`), held version, layout digest, chunk range — before any byte of a
tensor is touched; a chunk is then sent straight
from the tensors' memory with one sendmsg of header + memoryviews. A GET_RANGES is checked the
same way, and each of its ranges must lie inside its chunk; each range is then sent as a
CHUNK of its own, its checksum the xxh3-64 of the range's bytes. Every socket operation
has a timeout, so a silent or stalled peer costs one thread for a bounded time, and any
malformed input ends in an ERROR frame and a closed connection, never a crash.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Protocol

import xxhash

from tensorhub.errors import BadRange, TensorHubError, TransportError, VersionUnavailable
from transport.admission import Conn
from transport.backend import TransportKind
from transport.listener import Listener, shut
from transport.netio import recv_exact, send_views, set_kernel_timeout
from transport.ranged import check_in_chunks, ranged_views
from transport.reader import DEFAULT_PARALLEL
from transport.staging import StagingBuffer
from transport.store import HeldVersion, HolderStore
from transport.tls import TlsConfig
from transport.verifier import Verifier, lookup
from transport.wire import (
    HEADER,
    ChunkHeader,
    ErrorCode,
    FrameType,
    GetRequest,
    RangeRequest,
    Rejection,
    decode_get,
    decode_get_ranges,
    encode_chunk_header,
    encode_error,
    parse_header,
)

log = logging.getLogger(__name__)

ROLLOUTS_PER_HOST = 8  # an 8-GPU host runs up to 8 rollouts, each reading with `parallel`
PER_PEER = 2 * ROLLOUTS_PER_HOST * DEFAULT_PARALLEL  # 64: all of them, with room to reconnect
MAX_CONNECTIONS = 2 * PER_PEER  # 128: one address never takes more than half the slots
FRAME_TIMEOUT = 10.0  # seconds for a complete request frame (from accept, or its first byte)

Stager = Callable[[HeldVersion], StagingBuffer | None]
"""The host staging a connection sends a version's chunks through (None: straight from the
tensors' memory). Called once per connection and kind of version (device, chunk size)."""


def cuda_staging(held: HeldVersion) -> StagingBuffer | None:
    """Double-buffered pinned staging for a CUDA-resident version, none for host memory."""
    if not held.on_cuda:
        return None
    return StagingBuffer.for_tensors(held.layout.chunk_size, held.tensors.values())


class ChunkSender(Protocol):
    """How the server puts one chunk on the wire: the CHUNK frame for `header` (with
    FLAG_COMPLETE when `complete`), then the payload `views`. Production uses
    `send_chunk`; chaos runs and tests inject a misbehaving one (`chaos.holder_faults`),
    so the server itself has no misbehaviour path."""

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None: ...


def send_chunk(
    conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
) -> None:
    """Send a chunk with one sendmsg of header + the tensors' own memoryviews (no copy)."""
    send_views(conn, [memoryview(encode_chunk_header(header, complete=complete)), *views])


class _Refuse(Exception):
    """Internal: answer the request with an ERROR frame and close the connection."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class HolderServer(Listener):
    """Serve the chunks of `store`'s versions on `host:port` (port 0: pick a free one).

    `verifier` decides who may read; `send` puts each chunk on the wire (`send_chunk`:
    tests and chaos runs pass a misbehaving one); `stage` picks the host staging of a
    version's chunks (`cuda_staging`); all are fixed at construction. The accept loop and
    admission are `transport.listener`'s, the request check `transport.verifier.lookup`."""

    name = "holder"
    kind = TransportKind.TCP

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = MAX_CONNECTIONS,
        per_peer: int = PER_PEER,
        frame_timeout: float = FRAME_TIMEOUT,
        io_timeout: float = 30.0,
        max_chunk_wait: float = 30.0,
        tls: TlsConfig | None = None,
        on_served: Callable[[int], None] | None = None,
        send: ChunkSender = send_chunk,
        stage: Stager = cuda_staging,
    ) -> None:
        super().__init__(
            host, port, max_connections=max_connections, per_peer=per_peer,
            frame_timeout=frame_timeout, io_timeout=io_timeout,
        )  # fmt: skip
        self.store, self.verifier = store, verifier
        self._send = send  # how each chunk goes out: fixed for the server's life
        self._stage = stage
        self._tls = tls.server_context() if tls is not None else None
        self._on_served = on_served  # called with each chunk's payload bytes (metrics)
        self._max_wait = max_chunk_wait

    def register(self, held: HeldVersion) -> None:
        """Nothing to do: chunks are sent from the tensors' memory where it is."""

    def release(self, held: HeldVersion) -> None:
        """Nothing to drop: the release already refuses new GETs and waited for the rest."""

    def busy(self, why: str) -> bytes:
        return encode_error(ErrorCode.BUSY, why)

    def evict(self, victim: Conn) -> None:
        if self._tls is None:
            _cut_reads(victim.sock)  # its thread wakes, answers BUSY and closes it
        else:  # its TLS state is its thread's: an end of stream there is an error
            shut(victim.sock)

    def serve(self, record: Conn) -> None:
        conn = record.sock
        try:
            if self._tls is not None:
                conn = self._handshake(record)
            set_kernel_timeout(conn, self.io_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            staging: dict[tuple[bool, int], StagingBuffer | None] = {}  # made when first needed
            while not self.stopping.is_set():
                try:
                    req = self._request(record, conn)
                    self._answer(record, conn, req, staging)
                    self.admission.idle(record)
                except _Refuse as refusal:
                    with contextlib.suppress(OSError):
                        conn.sendall(encode_error(refusal.code, str(refusal)))
                    return
        except (TransportError, OSError) as exc:
            if record.evicted and self._tls is None:
                self._told_busy(conn)
            log.debug("holder connection closed: %s", exc)

    def _told_busy(self, conn: socket.socket) -> None:
        """Answer an evicted connection BUSY before it closes (best effort, within 1 s), so
        a reader evicted before its GET arrived retries within its deadline (the SDK does)
        instead of suspecting a holder that is only full. Its reads were cut, not its
        writes. Not over TLS: OpenSSL meets the cut read as an unexpected end of stream and
        answers it with a fatal alert, so an evicted TLS connection is simply cut (a peer
        there must also hold a certificate from the holder's CA)."""
        with contextlib.suppress(OSError):
            set_kernel_timeout(conn, 1.0)
            conn.sendall(encode_error(ErrorCode.BUSY, "evicted: too many connections"))

    def _request(self, record: Conn, conn: socket.socket) -> GetRequest | RangeRequest:
        """Receive one GET or GET_RANGES. The first frame is due within `frame_timeout` of
        accept; on a connection already served, the next may start within `io_timeout` and
        must then be complete within `frame_timeout` of its first byte (the accept loop
        enforces both)."""
        first = bytearray()
        if record.authenticated:
            first = recv_exact(conn, 1)
            self.admission.frame_started(record)
        parsed = parse_header(first + recv_exact(conn, HEADER.size - len(first)))
        if isinstance(parsed, Rejection):
            raise _Refuse(parsed.code, parsed.message)
        ftype, length = parsed
        body = recv_exact(conn, length)
        self.admission.answering(record)
        if ftype not in (FrameType.GET, FrameType.GET_RANGES):
            raise _Refuse(
                ErrorCode.BAD_FRAME, f"holder accepts GET and GET_RANGES, not {ftype.name}"
            )
        try:
            return decode_get(body) if ftype is FrameType.GET else decode_get_ranges(body)
        except (TransportError, BadRange) as exc:
            raise _Refuse(ErrorCode.BAD_REQUEST, str(exc)) from exc

    def _handshake(self, record: Conn) -> socket.socket:
        """Wrap an accepted connection in TLS (within the first frame's deadline); a peer
        without a certificate from our CA fails here, before it can send a request."""
        raw = record.sock
        if self._tls is None:
            return raw
        raw.settimeout(self.io_timeout)
        # Wrapping detaches `raw` (its fd moves to the TLS socket): record the TLS socket
        # before the handshake, so a late handshake can be cut (frame deadline, eviction).
        conn = self._tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        self.admission.replace_socket(record, conn)
        try:
            conn.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            conn.close()
            raise TransportError(f"TLS handshake failed: {exc}") from exc
        return conn

    def _lookup(self, record: Conn, req: GetRequest | RangeRequest) -> HeldVersion:
        key = (req.tenant, req.model, req.version)
        chunks = req.chunks if isinstance(req, GetRequest) else [r.chunk for r in req.ranges]
        found = lookup(self.store, self.verifier, key, req.token, req.layout_digest, chunks)
        if isinstance(found, HeldVersion):
            self.admission.authenticated(record)
            if isinstance(req, RangeRequest):
                try:
                    check_in_chunks(found.layout, req.ranges)
                except BadRange as exc:
                    raise _Refuse(ErrorCode.BAD_REQUEST, str(exc)) from exc
            return found
        if found.token_ok:
            self.admission.authenticated(record)
        raise _Refuse(found.code, found.message)

    def _answer(
        self,
        record: Conn,
        conn: socket.socket,
        req: GetRequest | RangeRequest,
        staging: dict[tuple[bool, int], StagingBuffer | None],
    ) -> None:
        held = self._lookup(record, req)
        kind = (held.on_cuda, held.layout.chunk_size)
        if kind not in staging:
            staging[kind] = self._stage(held)
        buf = staging[kind]
        try:
            with held.reading():
                try:
                    if isinstance(req, GetRequest):
                        self._send_chunks(conn, req, held, buf)
                    else:
                        self._send_ranges(conn, req, held, buf)
                finally:
                    if buf is not None:  # no copy may outlive the read (release waits for it)
                        buf.drain()
        except VersionUnavailable as exc:
            raise _Refuse(ErrorCode.RELEASED, str(exc)) from exc
        except TensorHubError as exc:
            if isinstance(exc, TransportError):
                raise
            raise _Refuse(ErrorCode.BAD_REQUEST, str(exc)) from exc

    def _send_chunks(
        self, conn: socket.socket, req: GetRequest, held: HeldVersion, buf: StagingBuffer | None
    ) -> None:
        """Send the chunks of `req` in order. Through staging, each chunk's device→host copy
        is started while the one before it is being sent (`then`: the next chunk, when this
        holder has it), and a chunk is sent once its own copy completed; the checksum is
        computed over the staged bytes when not cached."""
        wait = min(req.wait_ms / 1000, self._max_wait)
        chunks = req.chunks
        for k, index in enumerate(chunks):
            if not held.is_present(index) and not held.wait_present(index, wait):
                raise _Refuse(ErrorCode.NOT_READY, f"chunk {index} not received yet")
            nxt = chunks[k + 1] if k + 1 < len(chunks) else None
            then = nxt if buf is not None and nxt is not None and held.is_present(nxt) else None
            views = held.source_views(index, buf, then=then)
            checksum = held.checksum(index, buf)  # the same staged bytes: no second copy
            header = ChunkHeader(
                req.tenant,
                req.model,
                req.version,
                index,
                index * held.layout.chunk_size,
                sum(len(v) for v in views),
                checksum,
            )
            self._send(conn, header, views, held.complete)
            if self._on_served is not None:
                self._on_served(header.length)

    def _send_ranges(
        self, conn: socket.socket, req: RangeRequest, held: HeldVersion, buf: StagingBuffer | None
    ) -> None:
        """Send the ranges of `req` in order, each as a CHUNK whose offset is the range's in
        the flat space and whose checksum is the xxh3-64 of its bytes (the publisher's
        checksums are of whole chunks: the reader checks what the ranges make up). A chunk
        is waited for as for GET; its views (through staging, its staged copy) serve every
        consecutive range of it."""
        wait = min(req.wait_ms / 1000, self._max_wait)
        last: tuple[int, list[memoryview]] | None = None
        for r in req.ranges:
            if last is None or last[0] != r.chunk:
                if not held.is_present(r.chunk) and not held.wait_present(r.chunk, wait):
                    raise _Refuse(ErrorCode.NOT_READY, f"chunk {r.chunk} not received yet")
                last = (r.chunk, held.source_views(r.chunk, buf))
            views = ranged_views(last[1], r.offset, r.length)
            hasher = xxhash.xxh3_64()
            for view in views:
                hasher.update(view)
            offset = r.chunk * held.layout.chunk_size + r.offset
            header = ChunkHeader(
                req.tenant, req.model, req.version, r.chunk, offset, r.length,
                hasher.intdigest(),
            )  # fmt: skip
            self._send(conn, header, views, held.complete)
            if self._on_served is not None:
                self._on_served(header.length)


def _cut_reads(sock: socket.socket) -> None:
    """Evict a connection: its thread's pending receive returns at once (end of stream), and
    the thread can still write it a BUSY frame before it closes the socket. At the TCP level,
    for the reason `transport.listener.shut` says."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RD)
