"""The holder's data-plane server: serves chunks of the versions in a `HolderStore`.

One thread per connection, at most `max_connections` (more get BUSY and are closed). Each
request is checked — frame, names, read token (the pluggable `verifier`), held version,
layout digest — before any byte of a tensor is touched; a chunk is then sent straight
from the tensors' memory with one sendmsg of header + memoryviews. Every socket operation
has a timeout, so a silent or stalled peer costs one thread for a bounded time, and any
malformed input ends in an ERROR frame and a closed connection, never a crash.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tensorhub.errors import TensorHubError, TransportError, VersionUnavailable
from transport.netio import recv_exact, send_views, set_kernel_timeout
from transport.staging import StagingBuffer
from transport.store import HeldVersion, HolderStore
from transport.tls import TlsConfig
from transport.wire import (
    HEADER,
    ChunkHeader,
    ErrorCode,
    FrameType,
    GetRequest,
    Rejection,
    decode_get,
    encode_chunk_header,
    encode_error,
    parse_header,
)

log = logging.getLogger(__name__)

Verifier = Callable[[str, str, int, bytes], bool]
"""`(tenant, model, version, token) -> bool`: may this token read this version here?"""


def allow_all(tenant: str, model: str, version: int, token: bytes) -> bool:
    """A verifier that accepts every token: for tests and single-user development only."""
    return True


@dataclass
class Fault:
    """Test-only misbehaviour of a holder; the server consults it only when one is set."""

    corrupt: bool = False  # flip one payload byte (in a copy; the tensors stay intact)
    wrong_version: bool = False  # advertise version + 1 in every CHUNK header
    chunk_delay: float = 0.0  # sleep before each chunk (throttle, so tests can kill mid-way)


class _Refuse(Exception):
    """Internal: answer the request with an ERROR frame and close the connection."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class HolderServer:
    """Serve the chunks of `store`'s versions on `host:port` (port 0: pick a free one)."""

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 64,
        io_timeout: float = 30.0,
        max_chunk_wait: float = 30.0,
        fault: Fault | None = None,
        tls: TlsConfig | None = None,
        on_served: Callable[[int], None] | None = None,
    ) -> None:
        self.store, self.verifier, self.fault = store, verifier, fault
        self._tls = tls.server_context() if tls is not None else None
        self._on_served = on_served  # called with each chunk's payload bytes (metrics)
        self._bind = (host, port)
        self._max_wait = max_chunk_wait
        self._io_timeout = io_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise TransportError("holder server is not started")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> HolderServer:
        listener = socket.create_server(self._bind, backlog=128)
        listener.settimeout(0.5)  # so the accept loop notices stop() promptly
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="holder-accept", daemon=True
        )
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop accepting, cut every open connection, and wait briefly for the threads."""
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join(timeout=2)

    def __enter__(self) -> HolderServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._stopped.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    conn.sendall(encode_error(ErrorCode.BUSY, "too many connections"))
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="holder-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._tls is not None:
                conn = self._handshake(conn)
            set_kernel_timeout(conn, self._io_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            staging: list[StagingBuffer] = []  # created on first CUDA chunk
            while not self._stopped.is_set():
                try:
                    parsed = parse_header(recv_exact(conn, HEADER.size))
                    if isinstance(parsed, Rejection):
                        raise _Refuse(parsed.code, parsed.message)
                    ftype, length = parsed
                    body = recv_exact(conn, length)
                    if ftype is not FrameType.GET:
                        raise _Refuse(ErrorCode.BAD_FRAME, f"holder accepts GET, not {ftype.name}")
                    try:
                        req = decode_get(body)
                    except TransportError as exc:
                        raise _Refuse(ErrorCode.BAD_REQUEST, str(exc)) from exc
                    self._answer(conn, req, staging)
                except _Refuse as refusal:
                    with contextlib.suppress(OSError):
                        conn.sendall(encode_error(refusal.code, str(refusal)))
                    return
        except (TransportError, OSError) as exc:
            log.debug("holder connection closed: %s", exc)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("holder connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _handshake(self, raw: socket.socket) -> socket.socket:
        """Wrap an accepted connection in TLS (bounded by the I/O timeout); a peer without
        a certificate from our CA fails here, before it can send a request."""
        if self._tls is None:
            return raw
        raw.settimeout(self._io_timeout)
        try:
            conn = self._tls.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            raise TransportError(f"TLS handshake failed: {exc}") from exc
        with self._lock:
            self._conns.discard(raw)
            self._conns.add(conn)
        return conn

    def _lookup(self, req: GetRequest) -> HeldVersion:
        try:
            allowed = self.verifier(req.tenant, req.model, req.version, req.token)
        except Exception as exc:
            log.warning("read-token verifier raised: %r", exc)
            allowed = False
        if not allowed:
            raise _Refuse(ErrorCode.DENIED, "read token not valid for this version")
        held = self.store.get((req.tenant, req.model, req.version))
        if held is None:
            raise _Refuse(ErrorCode.NOT_HELD, f"{req.model}@{req.version} not held here")
        if held.layout.digest != req.layout_digest:
            raise _Refuse(ErrorCode.LAYOUT_MISMATCH, "reader and holder layouts differ")
        if any(not 0 <= i < held.layout.num_chunks for i in req.chunks):
            raise _Refuse(ErrorCode.BAD_REQUEST, "chunk index out of range")
        return held

    def _answer(self, conn: socket.socket, req: GetRequest, staging: list[StagingBuffer]) -> None:
        held = self._lookup(req)
        if held.on_cuda and not staging:
            staging.append(StagingBuffer(held.layout.chunk_size))
        buf = staging[0] if staging else None
        wait = min(req.wait_ms / 1000, self._max_wait)
        try:
            with held.reading():
                for index in req.chunks:
                    if not held.is_present(index) and not held.wait_present(index, wait):
                        raise _Refuse(ErrorCode.NOT_READY, f"chunk {index} not received yet")
                    checksum = held.checksum(index, buf)
                    views = held.source_views(index, buf)
                    header = ChunkHeader(
                        req.tenant,
                        req.model,
                        req.version,
                        index,
                        index * held.layout.chunk_size,
                        sum(len(v) for v in views),
                        checksum,
                    )
                    if self.fault is not None:
                        header, views = self._misbehave(header, views)
                    send_views(conn, [memoryview(encode_chunk_header(header)), *views])
                    if self._on_served is not None:
                        self._on_served(header.length)
        except VersionUnavailable as exc:
            raise _Refuse(ErrorCode.RELEASED, str(exc)) from exc
        except TensorHubError as exc:
            if isinstance(exc, TransportError):
                raise
            raise _Refuse(ErrorCode.BAD_REQUEST, str(exc)) from exc

    def _misbehave(
        self, header: ChunkHeader, views: list[memoryview]
    ) -> tuple[ChunkHeader, list[memoryview]]:
        fault = self.fault
        if fault is None:
            return header, views
        if fault.chunk_delay:
            self._stopped.wait(fault.chunk_delay)
        if fault.wrong_version:
            header = ChunkHeader(
                header.tenant,
                header.model,
                header.version + 1,
                header.index,
                header.offset,
                header.length,
                header.checksum,
            )
        if fault.corrupt and header.length:
            data = bytearray(b"".join(views))
            data[len(data) // 2] ^= 0xFF
            views = [memoryview(data)]
        return header, views
