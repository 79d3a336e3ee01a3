"""The reader side of the TCP data plane (`transport.backend.ReaderBackend`): GET frames over a
socket, payloads received in place (`transport.receiving`); what every other reader backend
falls back to."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence

from tensorhub.errors import TensorHubError
from transport.fetch_state import FetchState
from transport.kinds import TransportKind
from transport.netio import arm
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.pace import Pace
from transport.planner import Source
from transport.receiving import Settling, pace_for, receive
from transport.staging import StagingBuffer
from transport.wire import GetRequest, encode_get

__all__ = ["TcpChannel", "TcpTransport"]


class TcpChannel:
    """GET frames over one TCP (or TLS) connection; the reader's original hot path."""

    def __init__(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> None:
        self._f, self._source, self._staging = f, source, staging
        self._sock: socket.socket | None = None

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        f = self._f
        index = chunks[0] if chunks else -1
        settling = Settling(self._staging)  # DONE once committed (staging: copy completed)
        try:
            if self._sock is None:
                self._sock = f.connect(self._source)
            sock = self._sock
            arm(sock, f.deadline, f.stall)
            wait_ms = int(f.stall * 500)  # a PARTIAL holder may wait stall/2 for a chunk
            request = GetRequest(
                f.tenant,
                f.model,
                f.version,
                f.layout.digest,
                f.token(),
                tuple(chunks),
                wait_ms,
            )
            sock.sendall(encode_get(request))
            # Once the holder says it has every chunk, the time between its frames is time
            # it withholds bytes it has too: one judge for the rest of the batch.
            pace: Pace | None = None
            for index in chunks:
                out = receive(f, sock, index, self._staging, pace)
                if out.status is not ChunkStatus.DONE:
                    yield from settling.flush()
                    yield out
                    return
                yield from settling.done(out)
                if out.complete and pace is None and (pace := pace_for(f, sock)) is not None:
                    pace.note(0)  # its window starts now
            yield from settling.flush()
        except (TensorHubError, OSError) as exc:
            yield from settling.flush()  # chunks already verified are committed first
            yield ChunkOutcome.failed(index, exc)

    def close(self) -> None:
        """Close the connection; copies still pending (a batch its reader abandoned) are
        completed and their chunks committed, unreported, so none outlives the channel."""
        try:
            if self._staging is not None:
                self._staging.flush()
        finally:
            if self._sock is not None:
                sock, self._sock = self._sock, None
                with self._f.lock:
                    self._f.socks.discard(sock)
                sock.close()


class TcpTransport:
    """`ReaderBackend` over the TCP data plane (docs/transport.md)."""

    kind = TransportKind.TCP

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> TcpChannel:
        return TcpChannel(f, source, staging)

    def close(self) -> None:
        """Nothing to free: each channel owns its connection."""
